"""The knock-out a probe pass runs (`attnres.probes`): which sources leave which rows' softmax
(`Knockout`), and `knockout(residual, plan)`, which arms it on a residual strategy for one pass.
While it is armed, the strategy's `call_sublayer` and `mix` hand over to it and the fast path is off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnres.labels import sublayer_label
from attnres.ops.dispatch import promoted

MODES = ("remove", "mean")  # how a knocked-out source leaves a row (`attnres.probes`)


# == the knock-out a pass runs ========================================================================
def _scatter(weights: Tensor, rows: Sequence[int], size: int) -> Tensor:
    """(len(rows), ...) weights as (size, ...), zero outside `rows`."""
    full = weights.new_zeros((size, *weights.shape[1:]))
    full[list(rows)] = weights
    return full


class Knockout:
    """What one pass takes out, consulted by the strategy's `call_sublayer` and `mix` hooks.

    copies: K, how many copies of the batch the pass stacks (dim 0). row, columns: source
    knock-outs of sublayer `row` (L = the output aggregation): copy k knocks out source
    `columns[k]` (a heatmap column) by `mode`, with `means[row][column]` (D,) for "mean".
    layer: the sublayer whose output is removed (module docstring). prefix: outputs of the
    first len(prefix) sublayers from the intact pass, each (B, T, D): reused instead of
    recomputed, repeated K times. outputs: a list each computed sublayer output is appended to
    (the intact pass fills the next passes' prefix). collect: a dict filled with each row's
    per-source sums over tokens, row -> column -> [(D,) float64 sum, tokens] (for "mean").
    """

    def __init__(
        self,
        copies: int = 1,
        row: int | None = None,
        columns: Sequence[int] = (),
        mode: str = "remove",
        means: dict[int, dict[int, Tensor]] | None = None,
        layer: int | None = None,
        prefix: Sequence[Tensor] | None = None,
        outputs: list[Tensor] | None = None,
        collect: dict[int, list] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        if row is not None and len(columns) != copies:
            raise ValueError(f"a source knock-out needs one column per copy: {len(columns)} columns, {copies} copies")
        self.copies, self.row, self.columns, self.mode, self.means = copies, row, tuple(columns), mode, means
        self.layer, self.prefix, self.outputs, self.collect = layer, prefix, outputs, collect
        self.removed: list[Tensor] = []  # the zero tensors that stand for removed outputs

    def call_sublayer(self, index: int, sublayer: Any, x: Tensor, sublayer_kwargs: dict[str, Any]) -> Tensor:
        if self.prefix is not None and index < len(self.prefix):
            out = self.prefix[index]  # (B, T, D): the intact pass computed it; nothing before `row` changed
            return out.repeat(self.copies, *(1,) * (out.dim() - 1)) if self.copies > 1 else out
        if index == self.layer:
            zero = torch.zeros_like(x)  # sublayers map (B, T, D) to (B, T, D)
            self.removed.append(zero)  # `mix` drops exactly this object wherever it turns up
            return zero
        out = sublayer(x, **sublayer_kwargs)
        if self.outputs is not None:
            self.outputs.append(out)
        return out

    def is_removed(self, source: Tensor) -> bool:
        return any(source is zero for zero in self.removed)

    def mix(self, strategy: Any, index: int, sources: Sequence[Tensor],
            columns: Sequence[int] | None) -> tuple[Tensor, Tensor]:
        if self.prefix is not None and index < len(self.prefix):
            # this sublayer's output is reused (`call_sublayer`), so what it would read is never used:
            # skip the depth attention (a placeholder of the right shape; nothing records on these passes)
            like = sources[0]
            return like, like.new_zeros(()).expand(len(sources), *like.shape[:-1])
        cols = list(range(len(sources))) if columns is None else list(columns)
        if self.collect is not None:
            self._collect(index, sources, cols)
        present = [j for j, v in enumerate(sources) if not self.is_removed(v)]  # by identity: before any cast
        sources = promoted(sources)
        if index != self.row:
            if len(present) == len(sources):
                return strategy.reference_mix(index, sources, columns)
            h, weights = strategy.reference_mix(index, [sources[j] for j in present], [cols[j] for j in present])
            return h, _scatter(weights, present, len(sources))
        parts = [v.chunk(self.copies) for v in sources]  # each K x (B, T, D)
        hs, ws = [], []
        for k, column in enumerate(self.columns):
            part = [p[k] for p in parts]
            if self.mode == "remove":
                keep = [j for j in present if cols[j] != column]
                if not keep:
                    raise ValueError(single_source_message(strategy, index, column))
                h, w = strategy.reference_mix(index, [part[j] for j in keep], [cols[j] for j in keep])
            else:  # "mean": the source, in this row only, becomes its mean over the evaluation set
                keep = present
                mean = self.means[index].get(column)  # (D,); None: a source this pass's window does not see
                swapped = [mean.to(part[j].dtype).expand_as(part[j]) if cols[j] == column else part[j] for j in keep]
                h, w = strategy.reference_mix(index, swapped, [cols[j] for j in keep])
            hs.append(h)
            ws.append(_scatter(w, keep, len(sources)))
        return torch.cat(hs), torch.cat(ws, dim=1)

    def _collect(self, index: int, sources: Sequence[Tensor], cols: Sequence[int]) -> None:
        row = self.collect.setdefault(index, {})
        for column, v in zip(cols, sources, strict=True):
            total = v.detach().to(torch.float64).flatten(0, -2).sum(0)  # (D,)
            if column in row:
                row[column][0] += total
                row[column][1] += v.shape[:-1].numel()
            else:
                row[column] = [total, v.shape[:-1].numel()]


def single_source_message(strategy: Any, index: int, column: int) -> str:
    _, cols, _ = strategy.depth_layout()
    name = cols[column] if column < len(cols) else f"source {column}"
    return (f"sublayer {sublayer_label(index, strategy.num_layers)} reads a single source ({name}), so knocking it "
            f"out leaves nothing to read; pick a sublayer with two or more sources")


@contextlib.contextmanager
def knockout(residual: nn.Module, plan: Knockout) -> Iterator[Knockout]:
    """Arm `plan` on the strategy for the passes inside the block; always disarmed after."""
    if getattr(residual, "_knockout", None) is not None:
        raise RuntimeError("a knock-out is already armed on this strategy; knock-outs do not nest")
    residual._knockout = plan
    try:
        yield plan
    finally:
        residual._knockout = None


# == losses ===========================================================================================
