"""Decoding cost of AttnRes against the standard residual, measured in one process.

For standard, Block AttnRes (N blocks, default 4) and Full AttnRes, greedy generation with the
KV cache through `attnres.Transformer.generate()` and, with --hf, through the Hugging Face
`generate()` of `attnres.hf.AttnResForCausalLM` (the same weights): the prefill (the prompt's
forward) and the time per new token, split inside one generate call by a hook on the
Transformer that notes when each forward ends (per new token: the median step of the call).
The strategies run in interleaved rounds (standard, block, full, then rotated), and every
figure is given as a ratio to standard: the median over rounds of the round's own ratio, with
the quartiles (the paired ratio of experiments/BENCHMARKS.md). A third route, "steps", runs the
same decoding with the strategies interleaved token by token (`lockstep`): its ratios pair steps
run milliseconds apart, the figure to read on a busy machine. Queries are random
(trained-looking weights, far from uniform).

Shapes (`--shapes`, comma-separated; `gpu` ones are for experiments/gpu_check.sh):

    small        D 256, 8 layers, batch 1, 64-token prompt, 128 new   (the issue's first row)
    small-b8     the same at batch 8
    small-long   batch 1, 448-token prompt, 64 new
    large        D 512, 12 layers, batch 8, 64-token prompt, 64 new   (the issue's second row)
    large-b1     the same at batch 1
    gpu-b1, gpu-b8   GPT-small (12 x 768), 512-token prompt, 128 new, batch 1 / 8, bf16
    tiny         D 32, 2 layers, batch 2, 8-token prompt, 6 new (experiments/gpu_check.sh --dry)

    python experiments/bench_decode.py                          # CPU shapes, 1 thread, attnres generate
    python experiments/bench_decode.py --hf --shapes small,large   # also the Hugging Face generate()
    python experiments/bench_decode.py --shapes gpu-b1,gpu-b8 --hf # on a GPU
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from anywhere, without installing

import attnres  # noqa: E402
from attnres import Transformer  # noqa: E402
from attnres.functional import KERNELS  # noqa: E402
from attnres.model import KVCache  # noqa: E402

SHAPES = {
    "small": {"n_layer": 8, "n_embd": 256, "n_head": 4, "batch": 1, "prompt": 64, "new": 128},
    "small-b8": {"n_layer": 8, "n_embd": 256, "n_head": 4, "batch": 8, "prompt": 64, "new": 128},
    "small-long": {"n_layer": 8, "n_embd": 256, "n_head": 4, "batch": 1, "prompt": 448, "new": 64},
    "large": {"n_layer": 12, "n_embd": 512, "n_head": 8, "batch": 8, "prompt": 64, "new": 64},
    "large-b1": {"n_layer": 12, "n_embd": 512, "n_head": 8, "batch": 1, "prompt": 64, "new": 64},
    "tiny": {"n_layer": 2, "n_embd": 32, "n_head": 2, "batch": 2, "prompt": 8, "new": 6},  # gpu_check.sh --dry
    "gpu-b1": {"n_layer": 12, "n_embd": 768, "n_head": 12, "batch": 1, "prompt": 512, "new": 128},
    "gpu-b8": {"n_layer": 12, "n_embd": 768, "n_head": 12, "batch": 8, "prompt": 512, "new": 128},
}
CPU_SHAPES = "small,small-b8,small-long,large,large-b1"
VOCAB = 256  # byte-level, as the runner's default data: the head is not what is measured


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated, from {', '.join(SHAPES)} (default CPU: {CPU_SHAPES}; CUDA: gpu-b1,gpu-b8)")
    p.add_argument("--strategies", default="standard,block,full",
                   help=f"comma-separated, from {', '.join(STRATEGIES)}; standard first (the ratios' base)")
    p.add_argument("--num-blocks", type=int, default=4, help="Block AttnRes N (default 4)")
    p.add_argument("--kernel", default="auto", choices=KERNELS, help="depth-attention implementation (default auto)")
    p.add_argument("--rounds", type=int, default=5,
                   help="timed generate calls per strategy and route, and passes of the interleaved steps (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (default 1)")
    p.add_argument("--hf", action="store_true", help="also through the Hugging Face generate() (needs transformers)")
    p.add_argument("--steps-only", action="store_true",
                   help="only the interleaved steps (no generate() calls): the tightest ratios, in less time")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1 on CPU)")
    p.add_argument("--device", default=None, help="default cuda when available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every figure here")
    args = p.parse_args(argv)

    def refuse(message: str) -> None:  # one line, exit 2, before any model is built
        p.exit(2, f"bench_decode.py: {message}\n")

    args.device = _device(args.device, refuse)
    cuda = args.device.type == "cuda"
    args.shapes = [s.strip() for s in (args.shapes or ("gpu-b1,gpu-b8" if cuda else CPU_SHAPES)).split(",")]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        refuse(f"unknown shape {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not args.strategies or not set(args.strategies) <= set(STRATEGIES):
        refuse(f"--strategies takes {', '.join(STRATEGIES)}, got {args.strategies}")
    if "block" in args.strategies:
        for name in args.shapes:
            sublayers = 2 * SHAPES[name]["n_layer"]
            if args.num_blocks < 1 or sublayers % args.num_blocks:
                valid = ", ".join(str(n) for n in range(1, sublayers + 1) if sublayers % n == 0)
                refuse(f"--num-blocks {args.num_blocks} must divide shape {name}'s {sublayers} sublayers; "
                       f"valid values: {valid}")
    if args.rounds < 1:
        refuse(f"--rounds takes 1 or more (timed calls per strategy), got {args.rounds}")
    if args.warmup < 0:
        refuse(f"--warmup takes 0 or more, got {args.warmup}")
    if args.threads is not None and args.threads < 1:
        refuse(f"--threads takes 1 or more (leave it out for 1 on CPU, torch's default on CUDA), got {args.threads}")
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    if args.threads is None and not cuda:
        args.threads = 1
    return args


def _device(name: str | None, refuse) -> torch.device:
    """--device as a torch device: cpu or cuda[:N], the CUDA one only where there is one."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        refuse(f"--device takes cpu or cuda (cuda:N for one GPU), got {name!r}")
    if device.type not in ("cpu", "cuda"):
        refuse(f"--device takes cpu or cuda (cuda:N for one GPU), got {name!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            refuse(f"--device {name}: this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
        if (device.index or 0) >= count:
            refuse(f"--device {name}: there are {count} CUDA devices (cuda:0 to cuda:{count - 1})")
    return device


#: every strategy of conf/residual/ (by its YAML's name): its class and the options this script sets
STRATEGIES = {"standard": "StandardResidual", "block": "BlockAttentionResidual", "full": "FullAttentionResidual",
              "denseformer": "DenseFormerResidual", "hc": "HyperConnectionResidual",
              "mhc": "ManifoldHyperConnectionResidual", "kimi": "BlockAttentionResidual"}


def strategy_options(name: str, args: argparse.Namespace) -> dict:
    if name == "block":
        return {"num_blocks": args.num_blocks, "kernel": args.kernel}
    if name == "kimi":  # K3's layout (conf/residual/kimi.yaml), one decoder layer a block (these models are shallow)
        return {"block_size_layers": 1, "eps": 1e-5, "query_init_std": 0.02, "kernel": args.kernel}
    return {"kernel": args.kernel} if name == "full" else {}


def strategy(name: str, args: argparse.Namespace):
    return functools.partial(getattr(attnres, STRATEGIES[name]), **strategy_options(name, args))


def build(name: str, shape: dict, args: argparse.Namespace) -> Transformer:
    torch.manual_seed(0)  # the same weights for every strategy
    model = Transformer(vocab_size=VOCAB, n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"],
                        block_size=shape["prompt"] + shape["new"], residual=strategy(name, args))
    if getattr(model.residual, "pseudo_query", None) is not None:  # trained-looking queries
        with torch.no_grad():
            model.residual.pseudo_query.normal_(0.0, 1.0 / shape["n_embd"] ** 0.5)
    return model.to(device=args.device, dtype=args.dtype).eval()


def hf_model(name: str, model: Transformer, shape: dict, args: argparse.Namespace):
    from attnres.hf import AttnResConfig, AttnResForCausalLM

    residual = {"_target_": f"attnres.{STRATEGIES[name]}", **strategy_options(name, args)}
    config = AttnResConfig(transformer={"vocab_size": VOCAB, "n_layer": shape["n_layer"], "n_head": shape["n_head"],
                                        "n_embd": shape["n_embd"], "block_size": shape["prompt"] + shape["new"]},
                           residual=residual)
    hf = AttnResForCausalLM(config)
    hf.transformer.load_state_dict(model.state_dict())
    return hf.to(device=args.device, dtype=args.dtype).eval()


class ForwardClock:
    """When each forward of `model` ends (a forward hook), to split one generate call into its
    prefill (the first forward) and its decoding steps (the rest)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.ends: list[float] = []
        self.cuda = device.type == "cuda"
        model.register_forward_hook(self._hook)

    def _hook(self, *_):
        if self.cuda:
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())

    def run(self, fn) -> tuple[float, float]:
        """(prefill seconds, seconds per new token) of one call of `fn`: the median of its
        decoding steps (what a step costs, robust to another process's burst), each step being
        the time from one forward's end to the next's (the token picked, then its forward)."""
        self.ends.clear()
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        steps = [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]
        return self.ends[0] - start, statistics.median(steps) if steps else 0.0


def generators(model: Transformer, name: str, prompt: torch.Tensor, shape: dict,
               args: argparse.Namespace) -> dict[str, tuple]:
    """{"attnres": (clock, fn), "hf": (clock, fn)}: one greedy generate call each."""
    out = {"attnres": (ForwardClock(model, args.device),
                       lambda: model.generate(prompt, shape["new"], temperature=0))}
    if args.hf:
        hf = hf_model(name, model, shape, args)
        kw = {"max_new_tokens": shape["new"], "min_new_tokens": shape["new"], "do_sample": False,
              "pad_token_id": 0, "attention_mask": torch.ones_like(prompt)}
        out["hf"] = (ForwardClock(hf.transformer, args.device), lambda: hf.generate(prompt, **kw))
    return out


def rotated(names: list[str], i: int) -> list[str]:
    return names[i % len(names):] + names[: i % len(names)]


def lockstep(models: dict[str, Transformer], prompt: torch.Tensor, shape: dict, args: argparse.Namespace) -> dict:
    """The "steps" route: greedy KV-cached decoding of every strategy advanced one token at a
    time, the strategies interleaved step by step (rotated), so that the steps a ratio pairs ran
    milliseconds apart: what a busy machine does to one it does to the other. The steps are
    `Transformer.forward(token, kv_cache=...)`, what generate() runs, without its bookkeeping."""
    names = list(models)
    out = {n: {"prefill_s": [], "token_s": []} for n in names}
    sync = torch.cuda.synchronize if args.device.type == "cuda" else (lambda: None)
    for r in range(4 * args.rounds):  # the prompt's forward alone, interleaved, more often (one per pass below)
        for n in rotated(names, r):
            sync()
            t = time.perf_counter()
            models[n](prompt, kv_cache=KVCache(models[n].block_size))
            sync()
            out[n]["prefill_s"].append(time.perf_counter() - t)
    for r in range(args.rounds):
        caches = {n: KVCache(models[n].block_size) for n in names}
        tokens = {}
        for step in range(shape["new"]):
            for n in rotated(names, r + step):
                idx = prompt if step == 0 else tokens[n]
                sync()
                t = time.perf_counter()
                logits = models[n](idx, kv_cache=caches[n])["logits"][:, -1]
                sync()
                if step:
                    out[n]["token_s"].append(time.perf_counter() - t)
                tokens[n] = logits.argmax(dim=-1, keepdim=True)
    return out


def paired(samples: list[float], base: list[float]) -> list[float]:
    """The median of the per-round ratios, and its quartiles."""
    ratios = sorted(s / b for s, b in zip(samples, base, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return [statistics.median(ratios), q[0], q[2]]


def bench_shape(shape_name: str, args: argparse.Namespace) -> dict:
    shape = SHAPES[shape_name]
    prompt = torch.randint(0, VOCAB, (shape["batch"], shape["prompt"]), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(args.device)
    models = {name: build(name, shape, args) for name in args.strategies}
    cases = {name: {} if args.steps_only else generators(models[name], name, prompt, shape, args) for name in models}
    routes = list(next(iter(cases.values())))
    samples = {(n, r): {"prefill_s": [], "token_s": []} for n in cases for r in routes}
    with torch.no_grad():
        for name in cases:
            for route in routes:
                for _ in range(args.warmup):
                    cases[name][route][1]()
        for i in range(args.rounds):
            for name in rotated(list(cases), i):
                for route in routes:
                    clock, fn = cases[name][route]
                    prefill, token = clock.run(fn)
                    samples[(name, route)]["prefill_s"].append(prefill)
                    samples[(name, route)]["token_s"].append(token)
        for name, s in lockstep(models, prompt, shape, args).items():
            samples[(name, "steps")] = s
    result = {"shape": shape, "routes": {}}
    for route in [*routes, "steps"]:
        base = samples[("standard", route)] if "standard" in cases else None
        rows = {}
        for name in cases:
            s = samples[(name, route)]
            rows[name] = {k: statistics.median(v) for k, v in s.items()} | {"samples": s}
            if base is not None:
                rows[name]["vs_standard"] = {k: paired(s[k], base[k]) for k in ("prefill_s", "token_s")}
        result["routes"][route] = rows
    return result


def report(results: dict) -> None:
    for shape_name, res in results["shapes"].items():
        s = res["shape"]
        print(f"\n{shape_name}: D {s['n_embd']}, {s['n_layer']} layers, batch {s['batch']}, "
              f"{s['prompt']}-token prompt, {s['new']} new")
        for route, rows in res["routes"].items():
            title = "steps, interleaved" if route == "steps" else route + " generate()"
            print(f"  {title:22s} {'per new token':>30s} {'prefill':>30s}")
            for name, row in rows.items():
                cells = []
                for key in ("token_s", "prefill_s"):
                    ms = 1e3 * row[key]
                    r = row.get("vs_standard", {}).get(key)
                    cells.append(f"{ms:8.3f} ms" + (f"  {r[0]:.3f}x ({r[1]:.3f}-{r[2]:.3f})" if r else ""))
                print(f"  {name:22s} {cells[0]:>30s} {cells[1]:>30s}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"info": {"device": str(args.device), "dtype": str(args.dtype).replace("torch.", ""),
                        "threads": torch.get_num_threads(), "torch": torch.__version__, "kernel": args.kernel,
                        "num_blocks": args.num_blocks, "rounds": args.rounds,
                        "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}, "shapes": {}}
    for shape_name in args.shapes:
        results["shapes"][shape_name] = bench_shape(shape_name, args)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.json.with_suffix(".tmp")
            tmp.write_text(json.dumps(results, indent=1))
            tmp.replace(args.json)
    report(results)
    return results


if __name__ == "__main__":
    main()
