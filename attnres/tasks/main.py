"""`attnres-tasks RUN_DIR --tasks ...`, and `eval.tasks=[...]` at the end of a run (or of each job of a sweep).

    attnres-tasks outputs/default/<run> --tasks attnres_next_line,attnres_bpb
    attnres-tasks hf-model --tasks hellaswag --limit 200        (a folder written by attnres-export)
    attnres-run data=synthetic eval.tasks=[attnres_pointer]

The run's checkpoint becomes an `attnres.hf` model in memory (no folder is written) and goes to
lm-eval (`lmeval.py`). attnres's own tasks are generated from the run's data module (`local.py`).
The results go into the run's metrics.json (`metrics` gets `<task>/<metric>`, `tasks` the details),
its TensorBoard events and, at the end of a run, its trackers. Everything that can be refused is
refused before any model work, in one line with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnres.atomic import read_json, write_json
from attnres.config.errors import ConfigError
from attnres.config.rules import RULES
from attnres.tasks import lmeval, local, paper

PROG = "attnres-tasks"
DEFAULTS = {"tasks": [], "limit": None, "num_fewshot": None, "batch_size": 16, "offline": True, "num_docs": 500,
            "unsafe_code": False, "include_path": []}
#: the tokenizers' model_max_length: lm-eval is told the model's context (max_length) itself and cuts
#: what it feeds to it; the tokenizer only encodes (context + continuation may be one longer)
LONG = 1 << 30


def settings(cfg: DictConfig | dict | None) -> dict[str, Any]:
    """conf/config.yaml's `eval` block (what a config lacks: DEFAULTS)."""
    given = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg or {})
    out = {**DEFAULTS, **{k: v for k, v in given.items() if v is not None or k in ("limit", "num_fewshot")}}
    if isinstance(out["tasks"], str):
        out["tasks"] = [t for t in out["tasks"].split(",") if t]
    if not isinstance(out["tasks"], list) or not all(isinstance(t, str) for t in out["tasks"]):
        raise ConfigError(f"eval.tasks={out['tasks']!r} must be a list of task names, e.g. eval.tasks=[attnres_bpb]")
    out["tasks"] = paper.expand(out["tasks"])
    if isinstance(out["include_path"], str):
        out["include_path"] = [out["include_path"]]
    for folder in out["include_path"]:
        if not Path(str(folder)).expanduser().is_dir():
            raise ConfigError(f"eval.include_path: {folder} is not a folder; pass folders of lm-eval task YAMLs")
    return out


class Prepared:
    """What an evaluation needs, checked: the tasks, their lm-eval TaskManager, the eval settings."""

    def __init__(self, opts: dict[str, Any], datamodule: Any) -> None:
        self.opts, self.tasks = opts, opts["tasks"]
        lmeval.go_offline(bool(opts["offline"]))
        self.version = lmeval.lm_eval_version()
        own = [t for t in self.tasks if t in local.OWN_TASKS]
        if own and datamodule is None and not opts["include_path"]:
            raise ConfigError(f"{', '.join(own)} need(s) the run's data: pass the run folder, not an exported one "
                              "(or --include-path the task's folder under $ATTNRES_CACHE/tasks/)")
        folders = local.prepare_own(own, datamodule, int(opts["num_docs"])) if own and datamodule is not None else {}
        self.folders = {task: str(folder) for task, folder in folders.items()}  # lm_eval --include_path each
        given = [Path(str(p)).expanduser().absolute() for p in opts["include_path"]]
        self.manager = lmeval.task_manager([*folders.values(), *given])
        lmeval.check_tasks(self.tasks, self.manager, bool(opts["unsafe_code"]))


def prepare(cfg: DictConfig, datamodule: Any) -> Prepared | None:
    """Before a run trains: its `eval.tasks` checked (lm-eval installed, data local), or None without tasks."""
    opts = settings(cfg.get("eval"))
    return Prepared(opts, datamodule) if opts["tasks"] else None


def hf_model_of_run(cfg: DictConfig, ckpt: Path, datamodule: Any) -> tuple[Any, Any, int | None]:
    """(AttnResForCausalLM with the checkpoint's weights, its PreTrainedTokenizerFast, prefix token id)."""
    from attnres.export.main import prepare_export
    from attnres.hf.tokenization import BYTE_PREFIX, hf_tokenizer, is_byte_level

    model, tok, _ = prepare_export(cfg, ckpt, None)
    if tok is None and hasattr(datamodule, "num_symbols"):
        fast, _ = hf_tokenizer(local.symbol_tokenizer(datamodule.num_symbols), LONG, pad_token="<pad>",
                               eos_token="<pad>")
        return model, fast, None
    if tok is None:
        raise ConfigError(f"the run's data ({cfg.data.get('_target_')}) has no text tokenizer for lm-eval")
    return model, hf_tokenizer(tok, LONG)[0], BYTE_PREFIX if is_byte_level(tok) else None


def hf_model_of_folder(folder: Path) -> tuple[Any, Any, int | None]:
    """(the exported model, its tokenizer, prefix token id) of a folder attnres-export wrote."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import attnres.hf  # noqa: F401  (registers attnres with the Auto classes)
    from attnres.hf.tokenization import BYTE_PREFIX

    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(f"{folder} has no tokenizer.json (a synthetic run's export): evaluate its run folder")
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    return model, tok, BYTE_PREFIX if len(tok) == 256 else None


def run_data(cfg: DictConfig) -> Any:
    from hydra.utils import instantiate

    return instantiate(cfg.data)


def evaluate(prepared: Prepared, model: Any, tokenizer: Any, prefix: int | None) -> dict[str, Any]:
    o = prepared.opts
    result = lmeval.evaluate(model, tokenizer, prepared.tasks, prepared.manager, batch_size=int(o["batch_size"]),
                             limit=o["limit"], num_fewshot=o["num_fewshot"], prefix_token_id=prefix,
                             unsafe_code=bool(o["unsafe_code"]))
    return {**result, "task_folders": prepared.folders} if prepared.folders else result


def record(run_dir: Path, result: dict[str, Any], step: int | None = None, loggers: Any = ()) -> dict[str, Any]:
    """The results into metrics.json (when the folder has one), the loggers given, else TensorBoard
    events of their own in `run_dir/tasks/`; returns the updated metrics.json."""
    path = run_dir / "metrics.json"
    summary = read_json(path) if path.is_file() else {}
    if summary:
        summary.setdefault("metrics", {}).update(result["metrics"])
        summary["tasks"] = result
        write_json(path, summary)
    if loggers:
        for logger in loggers:
            logger.log_metrics(result["metrics"], step=step)
    else:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(run_dir / "tasks")) as writer:
            for key, value in result["metrics"].items():
                writer.add_scalar(key, value, step or 0)
    return summary


def lines(result: dict[str, Any]) -> list[str]:
    """What a person reads: one line per task metric (the paper's figures beside Table 3's tasks)."""
    out = [f"tasks: lm-eval {result['lm_eval_version']}, {result['seconds']:.1f} s"]
    for key, value in result["metrics"].items():
        task = key.split("/", 1)[0]
        shown = f"{100 * value:.1f}" if key.endswith(("/acc", "/acc_norm", "/exact_match")) else \
            f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4g}"  # an untrained model's word perplexity
        note = paper.beside(task)
        out.append(f"  {key:<40} {shown}" + (f"   ({note})" if note else ""))
    if any(t in paper.BY_TASK for t in result["metrics"]) and paper.NO_TASK:
        out.append(f"  ({', '.join(paper.NO_TASK)} of the paper's Table 3 has no lm-eval task: not run)")
    return out


def after_training(prepared: Prepared | None, cfg: DictConfig, run_dir: Path, trainer: Any,
                   summary: dict[str, Any]) -> list[str]:
    """At the end of a run with `eval.tasks`: evaluate its last checkpoint, record the results (also
    into `summary`, which the trackers get next), say what came out. A failure here is one line: the
    run itself is whole."""
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    if prepared is None:
        return []
    if not ckpt.is_file():
        return ["tasks: not run (no checkpoints/last.ckpt: a fast_dev_run saves none)"]
    try:
        model, tok, prefix = hf_model_of_run(cfg, ckpt, run_data(cfg))
        result = evaluate(prepared, model, tok, prefix)
    except Exception as err:  # noqa: BLE001 (the run is finished and recorded; its tasks can run again)
        return [f"tasks: failed ({type(err).__name__}: {err}); the run is whole: attnres-tasks {run_dir} "
                f"--tasks {','.join(prepared.tasks)} runs them again"]
    record(run_dir, result, trainer.global_step, [lg for lg in trainer.loggers if hasattr(lg, "log_metrics")])
    summary.setdefault("metrics", {}).update(result["metrics"])
    summary["tasks"] = result
    return lines(result)


#: attnres-tasks' numeric flags: the `eval` block's rules (attnres/config/rules.py), said as flags
FLAGS = {"limit": "documents per task, 1 or more (leave it out for all)",
         "num_fewshot": "few-shot examples, 0 or more (leave it out for each task's own)",
         "batch_size": "sequences per forward pass, 1 or more", "num_docs": "documents per own task, 1 or more"}


def check_flags(opts: dict[str, Any]) -> None:
    """The command line's values, before anything is read: one ConfigError naming the flag."""
    if not opts["tasks"]:
        raise ConfigError("--tasks names no task; e.g. --tasks attnres_bpb (comma-separated)")
    rules = RULES[("eval", ())]
    for key, wanted in FLAGS.items():
        problem = rules[key].problem(opts[key])
        if problem is not None:
            raise ConfigError(f"--{key.replace('_', '-')} {opts[key]} {problem}; give {wanted}")


def check_writable(folder: Path) -> None:
    """A run folder's results go into its metrics.json and tasks/: refuse before evaluating when they cannot."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".attnres-tasks-"):
            pass
    except OSError as err:
        raise ConfigError(f"{folder} is not writable ({err.strerror}), and the results go into its metrics.json; "
                          "make it writable or evaluate a copy (cp -r)") from None
    for path in (folder / "metrics.json", folder / "tasks"):
        if path.exists() and not os.access(path, os.W_OK):
            raise ConfigError(f"{path} is not writable (read-only or immutable), and the results go there; make it "
                              "writable or evaluate a copy of the run folder (cp -r)")


class NotRecorded(Exception):  # noqa: N818  (a result in hand, not an error of the evaluation)
    """The evaluation finished but its results could not be written: they are still printed."""

    def __init__(self, result: dict[str, Any], err: OSError) -> None:
        super().__init__(str(err))
        self.result, self.err = result, err


def evaluate_folder(folder: Path, opts: dict[str, Any], checkpoint: str = "last") -> dict[str, Any]:
    """attnres-tasks on a run folder or an exported one: checked, evaluated, recorded."""
    if (folder / "config.json").is_file() and not (folder / ".hydra").is_dir():
        prepared = Prepared(opts, None)
        model, tok, prefix = hf_model_of_folder(folder)
        return evaluate(prepared, model, tok, prefix)  # printed; an exported folder stays as attnres-export wrote it
    from attnres.export.main import check_run

    cfg, _, ckpt = check_run(folder, checkpoint)
    check_writable(folder)
    datamodule = run_data(cfg)
    prepared = Prepared(opts, datamodule)
    model, tok, prefix = hf_model_of_run(cfg, ckpt, datamodule)
    result = evaluate(prepared, model, tok, prefix)
    try:
        record(folder, result)
    except OSError as err:  # the folder changed under us (a full disk, a permission): the numbers are not lost
        raise NotRecorded(result, err) from err
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description="Downstream tasks through lm-evaluation-harness on a "
                                     "run folder or a folder written by attnres-export (docs/tasks.md).")
    parser.add_argument("folder", metavar="RUN_DIR", help="a run folder (outputs/<name>/<run>) or an exported one")
    parser.add_argument("--tasks", required=True, help="comma-separated: attnres_pointer, attnres_next_line, "
                        f"attnres_bpb, {paper.GROUP}, or any lm-eval task whose data is local")
    parser.add_argument("--limit", type=int, default=None, help="documents per task at most (default: all)")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="sequences per forward pass")
    parser.add_argument("--num-docs", type=int, default=DEFAULTS["num_docs"],
                        help="documents attnres generates for each of its own tasks")
    parser.add_argument("--checkpoint", choices=("last", "best"), default="last", help="which checkpoint of a run")
    parser.add_argument("--include-path", action="append", default=[], metavar="DIR",
                        help="a folder of lm-eval task YAMLs of your own (repeatable; lm_eval's --include_path)")
    parser.add_argument("--online", action="store_true", help="let lm-eval reach the Hub (default: offline)")
    parser.add_argument("--unsafe-code", action="store_true", help="allow tasks that run the model's code")
    args = parser.parse_args(argv)
    opts = {**DEFAULTS, "tasks": args.tasks, "limit": args.limit, "num_fewshot": args.num_fewshot,
            "batch_size": args.batch_size, "num_docs": args.num_docs, "offline": not args.online,
            "unsafe_code": args.unsafe_code, "include_path": args.include_path}
    folder = Path(args.folder).expanduser()
    try:
        opts = settings(opts)
        check_flags(opts)
        if not folder.is_dir():
            raise ConfigError(f"{folder} is not a folder; pass a run folder or one written by attnres-export")
        result = evaluate_folder(folder, opts, args.checkpoint)
    except NotRecorded as stop:
        print("\n".join(lines(stop.result)))
        print(f"{PROG}: error: the results above are not recorded ({stop.err}); make the run folder writable and "
              "run the same command again to record them", file=sys.stderr)
        sys.exit(2)
    except ConfigError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        sys.exit(2)
    except ImportError as err:  # transformers (the hf extra) is missing; lm-eval itself is a ConfigError
        print(f"{PROG}: error: {err.name or err} is not installed; {lmeval.EXTRA}", file=sys.stderr)
        sys.exit(2)
    for line in lines(result):
        print(line)
    if (folder / "metrics.json").is_file():
        print(f"  recorded in {folder / 'metrics.json'} and TensorBoard ({folder / 'tasks'})")


if __name__ == "__main__":
    main()
