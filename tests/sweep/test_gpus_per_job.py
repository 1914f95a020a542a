"""The parallel launcher's `hydra.launcher.gpus_per_job=G` (attnres/sweep/slots.py, job.py): slots
count GPUs (8 GPUs are 4 slots of 2), a job on such a slot runs as G DDP ranks, and the same on the
CPU (G gloo processes per job)."""

from __future__ import annotations

import pytest

from attnres.config.errors import ConfigError
from attnres.sweep.slots import plan_slots
from tests.helpers import metrics, one_line_error, run_cli


def test_slots_count_gpus():
    slots = plan_slots([str(g) for g in range(8)], 1, None, gpus_per_job=2)
    assert [s.device for s in slots] == ["0,1", "2,3", "4,5", "6,7"] and {s.gpus for s in slots} == {2}
    assert [s.name for s in slots] == ["gpu0+1.0", "gpu2+3.0", "gpu4+5.0", "gpu6+7.0"]
    three = plan_slots([str(g) for g in range(8)], 1, None, gpus_per_job=3)
    assert [s.device for s in three] == ["0,1,2", "3,4,5"]  # two GPUs are left over, never half a job
    assert [s.name for s in plan_slots(["0", "1"], 2, None)] == ["gpu0.0", "gpu0.1", "gpu1.0", "gpu1.1"]
    cpu = plan_slots([], 1, 4, gpus_per_job=2)
    assert len(cpu) == 2 and all(s.device is None and s.gpus == 2 for s in cpu)
    with pytest.raises(ConfigError, match="gpus_per_job=4 but 2 GPU"):
        plan_slots(["0", "1"], 1, None, gpus_per_job=4)
    with pytest.raises(ConfigError, match="gpus_per_job=0 must be"):
        plan_slots(["0", "1"], 1, None, gpus_per_job=0)


@pytest.mark.slow
def test_a_job_of_two_ranks_keeps_the_global_batch(tmp_path):
    result = run_cli(
        "-m", "hydra.launcher.gpus_per_job=2", "hydra.launcher.cpu_jobs=2", f"hydra.launcher.lock_dir={tmp_path}/locks",
        "data=stdlib", "data.max_files=40", "data.block_size=32", "data.batch_size=4", "data.val_batches=1",
        "data.tokens_per_step=256", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false", "trainer.max_steps=10", "trainer.val_check_interval=1000",
        "seed=0", "hydra.sweep.dir=sweep", cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 slots: cpu0" in result.stderr + result.stdout
    (run,) = [d.parent.parent for d in (tmp_path / "sweep").glob("*/.hydra/overrides.yaml")]
    assert metrics(run)["status"] == "finished"
    log = (run / "train.log").read_text()
    assert "1 micro-batch(es) of 4 x 32 per device and step, 2 device(s)" in log, log[-3000:]


@pytest.mark.slow
def test_a_job_asking_for_two_nodes_runs_on_its_slot_and_a_single_run_is_refused(tmp_path):
    """experiment=paper_scaling asks for 2 nodes at its large sizes: on one machine a sweep job runs
    on its slot (the global batch kept), and a single run is refused in one line, not left waiting
    for a node that never comes."""
    run = ["data=stdlib", "data.max_files=40", "data.block_size=32", "data.batch_size=4", "data.val_batches=1",
           "data.tokens_per_step=256", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
           "trainer.accelerator=cpu", "trainer.enable_progress_bar=false", "trainer.max_steps=4",
           "trainer.val_check_interval=1000", "trainer.devices=2", "+trainer.num_nodes=2"]
    swept = run_cli("-m", "hydra.launcher.cpu_jobs=1", f"hydra.launcher.lock_dir={tmp_path}/locks", *run, "seed=0",
                    "hydra.sweep.dir=sweep", cwd=tmp_path, timeout=600)
    assert swept.returncode == 0, swept.stderr[-3000:]
    assert "trainer.devices=2 x trainer.num_nodes=2 asked, on one machine it runs on slot cpu0's 1 device(s)" in \
        swept.stdout + swept.stderr
    (job,) = [d.parent.parent for d in (tmp_path / "sweep").glob("*/.hydra/overrides.yaml")]
    assert metrics(job)["status"] == "finished"
    assert "2 micro-batch(es) of 4 x 32 per device and step, 1 device(s)" in (job / "train.log").read_text()
    single = run_cli(*run, "hydra.run.dir=single", cwd=tmp_path, timeout=300)
    assert one_line_error(single).startswith("attnres-run: error: trainer.num_nodes=2 needs a launcher")
    assert not (tmp_path / "single").exists()  # a refused command leaves nothing behind
