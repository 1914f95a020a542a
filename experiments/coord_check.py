"""The coordinate check of the muP authors (Tensor Programs V, section 7 and appendix D.1), for
every residual strategy: train a few AdamW steps at each width (or depth) and watch the size of
each quantity per coordinate. Under a parametrization whose hyperparameters transfer, the curves
are flat in the width (or depth); where they grow, the best learning rate moves with the size.

    python experiments/coord_check.py                                  # width 64 .. 1,024 at 4 layers
    python experiments/coord_check.py --axis depth                     # depth 4 .. 32 layers at width 128
    python experiments/coord_check.py --strategies standard,block --sizes 64,128,256 --steps 3

Quantities, each the RMS over the coordinates, averaged over tokens, on one fixed batch after
step t (t = 0 is the initial model): `sublayer input` and `sublayer output` (the mean over
sublayers; the JSON keeps each sublayer's), `logits`, and `depth-attention logits` (the RMS of
each row's logits centred over its sources, log(weights) minus their mean: exactly the part of
the logits the softmax sees; strategies without a softmax over depth have none: standard,
DenseFormer, HC, mHC). The base of "mup"
is the smallest size, where it computes what "standard" does. Writes coord_check_<axis>.png (one
panel per quantity, a row per strategy and parametrization, a line per step) and .json under
--out, and prints each quantity's slope: log2 RMS after the last step against log2 size.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from functools import partial
from pathlib import Path

import torch

from attnres import Transformer
from attnres.atomic import atomic_write, finite_json
from attnres.residual import BlockAttentionResidual, FullAttentionResidual, HyperConnectionResidual, StandardResidual
from attnres.residual.denseformer import DenseFormerResidual
from attnres.residual.mhc import ManifoldHyperConnectionResidual
from attnres.training.lit import parameter_groups

STRATEGIES = {
    "standard": StandardResidual,
    "block": partial(BlockAttentionResidual, num_blocks=4),
    "full": FullAttentionResidual,
    "denseformer": DenseFormerResidual,
    "hc": HyperConnectionResidual,
    "mhc": ManifoldHyperConnectionResidual,
}
QUANTITIES = ("sublayer input", "sublayer output", "logits", "depth-attention logits")
AXES = {"width": ((64, 128, 256, 512, 1024), 4), "depth": ((4, 8, 16, 32), 128)}
VOCAB, HEADS, SEQ, BATCH = 256, 4, 64, 8  # a fixed head count: the head size grows with the width


def measure(strategy: str, parametrization: str, width: int, n_layer: int, base_width: int, base_depth: int,
            steps: int = 5, lr: float = 1e-2, seed: int = 0) -> dict[str, list]:
    """Each quantity after steps 0 .. `steps` of AdamW at `lr` on one fixed batch of random tokens."""
    torch.manual_seed(seed)
    mup = parametrization == "mup"
    model = Transformer(vocab_size=VOCAB, n_layer=n_layer, n_head=HEADS, n_embd=width, block_size=SEQ,
                        residual=STRATEGIES[strategy], parametrization=parametrization,
                        base_width=base_width if mup else None, base_depth=base_depth if mup else None)
    batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed + 1))
    groups = parameter_groups(model, query_lr_scale=0.1, lr_scales=model.lr_scales())
    for group in groups:
        group["lr"] = lr * group["lr_scale"]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    out: dict[str, list] = {q: [] for q in QUANTITIES} | {"per sublayer input": [], "per sublayer output": []}
    for step in range(steps + 1):
        model.residual.record_next()
        with torch.no_grad():
            logits = model(batch[:, :-1])["logits"]
        record = model.residual.recorded
        inputs = [float(x) for x in record.input_rms]
        outputs = [float(x) for x in record.output_rms]
        out["per sublayer input"].append(inputs)
        out["per sublayer output"].append(outputs)
        out["sublayer input"].append(sum(inputs) / len(inputs))
        out["sublayer output"].append(sum(outputs) / len(outputs))
        out["logits"].append(float(logits.float().pow(2).mean().sqrt()))
        softmax = getattr(model.residual, "source_knockouts", False)  # its weights are a softmax over sources
        out["depth-attention logits"].append(_depth_logit_rms(record.weights) if softmax and record.weights else None)
        if step == steps:
            break
        loss = model(batch[:, :-1], targets=batch[:, 1:])["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return out


def _depth_logit_rms(weights: dict) -> float | None:
    """The RMS of each row's centred logits (log weights minus their mean over the sources),
    over rows with at least two sources and all tokens."""
    values = []
    for w in weights.values():  # (S, B, T)
        if w.shape[0] < 2:
            continue
        logw = w.float().clamp_min(1e-30).log()
        values.append((logw - logw.mean(dim=0, keepdim=True)).pow(2).mean())
    return float(torch.stack(values).mean().sqrt()) if values else None


def slope(sizes: list[int], values: list[float | None]) -> float | None:
    """The least-squares slope of log2 value against log2 size (None where a value is missing)."""
    if any(v is None or not v > 0 for v in values):
        return None
    xs, ys = [math.log2(s) for s in sizes], [math.log2(v) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def run(axis: str, sizes: list[int], fixed: int, strategies: list[str], parametrizations: list[str], steps: int,
        lr: float, seed: int = 0, progress=print) -> dict:
    """{strategy: {parametrization: {"sizes": [...], "by_size": {size: measure(...)}, "slopes": {...}}}}."""
    results: dict = {}
    base = min(sizes)
    for strategy in strategies:
        for parametrization in parametrizations:
            by_size = {}
            for size in sizes:
                width, depth = (size, fixed) if axis == "width" else (fixed, size)
                start = time.perf_counter()
                by_size[size] = measure(strategy, parametrization, width, depth,
                                        base_width=base if axis == "width" else width,
                                        base_depth=base if axis == "depth" else depth, steps=steps, lr=lr, seed=seed)
                progress(f"coord_check: {strategy} {parametrization} {axis} {size}: "
                         f"{time.perf_counter() - start:.1f} s")
            slopes = {q: slope(sizes, [by_size[s][q][-1] for s in sizes]) for q in QUANTITIES}
            results.setdefault(strategy, {})[parametrization] = {"sizes": sizes, "by_size": by_size, "slopes": slopes}
    return results


def plot(results: dict, axis: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    rows = [(s, p) for s in results for p in results[s]]
    fig, axes = plt.subplots(len(rows), len(QUANTITIES), figsize=(3.4 * len(QUANTITIES), 2.6 * len(rows)),
                             squeeze=False)
    for r, (strategy, _) in enumerate(rows):  # a strategy's parametrizations on one scale: flat against growing
        first = rows.index(next(row for row in rows if row[0] == strategy))
        if first != r:
            for c in range(len(QUANTITIES)):
                axes[r][c].sharey(axes[first][c])
    for r, (strategy, parametrization) in enumerate(rows):
        entry = results[strategy][parametrization]
        sizes = entry["sizes"]
        steps = len(entry["by_size"][sizes[0]]["logits"])
        cmap = plt.get_cmap("viridis")
        for c, quantity in enumerate(QUANTITIES):
            ax = axes[r][c]
            for t in range(steps):
                ys = [entry["by_size"][s][quantity][t] for s in sizes]
                if any(y is None or y < 1e-6 for y in ys):  # depth-attention logits at step 0: zero queries, 0
                    continue
                ax.plot(sizes, ys, marker="o", ms=3, color=cmap(t / max(1, steps - 1)), label=f"step {t}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_minor_formatter(NullFormatter())
            s = entry["slopes"][quantity]
            ax.set_title(f"{strategy}, {parametrization}: {quantity}" + ("" if s is None else f"\nslope {s:+.2f}"),
                         fontsize=8)
            ax.set_xlabel(axis if axis == "width" else "layers", fontsize=8)
            ax.tick_params(labelsize=7)
            if r == 0 and c == 0:
                ax.legend(fontsize=6)
            if not ax.lines:
                ax.text(0.5, 0.5, "no softmax over depth", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    fig.suptitle(f"coordinate check across {axis}: RMS per coordinate after each AdamW step "
                 "(flat = transfers; slope = log2 RMS / log2 size after the last step)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / (2.6 * len(rows))))
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--axis", choices=sorted(AXES), default="width")
    parser.add_argument("--sizes", default=None, help="comma-separated widths or depths (default: the axis's)")
    parser.add_argument("--fixed", type=int, default=None, help="the other axis's value (default: 4 layers, width 128)")
    parser.add_argument("--strategies", default="standard,block,full,denseformer,hc,mhc")
    parser.add_argument("--parametrizations", default="standard,mup")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "coord_check")
    parser.add_argument("--replot", action="store_true", help="redraw the figure and the slopes from --out's JSON")
    args = parser.parse_args(argv)
    if args.replot:
        return replot(args.out, args.axis)
    try:
        sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(AXES[args.axis][0])
    except ValueError:
        print(f"coord_check.py: --sizes takes comma-separated integers, got {args.sizes!r}", file=sys.stderr)
        return 2
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        print(f"coord_check.py: unknown strategy {', '.join(unknown) or '(none)'}; choose from "
              f"{', '.join(STRATEGIES)}", file=sys.stderr)
        return 2
    parametrizations = [p for p in args.parametrizations.split(",") if p]
    if not parametrizations or any(p not in ("standard", "mup") for p in parametrizations):
        print(f"coord_check.py: --parametrizations takes standard and/or mup, got {args.parametrizations!r}",
              file=sys.stderr)
        return 2
    mistake = None
    if len(sizes) < 2:
        mistake = f"--sizes needs at least two sizes (a slope is fitted across them), got {args.sizes}"
    elif min(sizes) < 1:
        mistake = f"--sizes takes positive {args.axis}s, got {min(sizes)}"
    elif args.steps < 1:
        mistake = f"--steps takes 1 or more (Adam steps before the activations are read), got {args.steps}"
    elif not (math.isfinite(args.lr) and args.lr > 0):
        mistake = f"--lr takes a positive learning rate, got {args.lr:g}"
    elif args.fixed is not None and args.fixed < 1:
        mistake = f"--fixed takes a positive {'depth' if args.axis == 'width' else 'width'}, got {args.fixed}"
    if mistake:
        print(f"coord_check.py: {mistake}", file=sys.stderr)
        return 2
    if args.axis == "width" and any(s % (2 * HEADS) for s in sizes):
        print(f"coord_check.py: widths must be multiples of {2 * HEADS} ({HEADS} heads of even size)",
              file=sys.stderr)
        return 2
    fixed = args.fixed or AXES[args.axis][1]
    results = run(args.axis, sorted(sizes), fixed, strategies, parametrizations, args.steps, args.lr, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    png, data = args.out / f"coord_check_{args.axis}.png", args.out / f"coord_check_{args.axis}.json"
    text = json.dumps(finite_json(_rounded({"axis": args.axis, "fixed": fixed, "steps": args.steps, "lr": args.lr,
                                            "results": results})), separators=(",", ":"))  # a value per sublayer
    atomic_write(data, lambda f: f.write(text.encode()))
    plot(results, args.axis, png)
    report(results, args.axis, args.steps)
    print(f"wrote {png} and {data}")
    return 0


def _rounded(value):
    """6 significant digits: the check's noise is far above them."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def replot(out: Path, axis: str) -> int:
    data = out / f"coord_check_{axis}.json"
    try:
        saved = json.loads(data.read_text())
    except (OSError, ValueError) as err:
        print(f"coord_check.py: cannot read {data} ({err}); run the check first", file=sys.stderr)
        return 2
    results = {s: {p: saved["results"][s][p] for p in ("standard", "mup") if p in saved["results"][s]}
               for s in STRATEGIES if s in saved["results"]}  # the JSON's keys are sorted
    for by_param in results.values():
        for entry in by_param.values():
            entry["by_size"] = {int(size): value for size, value in entry["by_size"].items()}
    plot(results, axis, out / f"coord_check_{axis}.png")
    report(results, axis, saved["steps"])
    return 0


def report(results: dict, axis: str, steps: int) -> None:
    print(f"slope of log2 RMS against log2 {axis} after step {steps} (0 = flat):")
    print(f"  {'strategy':<12} {'parametrization':<16}" + "".join(f"{q:>24}" for q in QUANTITIES))
    for strategy, by_param in results.items():
        for parametrization, entry in by_param.items():
            cells = "".join(f"{'-' if v is None else f'{v:+.2f}':>24}" for v in map(entry["slopes"].get, QUANTITIES))
            print(f"  {strategy:<12} {parametrization:<16}{cells}")


if __name__ == "__main__":
    sys.exit(main())
