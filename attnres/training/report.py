"""How a run reports: metrics.json, the block it prints when it ends, its one-line description,
how an interrupted or failed run ends, and the run's log file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig
from omegaconf.errors import MissingMandatoryValue

from attnres.atomic import DISK_FULL, WRITE_ERRORS, read_json, write_json
from attnres.config.errors import ConfigError
from attnres.training.checkpoints import describe_checkpoint
from attnres.training.faults import Interrupted, RunEnded
from attnres.training.lit import THROUGHPUT_MIN_STEPS, THROUGHPUT_WARMUP, peak_memory_bytes
from attnres.training.optimizers import describe_optimizer
from attnres.training.refusal import undo_refused

log = logging.getLogger("attnres")


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


def write_summary(
    run_dir: Path, trainer: pl.Trainer, module: Any, wall_time_s: float, extra: dict[str, Any],
    status: str = "finished",
) -> dict[str, Any]:
    """metrics.json: status, final metrics, parameter counts, tokens seen, wall time and peak memory."""
    metrics = {k: _scalar(v) for k, v in trainer.callback_metrics.items()}
    model = module.model
    summary = {
        "status": status,
        "metrics": {k: v for k, v in sorted(metrics.items()) if not k.startswith(("lr/", "perf/")) and k != "step"},
        **throughput(module),
        "parameters": model.num_parameters() if hasattr(model, "num_parameters") else None,
        "parameters_without_residual": (
            model.num_parameters(exclude_residual=True) if hasattr(model, "num_parameters") else None
        ),
        "non_embedding_parameters": (
            model.num_parameters(exclude_embedding=True) if hasattr(model, "num_parameters") else None
        ),
        "tokens_seen": module.tokens_seen,
        "steps": trainer.global_step,
        "validation_step": getattr(module, "last_validation_step", None),  # the step `metrics`' val/* are from
        "skipped_steps": getattr(module, "skipped_steps", 0),
        "rollbacks": getattr(module, "rollbacks", 0),
        "wall_time_s": round(wall_time_s, 3),
        "peak_memory_bytes": peak_memory_bytes(module.device),
        **extra,
    }
    write_json(run_dir / "metrics.json", summary)
    return summary


def mark_running(run_dir: Path, ckpt: str | None) -> bool:
    """A run that starts again over the record of an earlier end (`resume=true`, `ckpt_path=` on its
    own folder) marks metrics.json "running" until it ends: its old numbers describe a checkpoint
    that training is about to replace, and a run killed from here on must not read as "finished"
    (to `attnres-export`, sweep summaries, verdicts, `resume=true`'s "already finished"). The
    previous status and step stay, named as such. Returns whether there was a record to mark."""
    path = run_dir / "metrics.json"
    if not path.exists():
        return False
    previous = read_json(path)
    write_json(path, {"status": "running", "resumed_from": ckpt, "previous_status": previous.get("status"),
                      "previous_steps": previous.get("steps")})
    return True


def throughput(module: Any) -> dict[str, Any]:
    """metrics.json's throughput over this process's training steps (validation, checkpoints left out):
    `tokens_per_sec` and `mfu` over every step, warm-up included (the kernel's first build, compilation);
    `tokens_per_sec_after_warmup` and `mfu_after_warmup` leave out the first THROUGHPUT_WARMUP steps
    and are None unless THROUGHPUT_MIN_STEPS follow them (`throughput_steps` counts those measured)."""
    start = getattr(module, "session_start_step", None)
    measured = max(0, module.trainer.global_step - start - THROUGHPUT_WARMUP) if start is not None else 0
    steady = measured >= THROUGHPUT_MIN_STEPS and module.steady_train_s > 0
    return {"tokens_per_sec": module.session_tokens / module.session_train_s if module.session_train_s else None,
            "mfu": module.session_mfu(warm=False), "throughput_warmup_steps": THROUGHPUT_WARMUP,
            "throughput_steps": measured, "tokens_per_sec_after_warmup":
            module.steady_tokens / module.steady_train_s if steady else None,
            "mfu_after_warmup": module.session_mfu(warm=True) if steady else None}  # MFU: GPU only


def _human(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{seconds:.1f} s"


def end_block(summary: dict[str, Any], run_dir: Path, events_dir: Path | None, figures: bool = True) -> str:
    """What a run tells the user when it ends: the numbers of metrics.json and where things are, as
    absolute paths (its commands are pasted in other folders too); `figures`: the run logged the
    depth dashboard's data, which `attnres-plot` draws."""
    metrics = summary.get("metrics", {})
    shown = [f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("val/") and isinstance(v, float)]
    where = shlex.quote(str(Path(run_dir).resolve()))
    peak = summary.get("peak_memory_bytes")
    speed, steady = summary.get("tokens_per_sec"), summary.get("tokens_per_sec_after_warmup")
    validated = summary.get("validation_step")
    if shown and validated is not None and validated != summary.get("steps"):
        shown[-1] += f" (its last validation, at step {validated})"
    limit = summary.get("stopped_by")
    ended = f" (trainer.max_time={summary.get('max_time')} ended it at step {summary['steps']})" \
        if limit == "trainer.max_time" else ""
    lines = [
        f"{summary['status']} in {_duration(summary['wall_time_s'])}{ended}: " + (", ".join(shown) or "no validation"),
        f"  steps {summary['steps']}, tokens seen {_human(summary['tokens_seen'])}"
        + (f", {speed:,.0f} tokens/s" if speed else "") + (f" ({steady:,.0f} after warm-up)" if steady else "")
        + (f", peak memory {peak / 2**20:,.0f} MiB" if peak else ""),
        f"  run folder   {where}",
    ]
    ckpts = [p.name for p in (run_dir / "checkpoints").glob("*.ckpt")] if (run_dir / "checkpoints").is_dir() else []
    if ckpts:
        lines.append(f"  checkpoints  {shlex.quote(str(Path(run_dir).resolve() / 'checkpoints') + '/')} "
                     f"({', '.join(sorted(ckpts))})")
    lines.append(f"  metrics      {shlex.quote(str(Path(run_dir).resolve() / 'metrics.json'))}")
    if events_dir is not None:
        lines.append(f"  TensorBoard  tensorboard --logdir {where}")
        if figures:
            lines.append(f"  figures      attnres-plot {where}")
    return "\n".join(lines)


def logs_figures(trainer: pl.Trainer) -> bool:
    """Whether the run logs the depth dashboard's data (`~callbacks.depth_dashboard` turns it off)."""
    from attnres.training.dashboard import DepthDashboard

    return any(isinstance(c, DepthDashboard) for c in trainer.callbacks)


def events_dir(trainer: pl.Trainer) -> Path | None:
    """The folder of the run's TensorBoard events, if it logs to TensorBoard."""
    from pytorch_lightning.loggers import TensorBoardLogger

    board = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
    return Path(board.log_dir) if board is not None and board.log_dir else None


def config_summary(cfg: DictConfig, info: dict[str, Any]) -> str:
    """One line that says what this run trains, for the terminal and the run's log."""
    residual = str(info.get("residual") or "?")
    sizes, blocks = cfg.residual.get("block_sizes"), cfg.residual.get("num_blocks")
    if sizes is not None:
        residual += f" (blocks {list(sizes)})"
    elif blocks is not None:
        residual += f" (N={blocks})"
    model = cfg.model
    mup = ""
    if model.get("parametrization") == "mup":  # its base, the proxy the hyperparameters came from
        mup = (f", muP from {model.get('base_width') or model.get('n_embd')} wide x "
               f"{model.get('base_depth') or model.get('n_layer')} layers, depth_alpha {model.get('depth_alpha')}")
    return (f"{residual}, model {info.get('model')} ({model.get('n_layer')} layers, {model.get('n_embd')} wide, "
            f"{model.get('n_head')} heads{mup}), data {info.get('data')} (batch {cfg.data.get('batch_size')} x "
            f"{cfg.data.get('block_size')}), {cfg.trainer.get('max_steps')} steps, "
            f"{describe_optimizer(cfg.optim.optimizer)}, seed {cfg.seed}, {threads_note()}")


def threads_note() -> str:
    """`2 threads` (torch's CPU threads in this process; `threads=` sets them)."""
    count = torch.get_num_threads()
    return f"{count} thread{'s' if count != 1 else ''}"


def end_interrupted(err: BaseException, stop: Any, trainer: pl.Trainer, module: Any, run_dir: Path,
                    info: dict[str, Any], elapsed_s: float) -> RunEnded:
    """A run stopped by SIGINT/SIGTERM (`Interrupted`, or Lightning's SIGTERMException when the
    signal beat our handler): the checkpoint is saved, metrics.json says "interrupted", and the
    RunEnded to raise says how to continue (exit 130 / 143)."""
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    last = stop.checkpoint
    sig = err.signal if isinstance(err, Interrupted) else signal.SIGTERM
    stop.received = stop.received or sig
    if isinstance(err, SIGTERMException) and not trainer.fast_dev_run:
        trainer.save_checkpoint(last, weights_only=False)
    if trainer.is_global_zero:
        summary = write_summary(run_dir, trainer, module, elapsed_s, {**info, "interrupted_by": sig.name},
                                status="interrupted")
        report(end_block(summary, run_dir, events_dir(trainer), logs_figures(trainer)))  # where it is; how to go on
    return RunEnded(f"interrupted by {sig.name} at step {trainer.global_step}; saved {last}; "
                    "continue with the same command and resume=true", stop.exit_code)


def end_nonfinite(err: BaseException, trainer: pl.Trainer, module: Any, run_dir: Path, last: Path,
                  info: dict[str, Any], elapsed_s: float) -> RunEnded:
    """A run stopped by a non-finite loss: metrics.json says "failed", naming the step and the
    last good checkpoint; the RunEnded to raise (exit 1) says the same."""
    where = describe_checkpoint(last)
    if trainer.is_global_zero:
        write_summary(run_dir, trainer, module, elapsed_s, {**info, "error": str(err), "last_checkpoint": where},
                      status="failed")
    kept = f"the last good checkpoint is {where}" if last.is_file() else \
        "there is no good checkpoint yet (it stopped before the first one)"
    return RunEnded(f"error: {err}; {kept}; see nonfinite.policy (stop, skip, rollback) in docs/runs.md", 1)


def write_error(err: OSError, run_dir: Path | None = None) -> str:
    """One line for a write the disk or the folder refused: which file, what is kept, what to do."""
    where = f" writing {err.filename}" if err.filename else ""
    kept = f"; kept: {describe_checkpoint(run_dir / 'checkpoints' / 'last.ckpt')}" if run_dir is not None else ""
    if err.errno in DISK_FULL:
        return f"disk full{where}{kept}; free some space, then rerun with resume=true"
    folder = Path(err.filename).parent if err.filename else run_dir
    return (f"cannot write{where.replace(' writing', '')} ({err.strerror}){kept}; make {folder} writable again, "
            "then rerun with resume=true")


@contextlib.contextmanager
def run_outcome(run_dir: Path | None = None) -> Iterator[None]:
    """How a single run ends for the user: one line on stderr and its exit status for a run that
    stopped on purpose (`RunEnded`: a signal, a non-finite loss) or on a write the disk refused
    (full, read-only, no permission: `write_error`); any error
    goes to `attnres.log` with its traceback, the terminal shows what `user_errors` shows."""
    try:
        yield
    except RunEnded as err:
        file_log().error(str(err))  # the terminal gets it once, on stderr
        print(f"attnres-run: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except OSError as err:
        log_traceback(err)
        if err.errno not in WRITE_ERRORS or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"attnres-run: error: {write_error(err, run_dir)}", file=sys.stderr)
        sys.exit(2)
    except BaseException as err:
        log_traceback(err)
        if run_dir is not None and isinstance(err, (ConfigError, InstantiationException, MissingMandatoryValue)):
            undo_refused(run_dir)  # a refused command leaves the folder as it was (or no folder)
        raise


def _to_log_file(logger: logging.Logger) -> logging.Logger:
    """Give `logger` the run's log file handlers (Hydra puts them on the root logger)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler not in logger.handlers:
            logger.addHandler(handler)
    return logger


def file_log() -> logging.Logger:
    """A logger that writes to the run's log file only (Hydra's file handler), not the terminal."""
    logger = logging.getLogger("attnres.file")
    logger.propagate = False
    return _to_log_file(logger)


def log_traceback(err: BaseException) -> None:
    """The error and its traceback into the run's log file (not the terminal)."""
    if isinstance(err, (SystemExit, KeyboardInterrupt)) and not isinstance(err, RunEnded):
        return
    file_log().error(f"the run failed: {type(err).__name__}: {err}", exc_info=err)


def report(text: str) -> None:
    """Print `text` as it is (no log prefix) and keep it in the run's log file."""
    print(text, flush=True)
    file_log().info(text)


def share_log_file() -> None:
    """Lightning's own messages go to the run's log file too (Lightning does not propagate them
    to the root logger, where Hydra puts the file handler); a log file that cannot be written
    (a full disk) says so once, in one line, instead of a traceback per message."""
    _to_log_file(logging.getLogger("pytorch_lightning"))
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handleError = _log_error_once(handler)  # type: ignore[method-assign]


def _log_error_once(handler: logging.FileHandler) -> Any:
    said = []

    def handle_error(record: logging.LogRecord) -> None:
        if not said:
            said.append(True)
            err = sys.exc_info()[1]
            why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            print(f"attnres-run: warning: cannot write the log file {handler.baseFilename} ({why}); its lines are "
                  "lost until it can", file=sys.stderr, flush=True)
    return handle_error


