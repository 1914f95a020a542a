"""`attnres-run mode=eval` and `mode=sample`: use a checkpoint without training it.

    attnres-run mode=eval ckpt_path=RUN/checkpoints/last.ckpt [data=... data.path=...]
    attnres-run mode=sample ckpt_path=RUN/checkpoints/last.ckpt sample.prompt='def main' [data=...]
    attnres-run mode=eval ckpt_path=HF_DIR                     (a folder written by attnres-export)

The model and residual strategy are the checkpoint's own: read from `.hydra/config.yaml` of the
run folder that holds it (`RUN/checkpoints/x.ckpt` -> `RUN/.hydra/config.yaml`), else from this
command's config; an exported folder holds its own (read with `attnres.hf`, the hf extra). The
data is this command's, so any checkpoint can be scored on any data that uses its tokenizer
(same vocabulary). `mode=eval` validates once and writes `eval.json` in the
run folder; `mode=sample` writes `samples.txt` there and prints the samples.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from attnres.atomic import read_json, write_json
from attnres.config.errors import ConfigError
from attnres.training.checkpoints import check_checkpoint, load_checkpoint
from attnres.training.devices import resolve_precision
from attnres.training.lit import LitLanguageModel
from attnres.training.report import report

log = logging.getLogger("attnres")
MODES = ("train", "eval", "sample")


def checkpoint_config(ckpt: Path) -> DictConfig | None:
    """The config of the run that wrote `ckpt` (RUN/checkpoints/x.ckpt -> RUN/.hydra/config.yaml)."""
    for folder in (ckpt.parent.parent, ckpt.parent):
        path = folder / ".hydra" / "config.yaml"
        if path.is_file():
            return OmegaConf.load(path)
    return None


def build(cfg: DictConfig) -> tuple[Any, Any, Path]:
    """(datamodule, LitLanguageModel with the checkpoint's weights, checkpoint path)."""
    if not cfg.get("ckpt_path"):
        raise ConfigError(f"mode={cfg.mode} needs a checkpoint: set ckpt_path=<RUN/checkpoints/last.ckpt>")
    ckpt = Path(str(cfg.ckpt_path)).expanduser()
    if ckpt.is_dir() and (ckpt / "config.json").is_file():
        return build_exported(cfg, ckpt)
    if not ckpt.is_file():
        raise ConfigError(f"ckpt_path={ckpt} is not a file; pass the path of a .ckpt written by attnres-run "
                          "(or a folder written by attnres-export)")
    trained = checkpoint_config(ckpt)
    if trained is not None:  # its own shape and strategy; this command's data
        positions = trained_positions(trained)
        with open_dict(cfg):
            cfg.model = trained.model
            if positions is not None:  # as trained: `${data.block_size}` would read this command's data
                cfg.model.block_size = positions
                check_positions(positions, int(cfg.data.block_size), ckpt)
            cfg.residual = trained.residual
            if "num_blocks" in trained:
                cfg.num_blocks = trained.num_blocks
        log.info(f"model and residual strategy from {ckpt.parent.parent / '.hydra' / 'config.yaml'}")
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model, vocab_size=datamodule.vocab_size, residual=instantiate(cfg.residual))
    state = load_checkpoint(ckpt)
    embed = (state.get("state_dict") or {}).get("model.embed.weight") if isinstance(state, dict) else None
    if embed is not None and embed.shape[0] != datamodule.vocab_size:
        raise ConfigError(f"checkpoint {ckpt} has a vocabulary of {embed.shape[0]} tokens but the data has "
                          f"{datamodule.vocab_size}; use data tokenized as it was trained (data=..., data.path=...)")
    module = LitLanguageModel(model, optimizer=instantiate(cfg.optim.optimizer), metric=datamodule.metric,
                              seed=cfg.seed)
    check_checkpoint(str(ckpt), module)
    module.load_state_dict(state["state_dict"])
    return datamodule, module, ckpt


def exported_model(folder: Path) -> Any:
    """The `attnres.Transformer` of a folder written by attnres-export (`attnres.hf`, the hf extra)."""
    config = read_json(folder / "config.json")
    if not config:
        raise ConfigError(f"{folder / 'config.json'} is empty or damaged (not a JSON object); export the run again "
                          "with attnres-export")
    model_type = config.get("model_type")
    if model_type != "attnres":
        kind = f"a {model_type} Hugging Face model" if model_type else "no Hugging Face model type (config.json)"
        raise ConfigError(f"ckpt_path={folder} holds {kind}, not an attnres one; "
                          "pass a folder written by attnres-export, or a .ckpt")
    try:
        from attnres.hf import AttnResForCausalLM
    except ImportError as err:
        raise ConfigError(f"ckpt_path={folder} is a Hugging Face model folder; reading it needs transformers: "
                          "pip install 'attnres[hf]'") from err
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()  # "Loading weights" of a model this size says nothing
    try:
        return AttnResForCausalLM.from_pretrained(str(folder)).transformer
    except Exception as err:  # noqa: BLE001 (safetensors' SafetensorError is neither OSError nor ValueError)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        damaged = "SafetensorError" in type(err).__name__ or "safetensors" in first.lower()
        what = f"{folder / 'model.safetensors'} is damaged ({first})" if damaged else \
            f"ckpt_path={folder} cannot be loaded ({type(err).__name__}: {first})"
        raise ConfigError(f"{what}; export the run again with attnres-export") from err


def trained_positions(trained: DictConfig) -> int | None:
    """The sequence length the model of a run's saved config was built for (`model.block_size`,
    resolved in that config), or None when it does not say."""
    try:
        value = OmegaConf.select(trained, "model.block_size", default=None)
    except OmegaConfBaseException:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_positions(trained: int, asked: int, source: Path) -> None:
    """A checkpoint and an exported folder alike are evaluated on at most the positions they were
    trained on: past them the rotary positions are ones the model never saw."""
    if asked > trained:
        raise ConfigError(f"data.block_size={asked} is longer than the {trained} positions the model in {source} was "
                          f"trained on; evaluate it at data.block_size={trained} or less")


def build_exported(cfg: DictConfig, folder: Path) -> tuple[Any, Any, Path]:
    """`build` for a folder written by attnres-export: its model and weights, this command's data."""
    model = exported_model(folder)
    log.info(f"model, residual strategy and weights from {folder} (attnres-export)")
    check_positions(int(model.block_size), int(cfg.data.block_size), folder)
    datamodule = instantiate(cfg.data)
    if model.vocab_size != datamodule.vocab_size:
        raise ConfigError(f"the model in {folder} has a vocabulary of {model.vocab_size} tokens but the data has "
                          f"{datamodule.vocab_size}; use data tokenized as it was trained (data=..., data.path=...)")
    module = LitLanguageModel(model, optimizer=instantiate(cfg.optim.optimizer), metric=datamodule.metric,
                              seed=cfg.seed)
    return datamodule, module, folder


def run_mode(cfg: DictConfig, run_dir: Path, info: dict[str, Any]) -> dict:
    """mode=eval or mode=sample into `run_dir`; returns what it wrote."""
    if cfg.mode not in MODES:
        raise ConfigError(f"mode={cfg.mode} is not one of {', '.join(MODES)}; set mode=train, mode=eval or mode=sample")
    datamodule, module, ckpt = build(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.mode == "eval":
        return evaluate(cfg, datamodule, module, ckpt, run_dir)
    return sample(cfg, datamodule, module, ckpt, run_dir)


def evaluate(cfg: DictConfig, datamodule: Any, module: Any, ckpt: Path, run_dir: Path) -> dict:
    accelerator = cfg.trainer.get("accelerator", "auto")
    trainer = pl.Trainer(accelerator=accelerator, devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         precision=resolve_precision(cfg.trainer.get("precision", "auto"), accelerator))
    start = time.perf_counter()
    trainer.validate(module, datamodule=datamodule, verbose=False)
    metrics = {k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if k.startswith("val/")}
    windows = len(datamodule.val_dataset())
    out = {"mode": "eval", "checkpoint": str(ckpt), "metrics": metrics,
           "validation_tokens": windows * datamodule.block_size, "data": OmegaConf.to_container(cfg.data),
           "wall_time_s": round(time.perf_counter() - start, 3)}
    write_json(run_dir / "eval.json", out)
    report(f"evaluated {ckpt}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
           + f" on {out['validation_tokens']:,} tokens\n  eval.json    {run_dir / 'eval.json'}")
    return out


def sample(cfg: DictConfig, datamodule: Any, module: Any, ckpt: Path, run_dir: Path) -> dict:

    options = cfg.get("sample") or {}
    prompt = str(options.get("prompt", "\n"))
    new, temperature = int(options.get("max_new_tokens", 200)), float(options.get("temperature", 0.8))
    top_k, count = options.get("top_k", 50), int(options.get("num_samples", 1))
    if not hasattr(datamodule, "encode"):
        raise ConfigError(f"mode=sample needs text data (data=stdlib, text or tokens), not {type(datamodule).__name__}")
    ids = datamodule.encode(prompt)
    if not ids:
        raise ConfigError("sample.prompt encodes to no tokens; give a non-empty prompt, e.g. sample.prompt='def '")
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.trainer.get("accelerator") != "cpu" else "cpu")
    model = module.model.to(device).eval()
    generator = torch.Generator(device=device).manual_seed(int(cfg.seed))
    idx = torch.tensor([ids] * count, dtype=torch.long, device=device)
    start = time.perf_counter()
    out = model.generate(idx, new, temperature=temperature, top_k=None if top_k is None else int(top_k),
                         generator=generator)
    elapsed = time.perf_counter() - start
    texts = [datamodule.decode(row.tolist()) for row in out.cpu()]
    (run_dir / "samples.txt").write_text("\n\n=====\n\n".join(texts) + "\n", encoding="utf-8")
    result = {"mode": "sample", "checkpoint": str(ckpt), "prompt": prompt, "samples": texts,
              "tokens_per_sec": round(count * new / elapsed, 1) if elapsed else None}
    write_json(run_dir / "samples.json", result)
    report("\n\n=====\n\n".join(texts) + f"\n\n{count} sample(s) of {new} tokens at "
           f"{result['tokens_per_sec']} tokens/s (KV cache)\n  samples.txt  {run_dir / 'samples.txt'}")
    return result

