"""Benchmark of the token data path: attnres-prepare throughput, and the loader against the model.

    python experiments/bench_data.py                         # stdlib corpus, 1 and 2 workers
    python experiments/bench_data.py --max-files 300 --json out.json

1. `attnres-prepare` on the stdlib corpus with a 1,024-token BPE: the tokenizer is trained once,
   then the corpus is encoded with that tokenizer.json by 1 and by 2 worker processes; MB/s is
   source bytes over encoding time (training the tokenizer is reported apart).
2. The `data=tokens` train loader at a GPU-sized micro-batch (batch x block_size tokens, default
   16 x 1024, gpt-small's) in batches/s, against the model's optimiser steps/s at the same batch:
   the tiny model on this CPU, and gpt-small on a GPU when there is one. The loader must be faster
   than the step it feeds (ratio > 1) with `num_workers=0`; DataLoader workers multiply it.
No assertions: numbers to read (tests/data/test_tokens.py and test_prepare.py hold the checks).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from attnres.atomic import write_json
from attnres.data.prepare import prepare
from attnres.data.tokens import TokensDataModule
from attnres.model import Transformer


def bench_prepare(workdir: Path, max_files: int | None, vocab: int) -> dict:
    t0 = time.perf_counter()
    first = prepare("stdlib", str(workdir / "trained"), vocab_size=vocab, workers=2, max_files=max_files,
                    progress=False)
    out = {"source_mb": first["source"]["bytes_read"] / 1e6, "train_tokenizer_s": first["timing"]["tokenizer_s"],
           "tokens": first["train_tokens"] + first["val_tokens"], "first_run_s": round(time.perf_counter() - t0, 1)}
    for workers in (1, 2):
        meta = prepare("stdlib", str(workdir / f"w{workers}"), tokenizer=str(workdir / "trained" / "tokenizer.json"),
                       workers=workers, max_files=max_files, progress=False)
        t = meta["timing"]
        out[f"workers_{workers}"] = {"encode_s": t["encode_s"], "mb_per_s": t["mb_per_s"],
                                     "tokens_per_s": round(out["tokens"] / t["encode_s"])}
        print(f"prepare, {workers} worker(s): {t['mb_per_s']:.2f} MB/s, {out['tokens'] / t['encode_s']:,.0f} tokens/s "
              f"({out['source_mb']:.1f} MB in {t['encode_s']:.1f} s)", flush=True)
    return out


def loader_rate(path: Path, batch: int, block: int, batches: int, workers: int) -> float:
    dm = TokensDataModule(path=str(path), block_size=block, batch_size=batch, num_workers=workers,
                          cache_dir=str(path / ".cache"))
    it = iter(dm.train_dataloader())
    next(it)  # worker start-up and first memmap are not the steady state
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches / (time.perf_counter() - t0)


def step_rate(model: Transformer, batch: int, block: int, steps: int, device: str) -> float:
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, model.vocab_size, (batch, block), device=device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def step() -> None:
        with torch.autocast(device_type=device, dtype=dtype, enabled=device == "cuda"):
            loss = model(idx, idx)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return steps / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-files", type=int, default=None, help="first N stdlib files (default: all)")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--skip-prepare", metavar="DIR", help="use this prepared folder, do not time prepare")
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args()
    result: dict = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.skip_prepare:
            data = Path(args.skip_prepare)
        else:
            result["prepare"] = bench_prepare(work, args.max_files, args.vocab_size)
            data = work / "w2"
        shape = f"{args.batch} x {args.block}"
        for workers in (0, 2):
            rate = loader_rate(data, args.batch, args.block, 200, workers)
            result[f"loader_batches_per_s_workers_{workers}"] = round(rate, 1)
            print(f"loader ({shape} tokens, num_workers={workers}): {rate:,.0f} batches/s", flush=True)
        torch.manual_seed(0)
        tiny = Transformer(vocab_size=args.vocab_size, n_layer=8, n_head=4, n_embd=96, block_size=args.block)
        cpu = step_rate(tiny, args.batch, args.block, 3, "cpu")
        result["tiny_cpu_steps_per_s"] = round(cpu, 3)
        print(f"tiny model step on CPU ({shape}): {cpu:.3f} steps/s; loader / step = "
              f"{result['loader_batches_per_s_workers_0'] / cpu:,.0f}x", flush=True)
        if torch.cuda.is_available():
            small = Transformer(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, block_size=args.block)
            gpu = step_rate(small, args.batch, args.block, 20, "cuda")
            result["gpt_small_gpu_steps_per_s"] = round(gpu, 2)
            result["gpu"] = torch.cuda.get_device_name()
            print(f"gpt-small step on {result['gpu']} ({shape}, bf16 autocast, eager): {gpu:.2f} steps/s; "
                  f"loader / step = {result['loader_batches_per_s_workers_0'] / gpu:,.1f}x", flush=True)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
