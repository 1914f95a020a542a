"""Run-folder names (attnres/config/naming.py): one flat, bounded, stable name per job, whatever
paths its override values hold."""

from __future__ import annotations

from attnres.config.naming import run_id


def test_run_id_is_one_flat_bounded_stable_name():
    assert run_id("") == "defaults"
    assert run_id("residual=block,seed=1") == "residual=block,seed=1"  # plain names are kept
    a = run_id("data.path=/data/a/corpus.txt,seed=0")
    b = run_id("data.path=/data/b/corpus.txt,seed=0")
    assert a != b and a == run_id("data.path=/data/a/corpus.txt,seed=0")
    assert a.startswith("data.path=corpus.txt-") and a.endswith(",seed=0")
    for name in (a, b, run_id("data.cache_dir=/tmp/x"), run_id("ckpt_path=../up/last.ckpt"),
                 run_id("x=[a/b,c/d],y=/"), run_id("k=./.hidden"), run_id("model/attn=flash")):
        assert "/" not in name and not name.startswith(".") and name not in (".", ".."), name
    long = run_id(",".join(f"key{i}=value{i}" for i in range(60)))
    longer = run_id(",".join(f"key{i}=value{i}" for i in range(61)))
    assert len(long.encode()) <= 200 and len(longer.encode()) <= 200 and long != longer
    assert long.startswith("key0=value0,key1=value1")


def test_a_tracker_or_thread_count_does_not_change_the_folder():
    """Issue "The first hour", item 6: `logger=mlflow` gave the same computation a new folder."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tests.helpers import CONF

    folders = []
    for extra in ([], ["logger=mlflow"], ["logger=none", "threads=1"], ["logger=many"]):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            overrides = ["residual=block", "seed=1", *extra]
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
            # what Hydra fills in when a run starts: the overrides, less the excluded keys
            excluded = set(cfg.hydra.job.config.override_dirname.exclude_keys)
            kept = sorted(o for o in overrides if o.split("=", 1)[0] not in excluded)
            folders.append(run_id(",".join(kept)))
        GlobalHydra.instance().clear()
    assert len(set(folders)) == 1 and folders[0] == "residual=block,seed=1", folders


def test_a_sweeps_folders_lead_with_what_differs(monkeypatch):
    """Issue "The first hour, round two", item 7: TensorBoard's run list showed six identical
    `model.n_layer=2,num_blocks=2,residua...` names for a sweep over residual and seed."""
    from attnres.config import naming

    command = ["-m", "residual=standard,block", "seed=range(3)", "model.n_layer=2", "num_blocks=2",
               "experiment/paper_ablation@_global_=a,b", "+x=1"]
    assert naming.swept_keys(command) == ["residual", "seed", "experiment.paper_ablation@_global_"]
    dirname = "model.n_layer=2,num_blocks=2,residual=block,seed=1"
    monkeypatch.delenv(naming.SWEPT_ENV, raising=False)
    assert naming.run_id(dirname) == dirname  # a run alone: Hydra's order
    naming.set_swept_keys(command)
    assert naming.run_id(dirname) == "residual=block,seed=1,model.n_layer=2,num_blocks=2"
    names = {naming.run_id(f"model.n_layer=2,num_blocks=2,residual={r},seed={s}")[:30]
             for r in ("standard", "block") for s in range(3)}
    assert len(names) == 6  # distinct within the 30 characters a narrow run list shows


def test_eval_and_sample_folders_lead_with_the_checkpoint():
    """Issue "The first hour, round two", item 7: sample folders were named after the prompt, so two
    checkpoints sampled with one prompt shared a folder; what differs between them is the checkpoint."""
    dirname = "mode=sample,sample.prompt=def main"
    block = run_id(dirname, "outputs/default/residual=block/checkpoints/last.ckpt", "sample")
    standard = run_id(dirname, "outputs/default/residual=standard/checkpoints/last.ckpt", "sample")
    best = run_id(dirname, "outputs/default/residual=block/checkpoints/best.ckpt", "sample")
    assert block.startswith("from=residual-block.last-") and block.endswith(",mode=sample,sample.prompt=def main")
    assert standard.startswith("from=residual-standard.last-")
    assert len({block, standard, best}) == 3
    assert run_id("", "runs/a/checkpoints/last.ckpt", "eval").startswith("from=a.last-")
    # training from a checkpoint, or no checkpoint: the names they always had
    assert run_id("residual=block", "runs/a/checkpoints/last.ckpt", "train") == "residual=block"
    assert run_id(dirname, None, "sample") == dirname and run_id("") == "defaults"
    long = "x=" + "a" * 300
    assert run_id(long, "r/checkpoints/last.ckpt", "sample") != run_id(long, "s/checkpoints/last.ckpt", "sample")


def test_the_run_folder_interpolation_passes_the_checkpoint_and_mode():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tests.helpers import CONF

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["mode=sample", "ckpt_path=runs/a/checkpoints/last.ckpt"],
                      return_hydra_config=True)
    GlobalHydra.instance().clear()
    cfg.hydra.job.override_dirname = "mode=sample"
    assert cfg.hydra.run.dir.endswith("/from=a.last-" + cfg.hydra.run.dir.rsplit("-", 1)[1])
    assert cfg.hydra.sweep.subdir.startswith("from=a.last-") and cfg.hydra.sweep.subdir.endswith(",mode=sample")


def test_seeds_on_demand_folders_lead_with_the_seed(monkeypatch):
    """Seeds on demand picks the seeds itself, so `seed` varies between the jobs without being on the
    command line: without this its job folders read residual=block,data.batch_size=4,... for every seed."""
    from attnres.config import naming

    monkeypatch.delenv(naming.SWEPT_ENV, raising=False)
    assert naming.swept_keys(["-m", "residual=standard,block", "seeds.on_demand=true"]) == ["residual", "seed"]
    assert naming.swept_keys(["-m", "residual=standard,block", "seeds.on_demand=false"]) == ["residual"]
    naming.set_swept_keys(["-m", "residual=standard,block", "seeds.on_demand=true"])
    assert naming.run_id("data.batch_size=4,residual=block,seed=3") == "residual=block,seed=3,data.batch_size=4"
