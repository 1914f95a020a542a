"""Downstream tasks (eval.tasks, attnres-tasks): attnres's own task data, the refusals (no lm-eval,
data not local: one line, exit 2, before any model work), and a tiny sweep's verdict on a task.
The bits-per-byte cross-check with the runner is tests/tasks/test_tasks_bpb.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from attnres.config.errors import ConfigError
from attnres.data import SyntheticDataModule
from attnres.data.common import TRAIN_STREAM
from attnres.tasks import lmeval, local, main, paper
from tests import helpers

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # nothing may reach the network in a test


def test_pointer_documents_ask_the_last_hop_with_a_hop_short_and_a_hop_too_far_among_the_choices():
    dm = SyntheticDataModule(num_symbols=8, num_hops=2, block_size=40)
    docs = local.pointer_docs(dm, 50)
    assert len(docs) == 50
    for doc in docs:
        words = doc["context"].split()  # the pairs, earlier queries, then this one's QUERY x_0 ANS
        assert len(words) <= dm.block_size and words[-3] == "Q" and words[-1] == "A"
        pairs = words[: 2 * dm.num_pairs]
        follow = {pairs[i + 1]: pairs[i] for i in range(0, len(pairs), 2)}  # key k3 -> value v5
        hop1 = follow[words[-2]]
        hop2 = follow["k" + hop1[1:]]
        hop3 = follow["k" + hop2[1:]]
        assert doc["choices"][doc["label"]] == hop2
        assert {hop1, hop3} <= set(doc["choices"]) and len(set(doc["choices"])) == 4
    labels = [d["label"] for d in docs]
    assert len(set(labels)) == 4  # the answer is not always in one place


def test_pointer_documents_come_from_a_stream_no_run_trains_or_validates_on():
    dm = SyntheticDataModule(num_symbols=8, num_hops=2, block_size=40)
    task = dm._dataset(local.TASK_STREAM, 0, 100)
    seen = {tuple(dm._dataset(TRAIN_STREAM, seed, 100)[i][0].tolist()) for seed in range(5) for i in range(100)}
    seen |= {tuple(x.tolist()) for x, _ in dm.val_dataset()}
    assert not any(tuple(task[i][0].tolist()) in seen for i in range(100))


def test_next_line_documents_continue_their_context_with_the_true_line():
    text = "".join(f"def function_{i}(argument):\n    return argument + {i * 7}\n\n\n\n" for i in range(300))
    val = torch.tensor(list(text.encode())).numpy().astype("uint8")
    docs = local.next_line_docs(val, 256, 40)
    assert len(docs) == 40
    for doc in docs:
        truth = doc["choices"][doc["label"]]
        assert doc["context"].endswith("\n") and truth.endswith("\n") and len(doc["context"].encode()) <= 256 - 82
        assert doc["context"] + truth in text and len(set(doc["choices"])) == 4
        assert doc["context"].strip()  # lm-eval refuses a context that is whitespace alone
    sparse = "".join(f"value_{i} = {i * 7}  # a line\n" + "\n" * 70 for i in range(40))  # blank lines between
    sparse_docs = local.next_line_docs(torch.tensor(list(sparse.encode())).numpy().astype("uint8"), 256, 40)
    assert sparse_docs and all(doc["context"].strip() for doc in sparse_docs)
    with pytest.raises(ConfigError, match="block_size >= 98"):
        local.next_line_docs(val, 64, 10)


def test_settings_expand_the_papers_table_and_refuse_a_task_list_that_is_not_one():
    opts = main.settings({"tasks": ["attnres_pointer", "paper_table3", "mmlu"]})
    assert opts["tasks"][:3] == ["attnres_pointer", "mmlu", "mmlu_pro"] and "ceval-valid" in opts["tasks"]
    assert len(opts["tasks"]) == 1 + 14  # CMath has no lm-eval task
    assert paper.NO_TASK == ["CMath"] and "73.5 -> 74.6" in paper.beside("mmlu")
    with pytest.raises(ConfigError, match=r"eval.tasks=\[attnres_bpb\]"):
        main.settings({"tasks": 3})


def test_offline_is_the_default_and_the_users_own_setting_wins(monkeypatch):
    for name in lmeval.OFFLINE:
        monkeypatch.delenv(name, raising=False)
    lmeval.go_offline(True)
    assert all(os.environ[n] == "1" for n in lmeval.OFFLINE)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    lmeval.go_offline(True)
    assert os.environ["HF_DATASETS_OFFLINE"] == "0"


def test_a_run_gets_its_tasks_from_its_caller_and_without_them_refuses_a_config_that_names_some():
    """The tasks sit above training (they evaluate finished runs): train() takes attnres.tasks.main
    from cli.py and the sweep's jobs, and never drops eval.tasks when a caller passes none."""
    from omegaconf import OmegaConf

    from attnres.training.run import end_tasks

    with_tasks, without = OmegaConf.create({"eval": {"tasks": ["attnres_bpb"]}}), OmegaConf.create({"eval": {}})
    with pytest.raises(ConfigError, match="tasks=attnres.tasks.main"):
        end_tasks(None, with_tasks, None)
    assert end_tasks(None, without, None) is None and end_tasks(main, without, None) is None


# -- the command line: refusals and a tiny sweep ---------------------------------------------------
TINY = helpers.tiny(steps=3, val_every=3, progress_bar=False)


@pytest.mark.slow
def test_a_task_whose_data_is_not_local_is_one_line_before_any_model_work(tmp_path):
    empty = {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets"), **OFFLINE}
    result = helpers.run_cli(*TINY, "eval.tasks=[attnres_pointer,hellaswag]", cwd=tmp_path, env=empty)
    line = helpers.one_line_error(result)
    assert "hellaswag (dataset Rowan/hellaswag)" in line and "not in the local cache" in line, line
    assert "attnres_pointer" not in line.split("cache:")[1].split(";")[0]  # attnres's own task is local
    assert "lm_eval --model dummy --tasks hellaswag" in line, line
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*.ckpt"))


@pytest.mark.slow
def test_without_lm_eval_a_run_with_tasks_names_the_extra_in_one_line(tmp_path):
    fake = tmp_path / "site" / "lm_eval"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'lm_eval'\", name='lm_eval')\n")
    env = {"PYTHONPATH": str(tmp_path / "site"), **OFFLINE}
    line = helpers.one_line_error(helpers.run_cli(*TINY, "eval.tasks=[attnres_pointer]", cwd=tmp_path, env=env))
    assert line == "attnres-run: error: lm-eval is not installed; pip install 'attnres[eval]' (the eval extra) to " \
                   "run tasks", line
    assert helpers.run_cli(*TINY, cwd=tmp_path, env=env).returncode == 0  # without tasks nothing needs it


@pytest.mark.slow
def test_a_tiny_sweep_with_a_task_prints_a_verdict_per_strategy_and_task_metric(tmp_path):
    result = helpers.run_cli("-m", *TINY, "residual=standard,block", "num_blocks=2", "seed=0,1",
                             "eval.tasks=[attnres_pointer]", "eval.num_docs=40", "name=tasks", cwd=tmp_path,
                             env=OFFLINE)
    assert result.returncode == 0, result.stderr[-3000:]
    verdicts = [line for line in result.stdout.splitlines() if line.startswith("verdict:")]
    task = [line for line in verdicts if "attnres_pointer/acc" in line]
    assert len(task) == 1 and task[0].startswith("verdict: block vs standard: "), verdicts
    assert "(paired t, 2 seeds; higher is better; margin 0.0100 = 1 point)" in task[0], task[0]
    assert "not resolved: 2 seeds barely estimate the spread" in task[0], task[0]  # two pairs name no winner
    assert any("val/accuracy" in line for line in verdicts)
    header = next(line for line in result.stdout.splitlines() if line.startswith("job"))
    assert "attnres_pointer/acc" in header
    summary = (tmp_path / "multirun" / "tasks" / "summary.md").read_text()
    assert "attnres_pointer/acc" in summary
    run = next(p.parent for p in (tmp_path / "multirun" / "tasks").glob("*/metrics.json")
               if "residual=block" in p.parent.name and "seed=0" in p.parent.name)
    metrics = json.loads((run / "metrics.json").read_text())
    assert 0.0 <= metrics["metrics"]["attnres_pointer/acc"] <= 1.0
    assert metrics["tasks"]["samples"] == {"attnres_pointer": 40} and metrics["tasks"]["lm_eval_version"]


@pytest.mark.slow
def test_attnres_tasks_on_a_run_folder_records_into_metrics_json_and_tensorboard(tmp_path):
    run = helpers.run_cli(*helpers.tiny(data="stdlib", steps=3, val_every=3, progress_bar=False),
                          "data.max_files=20", "data.block_size=128", "name=bytes", cwd=tmp_path, env=OFFLINE)
    assert run.returncode == 0, run.stderr[-3000:]
    folder = next((tmp_path / "outputs" / "bytes").iterdir())
    val_bpb = json.loads((folder / "metrics.json").read_text())["metrics"]["val/bpb"]
    result = helpers.run_script("attnres/tasks/main.py", str(folder), "--tasks",
                                "attnres_next_line,attnres_bpb", "--num-docs", "40", cwd=tmp_path, env=OFFLINE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("tasks: lm-eval 0.4.") and "attnres_next_line/acc " in result.stdout
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["tasks"]["samples"] == {"attnres_next_line": 40, "attnres_bpb": 1}
    bpb_folder = metrics["tasks"]["task_folders"]["attnres_bpb"]
    assert 0.0 <= metrics["metrics"]["attnres_next_line/acc"] <= 1.0
    # the held-out text after its first byte, read after "\n": the runner's val/bpb but for one byte's context
    assert abs(metrics["metrics"]["attnres_bpb/bits_per_byte"] - val_bpb) < 0.01
    assert list((folder / "tasks").glob("events.out.tfevents.*"))
    again = helpers.run_script("attnres/tasks/main.py", str(folder), "--tasks", "nonexistent_task",
                               cwd=tmp_path, env=OFFLINE)
    assert again.returncode == 2 and again.stderr.startswith("attnres-tasks: error: unknown task(s) nonexistent_task")
    assert len(again.stderr.strip().splitlines()) == 1, again.stderr

    # the same model exported: attnres's own tasks need the run's data, a folder of task YAMLs runs as it is
    export = helpers.run_script("attnres/export/main.py", str(folder), str(tmp_path / "hf"), cwd=tmp_path)
    assert export.returncode == 0, export.stderr[-3000:]
    exported_files = list((tmp_path / "hf").iterdir())
    own = helpers.run_script("attnres/tasks/main.py", str(tmp_path / "hf"), "--tasks", "attnres_bpb",
                             cwd=tmp_path, env=OFFLINE)
    assert own.returncode == 2 and "need(s) the run's data" in own.stderr and len(own.stderr.splitlines()) == 1
    given = helpers.run_script("attnres/tasks/main.py", str(tmp_path / "hf"), "--tasks", "attnres_bpb",
                               "--include-path", bpb_folder, cwd=tmp_path, env=OFFLINE)
    assert given.returncode == 0, given.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(p.name for p in exported_files)  # untouched
    shown = next(line for line in given.stdout.splitlines() if "attnres_bpb/bits_per_byte" in line)
    assert abs(float(shown.split()[-1]) - metrics["metrics"]["attnres_bpb/bits_per_byte"]) < 1e-4, shown


# -- refused before any work: attnres-tasks' flags, eval.* of a run, a folder it cannot write ------------
@pytest.mark.parametrize(("args", "said"), [
    (["--tasks", ""], "--tasks names no task; e.g. --tasks attnres_bpb"),
    (["--tasks", ","], "--tasks names no task"),
    (["--tasks", "attnres_bpb", "--limit", "0"], "--limit 0 is out of range; give documents per task, 1 or more"),
    (["--tasks", "attnres_bpb", "--limit", "-3"], "--limit -3 is out of range"),
    (["--tasks", "attnres_bpb", "--batch-size", "0"], "--batch-size 0 is out of range; give sequences per forward"),
    (["--tasks", "attnres_bpb", "--num-docs", "0"], "--num-docs 0 is out of range"),
    (["--tasks", "attnres_bpb", "--num-fewshot", "-1"], "--num-fewshot -1 is out of range"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_attnres_tasks_refuses_a_bad_flag_in_one_line_before_reading_the_folder(tmp_path, capsys, monkeypatch,
                                                                                  args, said):
    monkeypatch.setattr(main, "evaluate_folder", lambda *a: pytest.fail("a refused flag reached the folder"))
    with pytest.raises(SystemExit) as stop:
        main.main([str(tmp_path), *args])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("attnres-tasks: error: " + said), err


@pytest.mark.parametrize(("key", "said"), [("limit", "eval.limit=0 is out of range; set eval.limit to an integer "
                                                      ">= 1 (or null)"),
                                           ("batch_size", "eval.batch_size=0 is out of range"),
                                           ("num_docs", "eval.num_docs=0 is out of range")])
def test_a_runs_eval_settings_are_checked_with_its_other_values(key, said):
    from omegaconf import OmegaConf

    from attnres.config.rules import validate_config

    cfg = OmegaConf.create({"eval": {"tasks": ["attnres_bpb"], "limit": None, "batch_size": 16, "num_docs": 500}})
    validate_config(cfg)
    cfg.eval[key] = 0
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
        validate_config(cfg)


@pytest.mark.slow
def test_a_run_with_eval_limit_0_is_refused_before_training(tmp_path):
    result = helpers.run_cli(*TINY, "eval.tasks=[attnres_bpb]", "eval.limit=0", cwd=tmp_path, env=OFFLINE)
    assert helpers.one_line_error(result).startswith("attnres-run: error: eval.limit=0 is out of range")
    assert not (tmp_path / "outputs").exists()


@pytest.fixture
def unwritable():
    """Makes a path unwritable even for root (chattr +i) or, without that, for its owner (chmod); undone after."""
    import shutil
    import subprocess

    made = []

    def make(path):
        chattr = shutil.which("chattr")
        if chattr and subprocess.run([chattr, "+i", str(path)], capture_output=True).returncode == 0:
            made.append(lambda: subprocess.run([chattr, "-i", str(path)], check=True))
        elif os.geteuid() != 0:
            mode = path.stat().st_mode
            path.chmod(0o555 if path.is_dir() else 0o444)
            made.append(lambda: path.chmod(mode))
        else:
            pytest.skip("root without chattr +i: nothing here can make a path unwritable")

    yield make
    for undo in reversed(made):
        undo()


@pytest.mark.slow
@pytest.mark.parametrize("what", ["metrics.json", "folder"])
def test_attnres_tasks_on_a_run_folder_it_cannot_write_refuses_before_evaluating(strategy_runs, tmp_path, capsys,
                                                                                  monkeypatch, unwritable, what):
    run = helpers.copy_run(strategy_runs["standard"].dir, tmp_path / "run")
    monkeypatch.setattr(main, "run_data", lambda cfg: pytest.fail("the model work started"))
    unwritable(run / "metrics.json" if what == "metrics.json" else run)
    with pytest.raises(SystemExit) as stop:
        main.main([str(run), "--tasks", "attnres_pointer"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "is not writable" in err, err
    assert "make it writable or evaluate a copy" in err, err


def test_results_that_cannot_be_recorded_after_evaluating_are_printed_then_one_line(tmp_path, capsys, monkeypatch):
    """A folder that becomes unwritable during the evaluation (a full disk): the numbers are shown, then one line."""
    result = {"lm_eval_version": "0.4.9", "seconds": 1.0, "metrics": {"attnres_bpb/bits_per_byte": 2.5}}

    import attnres.export.main as export

    (tmp_path / "metrics.json").write_text('{"metrics": {"val/bpb": 3.0}}')
    monkeypatch.setattr(export, "check_run", lambda folder, checkpoint: (None, None, folder / "last.ckpt"))
    monkeypatch.setattr(main, "run_data", lambda cfg: None)
    monkeypatch.setattr(main, "Prepared", lambda opts, datamodule: None)
    monkeypatch.setattr(main, "hf_model_of_run", lambda cfg, ckpt, datamodule: (None, None, None))
    monkeypatch.setattr(main, "evaluate", lambda *a: result)

    def disk_full(path, data):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(main, "write_json", disk_full)
    with pytest.raises(SystemExit) as stop:
        main.main([str(tmp_path), "--tasks", "attnres_bpb"])
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and "attnres_bpb/bits_per_byte" in out and "2.5000" in out
    assert err.count("\n") == 1 and "the results above are not recorded" in err and "No space left" in err, err
