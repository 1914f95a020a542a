"""The routing probes at the end of training.

`RoutingProbes` (off unless `enabled`) runs the causal routing probes of `attnres.probes` once
at the end of training, on the first `batches` validation batches: source knock-outs (a
knock-out heatmap beside the mass heatmap, and their per-sublayer rank correlation
[probe/routing]) and layer knock-outs [probe/layer_knockout], their raw arrays beside them
[probe/routing_data, probe/layer_knockout_data], `probes.json` in the run folder and PNGs in
its `plots/` (`write_probes`, shared with `attnres-probe`, attnres/training/probe_runs.py).
"""


from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor

from attnres import probes
from attnres.atomic import atomic_write, write_json
from attnres.results import figures, probe_figures
from attnres.training.tensorboard import log_array, tensorboard_writer

log = logging.getLogger("attnres")

PROBE_FILES = {"probe/routing": "routing.png", "probe/layer_knockout": "layer_knockout.png"}
PROBE_JSON = "probes.json"


def evaluation_batches(datamodule: Any, batches: int) -> list[tuple[Tensor, Tensor]]:
    """The probes' evaluation set: the first `batches` batches of the validation loader, in its
    order (all of them when it has fewer). The validation set is fixed, so this is too."""
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"batches={batches!r} must be an int >= 1 (validation batches the probes evaluate on)")
    out = []
    for batch in datamodule.val_dataloader():
        out.append((batch[0], batch[1]))
        if len(out) == batches:
            break
    if not out:
        raise ValueError("the validation set is empty; the probes need at least one validation batch")
    return out


def probe_arrays(probe: probes.RoutingProbe, effect_limit: float | None = None) -> dict[str, tuple[np.ndarray, dict]]:
    """image tag -> (raw array, metadata) of the probe's figures (`probe_figures.render_probe` draws them)."""
    common = {"strategy": probe.strategy, "mode": probe.mode, "clean_loss": probe.clean_loss, "tokens": probe.tokens}
    out = {}
    if probe.mass is not None and probe.source_effect is not None:
        R, C = probe.mass.shape
        data = np.full((4, R, C), np.nan)
        data[0], data[1] = probe.mass, probe.source_effect
        data[2, :, 0], data[3, :, 0] = probe.rank_correlation(), probe.top_agreement()
        finite = np.abs(probe.source_effect[np.isfinite(probe.source_effect)])
        limit = effect_limit or (float(finite.max()) if finite.size else None)
        out["probe/routing"] = (data, {**common, "rows": probe.row_labels, "cols": probe.col_labels,
                                       "sources": probe.sources, "effect_limit": limit})
    if probe.layer_effect is not None:
        out["probe/layer_knockout"] = (probe.layer_effect, {**common, "labels": probe.layer_labels})
    return out


def write_probes(probe: probes.RoutingProbe, run_dir: Path, step: int, writer: Any = None,
                 effect_limit: float | None = None, extra: Mapping[str, Any] | None = None) -> list[Path]:
    """`probes.json` (every number, `extra` added) in `run_dir`, the PNGs in `run_dir/plots/` and,
    given a SummaryWriter, the images and their raw arrays; each file written atomically.
    Returns the files written."""
    run_dir = Path(run_dir)
    written = [run_dir / PROBE_JSON]
    write_json(written[0], {**probe.to_dict(), "step": step, **(extra or {})})
    for tag, (data, meta) in probe_arrays(probe, effect_limit).items():
        fig = probe_figures.render_probe(tag, data, meta, step)
        path = run_dir / "plots" / PROBE_FILES[tag]
        atomic_write(path, lambda f, fig=fig: fig.savefig(f, dpi=figures.DPI, format="png"))
        written.append(path)
        if writer is not None:
            log_array(writer, probe_figures.PROBE_TAGS[tag], data, meta, step)
            writer.add_image(tag, figures.to_rgb(fig), step, dataformats="HWC")
    if writer is not None:
        writer.flush()
    return written


class RoutingProbes(pl.Callback):
    """Source and layer knock-outs (`attnres.probes`) at the end of training (module docstring).

    enabled: off by default (a cost: about 42 forward passes of each batch for the default
    Block AttnRes model, 11 for the standard residual; docs/dashboards.md, "Routing probes"). batches:
    validation batches in the evaluation set. mode: "remove" (renormalise over the other
    sources) or "mean" (replace the source by its mean over tokens). sources / layers: which
    knock-outs. max_stack: at most this many copies of a batch in one pass (memory grows with
    it: the logits are max_stack x B x T x V). dirpath: the run folder (default: the trainer's
    `default_root_dir`). Runs on rank 0, in eval mode without gradients, under the trainer's
    precision; a stop signal (SIGTERM, SIGINT) ends it between passes, and a failure is logged
    without failing the run, whose checkpoints are written already.
    """

    def __init__(self, enabled: bool = False, batches: int = 4, mode: str = "remove", sources: bool = True,
                 layers: bool = True, max_stack: int = 16, dirpath: str | None = None) -> None:
        for name, value in (("enabled", enabled), ("sources", sources), ("layers", layers)):
            if not isinstance(value, bool):
                raise ValueError(f"callbacks.routing_probes.{name} must be true or false, got {value!r}")
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ValueError(f"callbacks.routing_probes.batches must be an int >= 1 (validation batches), "
                             f"got {batches!r}")
        if isinstance(max_stack, bool) or not isinstance(max_stack, int) or max_stack < 1:
            raise ValueError(f"callbacks.routing_probes.max_stack must be an int >= 1 (copies of a batch in one "
                             f"pass), got {max_stack!r}")
        if mode not in probes.MODES:
            raise ValueError(f"callbacks.routing_probes.mode must be one of {', '.join(probes.MODES)}, got {mode!r}")
        self.enabled, self.batches, self.mode, self.sources, self.layers = enabled, batches, mode, sources, layers
        self.max_stack, self.dirpath = max_stack, dirpath
        self.seconds = 0.0  # wall time of the last probe (for the record)
        self.result: probes.RoutingProbe | None = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled or not trainer.is_global_zero:
            return
        if not isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy)):
            rank_zero_warn(f"RoutingProbes: off under {type(trainer.strategy).__name__} (sharded parameters)")
            return
        stop = next((c for c in trainer.callbacks if hasattr(c, "received") and hasattr(c, "exit_code")), None)
        if stop is not None and stop.received is not None:
            return
        start = time.perf_counter()
        try:
            batches = evaluation_batches(trainer.datamodule, self.batches)
            with trainer.precision_plugin.forward_context():
                self.result = probes.probe_routing(
                    pl_module.model, batches, mode=self.mode, sources=self.sources, layers=self.layers,
                    max_stack=self.max_stack,
                    should_stop=(lambda: stop.received is not None) if stop is not None else None)
            run_dir = Path(self.dirpath or trainer.default_root_dir)
            write_probes(self.result, run_dir, trainer.global_step, tensorboard_writer(trainer),
                         extra={"evaluation_set": f"the first {len(batches)} validation batches"})
        except probes.ProbesStopped:
            log.warning("routing probes: stopped by a signal; no probe results written")
            return
        except Exception as err:  # the run itself has finished: a probe failure must not fail it
            log.warning(f"routing probes failed and were skipped: {type(err).__name__}: {err}")
            return
        finally:
            self.seconds = time.perf_counter() - start
        log.info(f"routing probes: {self.seconds:.1f} s on {self.result.tokens} validation tokens; "
                 f"{run_dir / PROBE_JSON}, {run_dir / 'plots'}/")


