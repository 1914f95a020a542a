"""What each residual strategy in conf/residual/ costs over the standard residual.

For every `conf/residual/*.yaml` (globbed, so strategies added later appear too), composed
with the project's own Hydra config (`residual=<name> model=<shape> num_blocks=<N>`), prints

- extra parameters: the strategy's own parameters, for `model=tiny` and `model=gpt-small`
  (the Transformer builds the strategy last and shares everything else, so this is the
  difference in the model's parameter count);
- activation memory per token of the residual machinery, measured: the bytes autograd saves
  for the backward of one training forward (`torch.autograd.graph.saved_tensors_hooks`; each
  storage counted once, parameters left out) minus standard's, divided by the tokens of the
  batch; also in units of D float32 values per token and per sublayer;
- the memory formula each strategy's module docstring states ("Memory ..."), where it has one.

    python experiments/strategy_costs.py                     # both shapes, CPU, a few seconds
    python experiments/strategy_costs.py --models tiny --tokens 128
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from attnres import Transformer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/: bench_residuals
from bench_residuals import saved_forward_bytes  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"
VOCAB = 256  # the embedding and head are the same for every strategy, so their size does not matter


def strategy_names() -> list[str]:
    names = sorted(p.stem for p in (CONF / "residual").glob("*.yaml"))
    return ["standard", *(n for n in names if n != "standard")]


def compose_config(residual: str, model: str, num_blocks: int):
    overrides = [f"residual={residual}", f"model={model}", f"num_blocks={num_blocks}"]
    return compose(config_name="config", overrides=overrides)


def saved_bytes(model: Transformer, idx: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in one training forward."""
    return saved_forward_bytes(model, lambda: model(idx, targets=idx)["loss"])


def memory_formula(strategy: torch.nn.Module) -> str:
    """The "Memory ..." sentence of the strategy's module docstring, or '-'."""
    doc = " ".join((inspect.getmodule(type(strategy)).__doc__ or "").split())
    found = re.search(r"Memory.*?\.(?=\s|$)", doc)  # up to the first full stop that ends a sentence
    return found.group(0) if found else "-"


def print_table(table: list[list[str]]) -> None:
    """A Markdown table: first column left-aligned, numbers right-aligned."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for r, row in enumerate(table):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        print("| " + " | ".join(cells) + " |")
        if r == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--models", nargs="+", default=["tiny", "gpt-small"],
                        help="conf/model/ shapes (default: %(default)s)")
    parser.add_argument("--num-blocks", type=int, default=8, help="top-level num_blocks (Block AttnRes N; default 8)")
    parser.add_argument("--batch", type=int, default=2, help="batch of the memory measurement (default 2)")
    parser.add_argument("--tokens", type=int, default=64, help="sequence length of the memory measurement (default 64)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = strategy_names()
    rows: dict[str, dict[str, tuple[int, float, float, float]]] = {n: {} for n in names}
    formulas: dict[str, str] = {}
    failures: list[str] = []
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for model_name in args.models:
            base = compose_config("standard", model_name, args.num_blocks).model
            shape = {k: v for k, v in OmegaConf.to_container(base).items() if k not in ("_target_", "block_size")}
            torch.manual_seed(0)
            model = Transformer(VOCAB, **{**shape, "block_size": args.tokens})
            L, D = 2 * model.n_layer, shape["n_embd"]
            idx = torch.randint(0, VOCAB, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
            tokens = args.batch * args.tokens
            baseline = saved_bytes(model, idx)
            for name in names:
                try:
                    factory = instantiate(compose_config(name, model_name, args.num_blocks).residual)
                    model.residual = factory(d_model=D, num_layers=L)
                    extra = saved_bytes(model, idx) - baseline
                except Exception as error:  # a strategy that does not fit this shape: say so, go on
                    failures.append(f"{name} at model={model_name}: {type(error).__name__}: {error}")
                    continue
                per_token = extra / tokens
                params = sum(p.numel() for p in model.residual.parameters())
                rows[name][model_name] = (params, per_token, per_token / (4 * D), per_token / (4 * D * L))
                formulas.setdefault(name, memory_formula(model.residual))
    print(f"Extra cost over the standard residual. Memory: activations saved for the backward of one training "
          f"forward,\nbatch {args.batch} x {args.tokens} tokens, float32, CPU; D = n_embd, L = 2 * n_layer sublayers.")
    header = ["strategy", "extra params", "bytes / token", "x D", "x D / sublayer"]
    for m in args.models:
        table = [header]
        for name in names:
            if m in rows[name]:
                params, per_token, in_d, per_sub = rows[name][m]
                table.append([name, f"{params:,}", f"{per_token:,.0f}", f"{in_d:.1f}", f"{per_sub:.2f}"])
            else:
                table.append([name, *["failed"] * 4])
        print(f"\nmodel={m}")
        print_table(table)
    print("\nMemory per token, as each strategy's docstring states it:")
    for name in names:
        print(f"  {name}: {formulas.get(name, '-')}")
    for failure in failures:
        print(f"could not measure {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
