"""The pieces of a run that `cli.py` strings together: choices, checkpoints, precision,
progress and the run summary. Kept here so that `cli.py` reads as compose -> instantiate -> fit."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue
from pytorch_lightning.callbacks import ProgressBar

from attnres.training import naming  # noqa: F401  (registers the run-folder resolver)
from attnres.training.errors import ConfigError
from attnres.training.faults import Interrupted, RunEnded, RunRefused, at_last_step, clear_previous_run
from attnres.training.io import DISK_FULL, read_json, write_json
from attnres.training.lit import peak_memory_bytes

log = logging.getLogger("attnres")


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn errors that are the user's to fix into one line on stderr and exit status 2.

    `HYDRA_FULL_ERROR=1` re-raises them with the full traceback instead.
    """
    try:
        yield
    except MissingMandatoryValue as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        key = err.full_key or "a required key"
        print(f"attnres-run: error: {key} has no value; set {key}=<value> on the command line", file=sys.stderr)
        sys.exit(2)
    except (ConfigError, InstantiationException) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        cause = err
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(err, InstantiationException) and not isinstance(cause, (ValueError, TypeError, OSError)):
            raise
        hint = "  (HYDRA_FULL_ERROR=1 shows the full trace)" if cause is not err else ""
        print(f"attnres-run: error: {cause}{hint}", file=sys.stderr)
        sys.exit(2)


def resolve_precision(precision: Any, accelerator: str) -> Any:
    """`precision: auto` -> bf16-mixed on a GPU that supports it, else 32-true."""
    if precision != "auto":
        return precision
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return "bf16-mixed" if on_gpu and torch.cuda.is_bf16_supported() else "32-true"


def resume_checkpoint(run_dir: Path, resume: bool, ckpt_path: str | None, overwrite: bool) -> str | None:
    """The checkpoint to continue from, or None for a fresh run; refuses to clobber a run.

    Call it holding the run's `RunLock`. A folder "holds a run" when it has `last.ckpt` or a
    `metrics.json`. `overwrite=true` removes the previous run's checkpoints, events and
    metrics first (`faults.clear_previous_run`), so nothing of it can be resumed later.
    `resume=true` on a run that never reached its first checkpoint starts it from scratch
    and says so: a requeue loop that always passes `resume=true` can restart it.
    """
    last = run_dir / "checkpoints" / "last.ckpt"
    status = read_json(run_dir / "metrics.json").get("status")
    if resume and overwrite:
        raise ConfigError("resume=true and overwrite=true contradict each other; pass only one of them")
    if ckpt_path:
        if not Path(ckpt_path).is_file():
            raise ConfigError(f"ckpt_path={ckpt_path} is not a file; pass the path of a .ckpt written by attnres-run")
        if overwrite:
            clear_previous_run(run_dir)
        return str(ckpt_path)
    if resume:
        if last.is_file():
            return str(last)
        if status == "finished":
            raise ConfigError(
                f"resume=true but the finished run in {run_dir} has no checkpoints/last.ckpt to continue from; "
                "pass overwrite=true to train it again, or name=<new name> for a new folder"
            )
        log.warning(f"resume=true: {run_dir} has no checkpoint yet (stopped before its first one); "
                    "starting this run from scratch")
        return None
    if overwrite:
        clear_previous_run(run_dir)
        return None
    if last.is_file() or status is not None:
        held = last if last.is_file() else run_dir / "metrics.json"
        raise RunRefused(
            f"{run_dir} already holds a run ({held}); pass resume=true to continue it, "
            "overwrite=true to start it again, or name=<new name> for a new folder"
        )
    return None


def check_checkpoint(path: str, module: pl.LightningModule) -> None:
    """Fail early, in one line, on a checkpoint that is unreadable or for another model."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # any failure to unpickle means the same thing to the user
        raise ConfigError(f"checkpoint {path} is corrupt or not a checkpoint ({type(err).__name__}: {err})") from err
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if state is None:
        raise ConfigError(f"checkpoint {path} has no 'state_dict'; it was not written by attnres-run")
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        which = f"lacks {missing[0]}" if missing else f"has {unexpected[0]}, which this model lacks"
        raise ConfigError(
            f"checkpoint {path} does not match this model: it {which} "
            f"({len(missing)} missing, {len(unexpected)} unexpected keys); "
            "resume with the config it was trained with (.hydra/config.yaml in its run folder)"
        )
    for key, value in expected.items():
        if state[key].shape != value.shape:
            raise ConfigError(
                f"checkpoint {path} does not match this model: {key} is {tuple(state[key].shape)} there "
                f"but {tuple(value.shape)} here; resume with the config it was trained with"
            )


class StepProgressBar(ProgressBar):
    """One line over optimiser steps (of `max_steps`) with the latest numbers; a validation
    only updates those numbers instead of drawing bars of its own.

    Where stdout is not a terminal (a sweep's train.log, a batch job's log) there is no bar:
    a plain log line every `plain_every` steps and after each validation, so files hold no
    carriage returns or escape codes.
    """

    def __init__(self, refresh_rate: int = 10, plain_every: int = 100) -> None:
        super().__init__()
        self.refresh_rate, self.plain_every = max(1, int(refresh_rate)), max(1, int(plain_every))
        self._enabled, self.bar = True, None

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _numbers(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, str]:
        metrics = self.get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return {k: (f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in metrics.items()}

    def _line(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        numbers = "  ".join(f"{k} {v}" for k, v in self._numbers(trainer, pl_module).items())
        return f"step {trainer.global_step}/{trainer.max_steps}  {numbers}"

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._enabled and trainer.is_global_zero and sys.stdout.isatty():
            from tqdm.auto import tqdm

            total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
            self.bar = tqdm(total=total, initial=trainer.global_step, desc="steps", dynamic_ncols=True,
                            file=sys.stdout, leave=True, smoothing=0.1, unit="step")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._enabled or not trainer.is_global_zero:
            return
        step, last = trainer.global_step, at_last_step(trainer)
        if self.bar is not None and (step % self.refresh_rate == 0 or last):
            self.bar.n = step
            self.bar.set_postfix(self._numbers(trainer, pl_module), refresh=False)
            self.bar.refresh()
        elif self.bar is None and (step % self.plain_every == 0 or last):
            log.info(self._line(trainer, pl_module))

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.bar is not None and not trainer.sanity_checking:
            self.bar.set_description("validating")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._enabled or not trainer.is_global_zero or trainer.sanity_checking:
            return
        if self.bar is not None:
            self.bar.set_description("steps")
            self.bar.set_postfix(self._numbers(trainer, pl_module))
        elif trainer.state.fn == "fit":
            log.info(f"validation at {self._line(trainer, pl_module)}")

    def on_train_end(self, *args: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.on_train_end()


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
        "metrics": {k: v for k, v in sorted(metrics.items()) if not k.startswith(("lr/", "perf/"))},
        "tokens_per_sec": module.session_tokens / module.session_train_s if module.session_train_s else None,
        "mfu": module.session_mfu() if hasattr(module, "session_mfu") else None,  # GPU only
        "parameters": model.num_parameters() if hasattr(model, "num_parameters") else None,
        "parameters_without_residual": (
            model.num_parameters(exclude_residual=True) if hasattr(model, "num_parameters") else None
        ),
        "non_embedding_parameters": (
            model.num_parameters(exclude_embedding=True) if hasattr(model, "num_parameters") else None
        ),
        "tokens_seen": module.tokens_seen,
        "steps": trainer.global_step,
        "skipped_steps": getattr(module, "skipped_steps", 0),
        "rollbacks": getattr(module, "rollbacks", 0),
        "wall_time_s": round(wall_time_s, 3),
        "peak_memory_bytes": peak_memory_bytes(module.device),
        **extra,
    }
    write_json(run_dir / "metrics.json", summary)
    return summary


def _human(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{seconds:.1f} s"


def end_block(summary: dict[str, Any], run_dir: Path, events_dir: Path | None) -> str:
    """What a run tells the user when it ends: the numbers of metrics.json and where things are."""
    metrics = summary.get("metrics", {})
    shown = [f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("val/") and isinstance(v, float)]
    where = os.path.relpath(run_dir) if not os.path.relpath(run_dir).startswith("..") else str(run_dir)
    peak = summary.get("peak_memory_bytes")
    speed = summary.get("tokens_per_sec")
    lines = [
        f"{summary['status']} in {_duration(summary['wall_time_s'])}: " + (", ".join(shown) or "no validation"),
        f"  steps {summary['steps']}, tokens seen {_human(summary['tokens_seen'])}"
        + (f", {_human(speed)} tokens/s" if speed else "")
        + (f", peak memory {peak / 2**20:,.0f} MiB" if peak else ""),
        f"  run folder   {where}",
    ]
    ckpts = [p.name for p in (run_dir / "checkpoints").glob("*.ckpt")] if (run_dir / "checkpoints").is_dir() else []
    if ckpts:
        lines.append(f"  checkpoints  {where}/checkpoints/ ({', '.join(sorted(ckpts))})")
    lines.append(f"  metrics      {where}/metrics.json")
    if events_dir is not None:
        lines.append(f"  TensorBoard  tensorboard --logdir {where}")
        lines.append(f"  figures      python experiments/plot_run.py {where}")
    return "\n".join(lines)


def config_summary(cfg: DictConfig, info: dict[str, Any]) -> str:
    """One line that says what this run trains, for the terminal and the run's log."""
    residual = str(info.get("residual") or "?")
    sizes, blocks = cfg.residual.get("block_sizes"), cfg.residual.get("num_blocks")
    if sizes is not None:
        residual += f" (blocks {list(sizes)})"
    elif blocks is not None:
        residual += f" (N={blocks})"
    model = cfg.model
    return (f"{residual}, model {info.get('model')} ({model.get('n_layer')} layers, {model.get('n_embd')} wide, "
            f"{model.get('n_head')} heads), data {info.get('data')} (batch {cfg.data.get('batch_size')} x "
            f"{cfg.data.get('block_size')}), {cfg.trainer.get('max_steps')} steps, "
            f"lr {cfg.optim.optimizer.get('lr')}, seed {cfg.seed}")


def describe_checkpoint(path: Path) -> str:
    """`path (step N)` for the checkpoint a user can go back to, or a note that there is none."""
    if not path.is_file():
        return "no checkpoint yet"
    try:
        step = torch.load(path, map_location="cpu", weights_only=False, mmap=True).get("global_step")
    except Exception:  # unreadable: say where it is all the same
        step = None
    return f"{path} (step {step})" if step is not None else str(path)


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
        write_summary(run_dir, trainer, module, elapsed_s, {**info, "interrupted_by": sig.name}, status="interrupted")
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
    return RunEnded(f"error: {err}; the last good checkpoint is {where}; "
                    "see nonfinite.policy (stop, skip, rollback) in README", 1)


@contextlib.contextmanager
def run_outcome(run_dir: Path | None = None) -> Iterator[None]:
    """How a single run ends for the user: one line on stderr and its exit status for a run that
    stopped on purpose (`RunEnded`: a signal, a non-finite loss) or on a full disk; any error
    goes to `attnres.log` with its traceback, the terminal shows what `user_errors` shows."""
    try:
        yield
    except RunEnded as err:
        log.error(str(err))
        print(f"attnres-run: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except OSError as err:
        log_traceback(err)
        if err.errno not in DISK_FULL or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        where = f" writing {err.filename}" if err.filename else ""
        kept = ""
        if run_dir is not None:
            kept = f"; kept: {describe_checkpoint(run_dir / 'checkpoints' / 'last.ckpt')}"
        print(f"attnres-run: error: disk full{where}{kept}; free some space, then rerun with resume=true",
              file=sys.stderr)
        sys.exit(2)
    except BaseException as err:
        log_traceback(err)
        if run_dir is not None and isinstance(err, (ConfigError, InstantiationException, MissingMandatoryValue)):
            remove_if_untouched(run_dir)  # a refused command leaves no folder behind
        raise


#: what a run folder holds before the run has produced anything (Hydra writes the first two)
UNTOUCHED = {".hydra", "attnres.log", ".run.lock"}


def remove_if_untouched(run_dir: Path) -> bool:
    """Remove a run folder that holds nothing but Hydra's files (a run refused before it started),
    and the parent folders that become empty, up to the current folder. Never a folder that holds
    anything else, or one another process is running in."""
    from attnres.training.faults import RunLock

    if not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} - UNTOUCHED:
        return False
    try:
        with RunLock(run_dir):
            shutil.rmtree(run_dir)
    except (ConfigError, OSError):
        return False
    cwd, parent = Path.cwd().resolve(), run_dir.resolve().parent
    while parent != cwd and cwd in parent.parents:
        try:
            parent.rmdir()  # only when empty
        except OSError:
            break
        parent = parent.parent
    return True


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
    to the root logger, where Hydra puts the file handler)."""
    _to_log_file(logging.getLogger("pytorch_lightning"))


def run_child_job(spec_path: Path, train: Callable[[DictConfig, Path, dict[str, Any]], dict]) -> int:
    """Body of a sweep job's own process: run `train` on the spec the launcher's worker wrote,
    and record any failure in metrics.json (status "failed" and the error) instead of raising."""
    import logging
    import traceback

    spec = json.loads(spec_path.read_text())
    run_dir, info = Path(spec["run_dir"]), spec["info"]
    threads = info.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    start = time.perf_counter()
    try:
        train(OmegaConf.create(spec["config"]), run_dir, info)
        return 0
    except RunEnded as err:  # interrupted, or stopped on a non-finite loss: metrics.json says so already
        print(f"attnres-run: {err}", file=sys.stderr)
        return err.exit_code
    except RunRefused as err:  # the folder is another run's: its metrics.json is not this job's to write
        print(f"attnres-run: error: {err}", file=sys.stderr)
        return 2
    except BaseException as err:  # a job's failure is data for the summary, not a crash of the sweep
        traceback.print_exc()
        message = str(err).splitlines()[0] if str(err) else ""
        cause = err
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__
            message = str(cause).splitlines()[0] if str(cause) else message
        write_json(run_dir / "metrics.json", {
            "status": "failed", "error": f"{type(cause).__name__}: {message}"[:500], "slot": info.get("slot"),
            "wall_time_s": round(time.perf_counter() - start, 3), "overrides": info.get("overrides"),
        })
        return 1
