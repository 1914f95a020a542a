"""Names that moved when the runner was split by concern (config / training / sweep / results), and
when the data modules left training (attnres.training.data -> attnres.data).

A run folder or a config folder of the user's, written before the move, names the old module
paths in its `_target_`s (`attnres.training.run.StepProgressBar`). `update_moved_targets(cfg)`
rewrites those to where the classes live now, in place, and says so once per key, so that such
a config keeps working; checkpoints name no module and need nothing. (Hydra's own callbacks
and launchers are instantiated by Hydra before any of this runs: a copied `conf/config.yaml`
must name `attnres.sweep.callback.SweepSummary` itself.)
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig, ListConfig, open_dict

log = logging.getLogger("attnres")

#: old `_target_` -> new `_target_`
MOVED = {
    "attnres.training.run.StepProgressBar": "attnres.training.progress.StepProgressBar",
    "attnres.training.callbacks.DepthDashboard": "attnres.training.dashboard.DepthDashboard",
    "attnres.training.callbacks.RoutingProbes": "attnres.training.routing.RoutingProbes",
    "attnres.training.callbacks.HParamsSummary": "attnres.training.tensorboard.HParamsSummary",
    "attnres.training.callbacks.TensorBoardLogger": "attnres.training.tensorboard.TensorBoardLogger",
    # the data modules left training for a room of their own (conf/data/*.yaml named the package's names)
    **{f"attnres.training.data{module}.{name}": f"attnres.data{module}.{name}"
       for module, names in {"": ("StdlibBytesDataModule", "TextBytesDataModule", "TokensDataModule",
                                  "SyntheticDataModule", "BytesDataModule"),
                             ".bytes": ("StdlibBytesDataModule", "TextBytesDataModule", "BytesDataModule"),
                             ".tokens": ("TokensDataModule",), ".synthetic": ("SyntheticDataModule",)}.items()
       for name in names},
}


def update_moved_targets(cfg: Any, where: str = "") -> list[str]:
    """Rewrite every `_target_` of `cfg` (a DictConfig or ListConfig, nested) that names a moved
    class; returns the keys it rewrote, each logged once as a warning that names the fix."""
    changed: list[str] = []
    if isinstance(cfg, DictConfig):
        items = [(str(k), cfg._get_node(k)) for k in cfg.keys()]
    elif isinstance(cfg, ListConfig):
        items = [(str(i), cfg._get_node(i)) for i in range(len(cfg))]
    else:
        return changed
    for key, node in items:
        path = f"{where}.{key}" if where else key
        if key == "_target_" and isinstance(cfg, DictConfig):
            old = node._value() if not node._is_interpolation() else None
            if isinstance(old, str) and old in MOVED:
                with open_dict(cfg):
                    cfg["_target_"] = MOVED[old]
                log.warning(f"{path}: {old} has moved to {MOVED[old]}; this run uses the new name "
                            f"(write {path}={MOVED[old]} in your config to silence this)")
                changed.append(path)
        elif isinstance(node, (DictConfig, ListConfig)):
            changed += update_moved_targets(node, path)
    return changed
