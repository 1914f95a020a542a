"""The bridge to EleutherAI's lm-evaluation-harness (`pip install 'attnres[eval]'`, lm-eval 0.4.x).

The model goes to lm-eval in memory: `HFLM(pretrained=<AttnResForCausalLM>, tokenizer=<its
PreTrainedTokenizerFast>)`, with its context length (`max_position_embeddings`, the run's
block_size) and, for a byte-level model, "\\n" as the token a rolling text starts after.

Offline by default (`offline=True`): HF_HUB_OFFLINE and HF_DATASETS_OFFLINE are set unless the
environment already sets them (the user's word wins), so nothing reaches the network: not the
Hub's model info lm-eval asks for at the end, not `evaluate.load`, not a dataset. Every task is
built before any model work, so a task whose data is not in the local cache is one line naming it
and how to fetch it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from attnres.config.errors import ConfigError
from attnres.tasks import local, paper

EXTRA = "pip install 'attnres[eval]'"
OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
#: lm-eval's tasks that run the code a model writes: refused unless the user allows it
CODE_TASKS = ("humaneval", "mbpp")


def go_offline(offline: bool) -> None:
    """Set HF_HUB_OFFLINE and HF_DATASETS_OFFLINE (unless set already), also in the libraries that
    read them when imported, if they already are."""
    if not offline:
        return
    for name in OFFLINE:
        os.environ.setdefault(name, "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    hub_off = os.environ["HF_HUB_OFFLINE"].upper() in ("1", "ON", "YES", "TRUE")
    if "huggingface_hub.constants" in sys.modules:
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = hub_off
    if "datasets.config" in sys.modules:
        sys.modules["datasets.config"].HF_HUB_OFFLINE = hub_off


def lm_eval_version() -> str:
    """lm-eval's version; a ConfigError naming the extra when it is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        import lm_eval  # noqa: F401
        return version("lm_eval")
    except (ImportError, PackageNotFoundError) as err:
        raise ConfigError(f"lm-eval is not installed; {EXTRA} (the eval extra) to run tasks") from err


@contextlib.contextmanager
def quiet() -> Any:
    """lm-eval's own INFO and WARNING lines (it logs every task it builds) kept out of the run's output."""
    loggers = [logging.getLogger(n) for n in ("lm_eval", "lm-eval", "datasets", "evaluate")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def task_manager(include: list[Path]) -> Any:
    from lm_eval.tasks import TaskManager

    with quiet():
        return TaskManager(include_path=[str(p) for p in include] or None)


def dataset_of(manager: Any, task: str) -> str:
    """Where `task`'s data comes from, as its YAML says (a Hub dataset, maybe with a config name)."""
    entry = manager.task_index.get(task) if hasattr(manager, "task_index") else None  # lm-eval 0.4.10+
    try:
        cfg = (entry.cfg or {}) if entry is not None else manager._get_config(task)  # noqa: SLF001 (older)
    except Exception:  # noqa: BLE001 (no config of its own)
        cfg = {}
    path, name = cfg.get("dataset_path"), cfg.get("dataset_name")
    return f"dataset {path}{' ' + str(name) if name else ''}" if path else "a group: the datasets of its tasks"


def check_tasks(tasks: list[str], manager: Any, unsafe_code: bool = False) -> None:
    """Every task known and its data local, before any model work; else one ConfigError that names
    the tasks and how to fetch their data."""
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise ConfigError(f"unknown task(s) {', '.join(unknown)}: attnres's own are {', '.join(local.OWN_TASKS)} "
                          f"and {paper.GROUP}; lm-eval's are listed by `lm_eval ls tasks`")
    code = [t for t in tasks if t in CODE_TASKS]
    if code and not unsafe_code:
        raise ConfigError(f"{', '.join(code)} run(s) the code the model writes; allow it with "
                          "eval.unsafe_code=true (attnres-tasks --unsafe-code), or leave the task out")
    from lm_eval.tasks import get_task_dict

    load = getattr(manager, "load", None) or (lambda names: get_task_dict(names, manager))  # 0.4.10+ / before
    missing = []
    for task in tasks:
        try:
            with quiet(), contextlib.redirect_stderr(io.StringIO()):
                load([task])
        except Exception as err:  # noqa: BLE001 (datasets says "not cached" in several exception types)
            missing.append((task, err))
    if missing:
        offline = os.environ.get("HF_DATASETS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
        named = "; ".join(f"{t} ({dataset_of(manager, t)})" for t, _ in missing)
        first = str(missing[0][1]).strip().splitlines()[0][:160] if str(missing[0][1]).strip() else \
            type(missing[0][1]).__name__
        how = ("fetch it once, online, into the cache: HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0 lm_eval --model dummy "
               f"--tasks {','.join(t for t, _ in missing)} --limit 1 (or let this command fetch it: "
               "eval.offline=false, attnres-tasks --online)"
               if offline else f"lm-eval said: {first}")
        raise ConfigError(f"the data of {len(missing)} task(s) is not in the local cache: {named}; {how}")


def metrics_of(results: dict[str, Any], tasks: list[str]) -> dict[str, float]:
    """{"<task>/<metric>": value} of the tasks asked for (a group: its aggregate), stderr left out."""
    out: dict[str, float] = {}
    for task in tasks:
        for key, value in (results.get(task) or {}).items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            out[f"{task}/{metric}" + ("" if filt == "none" else f"_{filt}")] = float(value)
    return out


def evaluate(model: Any, tokenizer: Any, tasks: list[str], manager: Any, *, batch_size: int = 16,
             limit: int | None = None, num_fewshot: int | None = None, prefix_token_id: int | None = None,
             unsafe_code: bool = False) -> dict[str, Any]:
    """lm-eval on `model` (a Hugging Face causal LM, in memory) over `tasks`, already checked;
    returns {"metrics": {task/metric: value}, "seconds", "lm_eval_version", "samples": {task: n}}."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    model.eval()
    with quiet():
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, prefix_token_id=prefix_token_id,
                  max_length=int(model.config.max_position_embeddings))
    start = time.perf_counter()
    with quiet():
        out = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                              log_samples=False, bootstrap_iters=0, confirm_run_unsafe_code=unsafe_code,
                              verbosity="ERROR")
    seconds = time.perf_counter() - start
    results = {**(out or {}).get("groups", {}), **(out or {}).get("results", {})}
    samples = {t: n.get("effective") for t, n in ((out or {}).get("n-samples") or {}).items() if t in tasks}
    return {"metrics": metrics_of(results, tasks), "seconds": round(seconds, 3), "lm_eval_version": lm_eval_version(),
            "samples": samples}
