"""The Hydra callback that every sweep gets (conf/config.yaml), whichever launcher runs it: the
sweep folder locked for the sweep's life, and the summary written when it ends."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from attnres.atomic import DISK_FULL, WRITE_ERRORS
from attnres.config.errors import user_errors
from attnres.results import sequential, task_verdicts, tuning, verdict
from attnres.results.summary import format_counts, primary_metric, terminal_table, verdict_lines, write_sweep_summary
from attnres.results.tuned_summary import write_tuned_summary
from attnres.sweep import on_demand, plan
from attnres.sweep.plan import folder_key, no_jobs_error, record_outcome, sweep_jobs
from attnres.sweep.slots import lock_sweep_dir


class SweepSummary(Callback):
    """Hydra callback, whichever launcher runs the sweep: locks the sweep folder when the sweep
    starts (a second sweep into it is refused), and writes the summary when it ends, sends its
    verdict lines to the trackers the jobs logged to (`trackers.log_sweep`), and closes with one
    line that counts how this sweep's jobs ended (`plan.exit_status` reads the counts)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        with user_errors():  # before Hydra writes anything into the folder
            lock_sweep_dir(Path(str(config.hydra.sweep.dir)))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        counts = record_outcome(sweep_dir)  # first: exit_status must not depend on the plot
        if not counts:  # launchers that never call ours (basic, SLURM) with nothing to run
            with user_errors():
                raise no_jobs_error(config)
        margin = verdict.Margin.from_config(OmegaConf.select(config, "verdict", default=None))  # checked by then
        try:
            if tuning.is_tuned(sweep_dir):  # tune=lr: the tuned verdict leads; its lines carry their own heads
                rows, lines = write_tuned_summary(sweep_dir, margin=margin)
                heads = list(lines)
            else:
                this_sweep = sweep_jobs.get(folder_key(sweep_dir)) or None  # not the earlier sweeps' in the folder
                rows = write_sweep_summary(sweep_dir, only=this_sweep, margin=margin)
                found = verdict.comparisons(rows, primary_metric(rows), margin)
                sequential.apply(found, sequential.read_record(sweep_dir))  # seeds on demand: the design's intervals
                lines = verdict_lines(found, rows)
                lines += task_verdicts.lines(rows, margin)  # eval.tasks: a verdict per strategy and task metric
                heads = [f"verdict: {line}" for line in lines]
            if (stopped := on_demand.summary_line(sweep_dir)) is not None:  # which look it stopped at, and why
                lines.append(stopped)
                heads.append(stopped)
        except OSError as err:  # a full disk as the sweep ends: the jobs' results are whole, the summary waits
            if err.errno not in WRITE_ERRORS:
                raise
            plan.summary_unwritten.append(sweep_dir)
            why = "disk full" if err.errno in DISK_FULL else f"cannot write ({err.strerror})"
            print(f"attnres-run: error: {why} writing the sweep's summary {err.filename or sweep_dir}; the jobs' "
                  f"results are whole in {sweep_dir}: free some space, then run the same command with resume=true "
                  "to write it", file=sys.stderr, flush=True)
            print(f"sweep: {format_counts(counts)} -> no summary (not written)", flush=True)
            return
        print(terminal_table(rows), flush=True)
        for line in heads:
            print(line, flush=True)
        if _tracked(config):  # to MLflow / W&B, when the jobs tracked there
            from attnres.training.trackers import log_sweep  # here: it loads Lightning, which a sweep needs not

            log_sweep(config, sweep_dir, lines, rows)
        print(f"sweep: {format_counts(counts)} -> {sweep_dir / 'summary.md'}", flush=True)


def _tracked(config: DictConfig) -> bool:
    """Whether the sweep's jobs log to a logger of `attnres.training.trackers`."""
    loggers = OmegaConf.select(config, "logger", default=None) or {}
    return any(str(OmegaConf.select(node, "_target_", default="")).startswith("attnres.training.trackers.")
               for node in loggers.values())
