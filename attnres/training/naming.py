"""Run folder names: `${attnres.run_id:${hydra.job.override_dirname}}` in conf/config.yaml.

Registered on import (run.py imports this module), so that sweep workers have it too.
"""

from __future__ import annotations

from omegaconf import OmegaConf


def run_id(override_dirname: str) -> str:
    """The folder name of a run from Hydra's `override_dirname` ("defaults" when empty)."""
    return override_dirname or "defaults"


if not OmegaConf.has_resolver("attnres.run_id"):
    OmegaConf.register_new_resolver("attnres.run_id", run_id)
