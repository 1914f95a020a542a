"""The paper's experiments as sweeps (conf/experiment/paper_*.yaml, docs/configuration.md "The
paper's experiments"): every job composes with its Table 2 row's shape (the conf/model/paper-*
presets), lr, batch, context and tokens, Table 4's rows and Figure 6's block sizes; the FLOPs and
GPU-hours a sweep prints before it starts (attnres/config/costs.py) against a count by hand; the
paper scale refuses the stdlib corpus; and the `scale=cpu` variants run (slow)."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from attnres.config import costs
from attnres.config.errors import ConfigError
from attnres.results import verdict
from tests.helpers import CONF, one_line_error, run_cli

#: Table 2 (transcribed, docs/configuration.md): size -> (peak lr, batch in sequences, tokens)
TABLE_2 = {"194m": (2.99e-3, 192, 38.7e9), "241m": (2.80e-3, 256, 45.4e9), "296m": (2.50e-3, 320, 62.1e9),
           "436m": (2.20e-3, 384, 87.9e9), "528m": (2.02e-3, 432, 119.0e9)}
CONTEXT = 8192
#: Table 4's rows: file of conf/experiment/paper_ablation/ -> (strategy, its options at the paper scale)
TABLE_4 = {"baseline": ("StandardResidual", {}), "denseformer": ("DenseFormerResidual", {}),
           "mhc": ("ManifoldHyperConnectionResidual", {}), "full": ("FullAttentionResidual", {}),
           "full_input_query": ("FullAttentionResidual", {"query": "input"}),
           "full_static_mixing": ("FullAttentionResidual", {"mixing": "static"}),
           "full_sigmoid": ("FullAttentionResidual", {"scoring": "sigmoid"}),
           "full_no_key_norm": ("FullAttentionResidual", {"key_norm": False}),
           "full_window": ("FullAttentionResidual", {"window": 8}),
           "block": ("BlockAttentionResidual", {"num_blocks": 8}),  # S = 4 of 32 sublayers
           "block_multihead": ("BlockAttentionResidual", {"heads": 16, "num_blocks": 8}),
           "block_no_key_norm": ("BlockAttentionResidual", {"key_norm": False, "num_blocks": 8})}
ROW = "experiment/paper_ablation@_global_"


@pytest.fixture(scope="module")
def jobs():
    """`jobs(experiment, *overrides, sweep=True)`: every job of the experiment's built-in sweep as
    (overrides, config), composed as the sweep composes them, its run folder filled in (`sweep=False`:
    the one job of the overrides). Each sweep is composed once per module (a compose costs about 0.25 s,
    a paper_scaling sweep 16 of them, and four tests read the same one); every call gets copies of its
    own, and Hydra's config is the last job's, as after composing."""
    composed: dict[tuple, list[tuple[list[str], object]]] = {}
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        def compose_all(experiment: str, overrides: tuple[str, ...], sweep: bool) -> list[tuple[list[str], object]]:
            head = compose("config", overrides=[f"experiment={experiment}", *overrides], return_hydra_config=True)
            params = {k: str(v).split(",") for k, v in head.hydra.sweeper.params.items()} if sweep else {}
            out = []
            for values in itertools.product(*params.values()):
                swept = (f"{k}={v}" for k, v in zip(params, values, strict=True))
                job = [f"experiment={experiment}", *overrides, *swept]
                cfg = compose("config", overrides=job, return_hydra_config=True)
                cfg.hydra.runtime.output_dir = "/nonexistent/run"
                HydraConfig.instance().set_config(cfg)
                out.append((job, cfg))
            return out

        def expand(experiment: str, *overrides: str, sweep: bool = True) -> list[tuple[list[str], object]]:
            key = (experiment, overrides, sweep)
            if key not in composed:
                composed[key] = compose_all(experiment, overrides, sweep)
            out = copy.deepcopy(composed[key])
            HydraConfig.instance().set_config(out[-1][1])
            return out
        yield expand
    GlobalHydra.instance().clear()


def value(job: list[str], key: str) -> str:
    return next(o.split("=", 1)[1] for o in job if o.startswith(key + "="))


def test_paper_scaling_is_table_2_at_the_presets_shapes(jobs):
    found = jobs("paper_scaling", "data=tokens", "data.path=/nonexistent")
    assert sorted((value(j, "size"), value(j, "residual")) for j, _ in found) == \
        sorted(itertools.product(TABLE_2, ("standard", "block", "full")))
    presets = {s: compose("config", overrides=[f"model=paper-{s}"]).model for s in TABLE_2}  # in jobs' Hydra
    for job, cfg in found:
        size = value(job, "size")
        lr, batch, tokens = TABLE_2[size]
        model = OmegaConf.to_container(cfg.model, resolve=True)
        preset = presets[size]
        assert {k: model[k] for k in ("n_layer", "n_head", "n_embd", "mlp", "mlp_hidden")} == \
            {k: preset[k] for k in ("n_layer", "n_head", "n_embd", "mlp", "mlp_hidden")}, size
        assert cfg.optim.optimizer.lr == lr and cfg.data.block_size == CONTEXT == model["block_size"]
        assert cfg.data.tokens_per_step == batch * CONTEXT and batch % cfg.data.batch_size == 0
        steps = cfg.trainer.max_steps
        assert (steps - 1) * batch * CONTEXT < tokens <= steps * batch * CONTEXT  # the row's tokens, rounded up
        assert cfg.optim.schedule._target_.endswith("warmup_cosine")  # the paper's cosine, after 1% warm-up
        assert cfg.optim.schedule.warmup_steps == pytest.approx(steps / 100, abs=1)
        if cfg.residual._target_.endswith("BlockAttentionResidual"):
            blocks, sublayers = cfg.residual.num_blocks, 2 * model["n_layer"]
            divisors = [d for d in range(1, sublayers + 1) if sublayers % d == 0]
            assert blocks == min(divisors, key=lambda d: abs(math.log(d / 8)))  # the paper's "about 8" in ratio


def test_budget_scales_steps_warm_up_and_validation(jobs):
    (_, full), = jobs("paper_scaling", "size=194m", "residual=standard", sweep=False)
    (_, tenth), = jobs("paper_scaling", "size=194m", "residual=standard", "budget=0.1", sweep=False)
    assert tenth.trainer.max_steps == math.ceil(full.trainer.max_steps / 10) == math.ceil(38.7e9 / 10 / (192 * CONTEXT))
    assert tenth.optim.schedule.warmup_steps == math.ceil(tenth.trainer.max_steps / 100)
    # ten validations, counted in micro-batches of 4 x 8,192 tokens on each of the job's 8 GPUs: 6 to a step
    assert tenth.trainer.val_check_interval == tenth.trainer.max_steps * 6 // 10
    with pytest.raises(ConfigError, match="budget=0.1"):
        costs.steps(38.7e9, 192 * CONTEXT, 0.0)


def test_paper_ablations_are_table_4_at_436m(jobs):
    found = jobs("paper_ablations", "data=tokens", "data.path=/nonexistent")
    assert sorted(value(j, ROW) for j, _ in found) == sorted(TABLE_4)
    for job, cfg in found:
        target, options = TABLE_4[value(job, ROW)]
        residual = OmegaConf.to_container(cfg.residual, resolve=True)
        assert residual["_target_"] == f"attnres.{target}"
        assert {k: residual[k] for k in options} == options
        assert (cfg.model.n_layer, cfg.model.n_embd, cfg.optim.optimizer.lr) == (16, 1184, 2.20e-3)
        assert cfg.trainer.max_steps == math.ceil(87.9e9 / (384 * CONTEXT))


def test_paper_blocksize_is_figure_6(jobs):
    found = jobs("paper_blocksize", "data=tokens", "data.path=/nonexistent")
    sizes = sorted(32 // cfg.residual.num_blocks for _, cfg in found if "num_blocks" in cfg.residual)
    assert sizes == [1, 2, 4, 8, 16, 32]  # S sublayers per block, S = 1 being Full AttnRes
    assert {cfg.model.n_layer for _, cfg in found} == {16}
    cpu = jobs("paper_blocksize", "scale=cpu")
    assert {cfg.model.n_layer for _, cfg in cpu} == {16} and {cfg.data.block_size for _, cfg in cpu} == {64}


def test_a_sweep_prints_its_flops_and_gpu_hours_counted_by_hand(jobs):
    found = jobs("paper_scaling", "data=tokens", "data.path=/nonexistent")
    lines = costs.announce(found)
    first = costs.job_cost(found[0][1])
    N, V, D, L = first["non_embedding_parameters"], 32768, 888, 12  # size 194m, the assumed vocabulary
    assert first["vocab_from"].startswith("assumed")
    steps = math.ceil(38.7e9 / (192 * CONTEXT))
    assert first["flops"] == pytest.approx((6 * (N + V * D) + 12 * L * CONTEXT * D) * steps * 192 * CONTEXT)
    total = sum(costs.job_cost(cfg)["flops"] for _, cfg in found)
    hours = total / (0.4 * 989e12) / 3600
    assert lines[0].startswith(f"paper_scaling: 15 jobs to run, {total:.3g} training FLOPs")
    assert f"about {hours:,.0f} GPU-hours at 40% MFU of 989 TFLOP/s" in lines[0]
    assert len(lines) == 3 + 15 and lines[3].split()[0] == "residual=standard,size=194m"
    assert costs.announce([(["x=1"], OmegaConf.create({"model": {}}))]) == []  # an experiment without costs: silent


def test_the_paper_scale_refuses_the_stdlib_corpus_and_the_cpu_scale_takes_it(jobs):
    (_, paper), = jobs("paper_scaling", "size=194m", "residual=standard", sweep=False)
    with pytest.raises(ConfigError, match=r"data=stdlib; add data=tokens data.path=<a folder"):
        costs.check_data(paper)
    for _, cfg in jobs("paper_scaling", "scale=cpu"):
        costs.check_data(cfg)
        assert cfg.data.block_size == 64 and cfg.trainer.max_steps <= 300


@pytest.mark.slow
def test_a_paper_scale_sweep_on_the_stdlib_corpus_is_refused_before_it_starts(tmp_path):
    result = run_cli("-m", "experiment=paper_scaling", cwd=tmp_path, timeout=300)
    line = one_line_error(result)
    assert "paper_scaling at scale=paper trains on tokenized text, not data=stdlib" in line
    assert not list(tmp_path.glob("multirun/paper_scaling/*/metrics.json")) and "GPU-hours" not in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("experiment", "narrow", "runs"), [
    ("paper_scaling", ["size=194m"], 3),
    ("paper_blocksize", ["num_blocks=32,1"], 3),  # standard runs once: the other is its duplicate
    ("paper_ablations", [f"{ROW}=baseline,mhc,block_multihead"], 3),
], ids=["scaling", "blocksize", "ablations"])
def test_the_cpu_variant_runs(tmp_path, experiment, narrow, runs):
    """The smallest size (or a few rows) of each experiment at scale=cpu, 5% of its tokens (3 to 11
    steps): too few to measure tokens/s after warm-up, which the verdicts say."""
    result = run_cli("-m", f"experiment={experiment}", "scale=cpu", "budget=0.05", *narrow, "data.max_files=40",
                     "data.val_batches=1", "logger=none", cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.startswith(f"{experiment}: {runs} jobs to run"), out[:500]
    assert "training FLOPs" in out and "GPU-hours at 40% MFU" in out
    finished = list(tmp_path.glob(f"multirun/{experiment}/*/metrics.json"))
    assert len(finished) == runs
    verdicts = [line for line in out.splitlines() if line.startswith("verdict: ")]
    assert len(verdicts) == runs - 1, out[-3000:]  # all but the baseline
    assert all(line.endswith(verdict.NO_TOKENS_PER_SEC) for line in verdicts), verdicts


@pytest.mark.slow
def test_cfg_job_shows_a_paper_job(tmp_path):
    result = run_cli("--cfg", "job", "experiment=paper_scaling", "size=528m", "residual=block", cwd=tmp_path,
                     timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    job = OmegaConf.create(result.stdout)
    assert (job.model.n_layer, job.model.n_embd, job.model.mlp_hidden, job.residual.num_blocks) == (17, 1258, 6528, 17)
    assert job.trainer.max_steps == math.ceil(119.0e9 / (432 * CONTEXT)) and job.data.block_size == CONTEXT


@pytest.mark.slow  # composes every size's jobs and prints the sweep's start (14 s); the shapes alone stay quick
def test_paper_scaling_sets_a_job_shape_per_size_and_prints_it(jobs):
    """Issue 34: 8 GPUs (one node) for the three small sizes, 16 (two nodes) for the two large, each
    micro-batch dividing the row's batch over the job's GPUs; the cost lines give GPUs and wall hours."""
    found = jobs("paper_scaling", "data=tokens", "data.path=/nonexistent")
    shapes = {}
    for overrides, cfg in found:
        size = next(o.split("=")[1] for o in overrides if o.startswith("size="))
        gpus = cfg.trainer.devices * cfg.trainer.num_nodes
        shapes[size] = (cfg.trainer.devices, cfg.trainer.num_nodes)
        sequences = TABLE_2[size][1]
        assert sequences % (cfg.data.batch_size * gpus) == 0  # whole micro-batches on every GPU
        micro_per_gpu = cfg.trainer.max_steps * sequences // (cfg.data.batch_size * gpus)
        assert micro_per_gpu // cfg.trainer.val_check_interval == 10  # ten validations, counted per GPU
    assert shapes == {"194m": (8, 1), "241m": (8, 1), "296m": (8, 1), "436m": (8, 2), "528m": (8, 2)}
    lines = costs.announce(found)
    assert lines[2].split()[-4:] == ["GPU-hours", "GPUs", "wall", "hours"]
    for line in lines[3:]:
        hours, gpus, wall = (float(x.replace(",", "")) for x in line.split()[-3:])
        assert gpus == (16 if "size=436m" in line or "size=528m" in line else 8)
        assert wall == pytest.approx(hours / gpus, abs=0.06)
    one = jobs("paper_scaling", "data=tokens", "data.path=/nonexistent", "gpus_per_job=1", "size=528m", sweep=False)
    assert (one[0][1].trainer.devices, one[0][1].trainer.num_nodes) == (1, 1)  # one GPU: one job, one device
    with pytest.raises(Exception, match="does not fill whole nodes of 8 GPUs"):
        OmegaConf.to_container(jobs("paper_scaling", "data=tokens", "data.path=/x", "gpus_per_job=12",
                                    sweep=False)[0][1].trainer, resolve=True)
    cpu = jobs("paper_scaling", "scale=cpu")
    assert {(cfg.trainer.devices, cfg.trainer.num_nodes) for _, cfg in cpu} == {(1, 1)}


def test_a_sweep_of_two_job_shapes_goes_to_slurm_as_two_arrays(jobs):
    slurm_resources = pytest.importorskip("attnres.sweep.slurm_resources")
    pytest.importorskip("attnres.sweep.slurm", reason="needs the slurm extra (hydra-submitit-launcher)")
    found = jobs("paper_scaling", "data=tokens", "data.path=/nonexistent", "trainer=gpu")
    partition = slurm_resources.Partition("gpu", cpus=64, mem_mb=512_000, gpus=8, max_time_min=math.inf)
    params = OmegaConf.to_container(OmegaConf.load(CONF / "hydra" / "launcher" / "slurm.yaml"))  # as a user leaves it
    groups = slurm_resources.fit_groups(params, [cfg for _, cfg in found], partition)
    sizes = [sorted({found[i][0][-2] for i in indices}) for indices, _ in groups]
    assert sizes == [["size=194m", "size=241m", "size=296m"], ["size=436m", "size=528m"]]
    assert [(p["tasks_per_node"], p["nodes"], p["gpus_per_node"]) for _, p in groups] == [(8, 1, 8), (8, 2, 8)]
    forced = slurm_resources.fit_groups({**params, "tasks_per_node": 8, "nodes": 2}, [cfg for _, cfg in found][9:],
                                        partition)
    assert len(forced) == 1  # a shape the user sets is one array
