"""Causal probes of depth routing: which sources and which sublayers a model actually uses.

The depth-attention heatmap shows where each sublayer puts its weight; weight is not
importance (a study of trained Block AttnRes models, arXiv 2606.13168, finds the largest
weight is often not the largest causal contribution). These probes measure importance as the
change in loss, on a fixed evaluation set, when something is taken out of the model:

Source knock-outs (`source_knockouts`), for strategies whose weights are a softmax routed
through `DepthAttentionResidual.mix` (Block and Full AttnRes and their ablations): for
sublayer (row) l and each of its sources i, only row l changes:

- mode "remove" (the default): source i leaves l's softmax and the weights are renormalised
  over the rest (a softmax over the remaining logits, alpha_j / (1 - alpha_i)). It answers
  "what if l could not read i"; the mix keeps its scale, being a convex combination still.
- mode "mean": source i stays in the softmax but is replaced by its mean over every token of
  the evaluation set (taken from the intact model at row l), one constant vector; its logit
  is recomputed from that vector. It removes what i says about each token, not its presence.

Under the ablation options the removal means the same: the source leaves every head's softmax
(`heads`), the sum that normalises sigmoid scores (`scoring="sigmoid"`) or the softmax over
static logits (`mixing="static"`); with `query="input"` the query reads the newest source that
remains.

A row with a single source (the first sublayer: the embedding) has nothing to knock out: its
cells are NaN in the matrix, and asking for it (`source_knockout`) is refused. DenseFormer,
HC and mHC record |c| / sum |c| of signed linear coefficients: they are not weights the model
normalises, so "remove and renormalise" has no meaning there, and their mixing does not pass
through `mix`. They get layer knock-outs only, as the standard residual does.

Layer knock-outs (`layer_knockouts`, every strategy): sublayer l's output is removed from
every later input. With a plain sum (standard, DenseFormer, HC, mHC, and AttnRes without the
output aggregation) it is replaced by zeros, which is removing its add exactly. Under AttnRes
the removed output also leaves every softmax it would have entered (it is not a zero source):
Full AttnRes drops it as a source; Block AttnRes drops it from its block's sum, the block
keeping its other members, and a block or partial sum made only of removed outputs is dropped.

How a pass runs. The strategy's hooks (`call_sublayer`, `mix`) hand over to the armed
`Knockout` (`attnres.knockout`), and the fast path is off while one is armed. The
evaluation set is `batches`, a sequence of (inputs, targets), the same for every knock-out;
the loss is the mean cross-entropy over all scored tokens (targets != -100), as val/loss is.
With `batched=True` the knock-outs of one row share a pass: the batch is stacked K times (copy
k knocks out the k-th source), and the sublayers before l are not recomputed, their outputs
from the intact pass being reused (nothing before l depends on the knock-out). A pass then
costs the sublayers from l on, K times wide. `batched=False` runs one full forward per
knock-out: the reference the tests hold the batched pass against.

Plain PyTorch and numpy: no Lightning, Hydra or matplotlib here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnres.knockout import MODES, Knockout, knockout, single_source_message
from attnres.labels import sublayer_label

Batch = tuple[Tensor, Tensor]


class ProbesStopped(RuntimeError):  # noqa: N818  (a request to stop, not a failure)
    """`should_stop` said so between two passes: nothing was measured."""


def _loss_sums(model: nn.Module, inputs: Tensor, targets: Tensor, copies: int = 1) -> tuple[Tensor, int]:
    """Per copy, the summed cross-entropy over scored tokens, (K,) float64; and the tokens scored."""
    if copies > 1:
        inputs, targets = inputs.repeat(copies, 1), targets.repeat(copies, 1)
    logits = model(inputs)["logits"]  # (K B, T, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least, as the model's loss
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
    tokens = int((targets != -100).sum().item()) // copies
    return ce.view(copies, -1).to(torch.float64).sum(1), tokens


def _device(model: nn.Module) -> torch.device:
    return next(iter(model.parameters()), torch.empty(0)).device


def _check_batches(batches: Sequence[Batch]) -> list[Batch]:
    batches = list(batches)
    if not batches:
        raise ValueError("the evaluation set is empty; give at least one (inputs, targets) batch")
    return batches


# == results ==========================================================================================
def rank_correlation(mass: np.ndarray, effect: np.ndarray) -> np.ndarray:
    """Per row, Spearman's rank correlation between mass and effect over the sources the row has
    (NaN-free cells; ties get their mean rank); NaN for rows of fewer than 3 sources or a
    constant row."""
    out = np.full(mass.shape[0], np.nan)
    for r in range(mass.shape[0]):
        ok = np.isfinite(mass[r]) & np.isfinite(effect[r])
        if ok.sum() < 3:
            continue
        a, b = _ranks(mass[r][ok]), _ranks(effect[r][ok])
        a, b = a - a.mean(), b - b.mean()
        denom = math.sqrt(float((a * a).sum() * (b * b).sum()))
        out[r] = float((a * b).sum()) / denom if denom > 0 else np.nan
    return out


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=np.float64)
    for value in np.unique(x):  # ties: the mean of their ranks
        tied = x == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def top_agreement(mass: np.ndarray, effect: np.ndarray) -> np.ndarray:
    """Per row: 1 where the source of largest mass is also the one whose knock-out costs most,
    0 where not, NaN for rows of fewer than 2 sources."""
    out = np.full(mass.shape[0], np.nan)
    for r in range(mass.shape[0]):
        ok = np.isfinite(mass[r]) & np.isfinite(effect[r])
        if ok.sum() >= 2:
            idx = np.flatnonzero(ok)
            out[r] = float(idx[np.argmax(mass[r][idx])] == idx[np.argmax(effect[r][idx])])
    return out


@dataclass
class RoutingProbe:
    """What `probe_routing` measured. Effects are loss(knocked out) - clean loss, in nats (> 0:
    the model needs it). `mass` and `source_effect` are (rows, cols) with the heatmap's rows
    (`rows`: sublayer indices, `num_layers` = the output aggregation) and columns, NaN where a
    row has no such source (and, in `source_effect`, on rows of a single source); None for
    strategies without depth weights (mass) or without source knock-outs (source_effect).
    `layer_effect` (L,): removing sublayer l. `seconds`: wall time of each part."""

    strategy: str
    num_layers: int
    mode: str
    clean_loss: float
    tokens: int
    batches: int
    rows: list[int] = field(default_factory=list)
    row_labels: list[str] = field(default_factory=list)
    col_labels: list[str] = field(default_factory=list)
    sources: str = "source"
    mass: np.ndarray | None = None
    source_effect: np.ndarray | None = None
    layer_effect: np.ndarray | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def layer_labels(self) -> list[str]:
        return [sublayer_label(i, self.num_layers) for i in range(self.num_layers)]

    def rank_correlation(self) -> np.ndarray | None:
        return None if self.mass is None or self.source_effect is None else rank_correlation(self.mass,
                                                                                            self.source_effect)

    def top_agreement(self) -> np.ndarray | None:
        return None if self.mass is None or self.source_effect is None else top_agreement(self.mass,
                                                                                         self.source_effect)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoutingProbe:
        """The probe `to_dict` (or probes.json, where NaN is null) describes."""
        def arr(a: Any) -> np.ndarray | None:
            return None if a is None else np.array([[np.nan if v is None else v for v in row] for row in a]
                                                    if a and isinstance(a[0], list) else
                                                    [np.nan if v is None else v for v in a], dtype=np.float64)

        return cls(strategy=data["strategy"], num_layers=data["num_layers"], mode=data["mode"],
                   clean_loss=data["clean_loss"], tokens=data["tokens"], batches=data["batches"], rows=data["rows"],
                   row_labels=data["row_labels"], col_labels=data["col_labels"], sources=data["sources"],
                   mass=arr(data["mass"]), source_effect=arr(data["source_effect"]),
                   layer_effect=arr(data["layer_effect"]), seconds=data.get("seconds", {}))

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and numbers (NaN stays NaN: `attnres.atomic.write_json` makes it null)."""
        def arr(a: np.ndarray | None) -> Any:
            return None if a is None else np.asarray(a, dtype=np.float64).tolist()

        return {"strategy": self.strategy, "num_layers": self.num_layers, "mode": self.mode,
                "clean_loss": self.clean_loss, "tokens": self.tokens, "batches": self.batches, "rows": self.rows,
                "row_labels": self.row_labels, "col_labels": self.col_labels, "sources": self.sources,
                "mass": arr(self.mass), "source_effect": arr(self.source_effect),
                "rank_correlation": arr(self.rank_correlation()), "top_agreement": arr(self.top_agreement()),
                "layer_labels": self.layer_labels, "layer_effect": arr(self.layer_effect), "seconds": self.seconds}


# == the probes =======================================================================================
class _EvalMode:
    """Eval mode and no gradients for the probe, the model's mode restored after."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.was_training = model, model.training
        self.no_grad = torch.no_grad()

    def __enter__(self) -> None:
        self.model.eval()
        self.no_grad.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.no_grad.__exit__(*exc)
        self.model.train(self.was_training)


def _intact_pass(model: nn.Module, batches: list[Batch], collect: dict | None) -> tuple[float, int, dict[int, Tensor]]:
    """Clean loss, scored tokens and the mean depth weights (row -> (S,) over all tokens) of the intact model."""
    residual, device = model.residual, _device(model)
    total, tokens, mass, positions = 0.0, 0, {}, 0
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        residual.record_next()
        try:
            with knockout(residual, Knockout(collect=collect)):
                sums, n = _loss_sums(model, inputs, targets)
            record = residual.recorded
        finally:
            residual._record_next, residual.recorded = False, None
        total, tokens = total + sums.item(), tokens + n
        positions += inputs.numel()
        for index, w in (record.weights.items() if record is not None else ()):
            s = w.detach().to(torch.float64).flatten(1).sum(1).cpu()  # (S,)
            mass[index] = s if index not in mass else mass[index] + s
    if tokens == 0:
        raise ValueError("the evaluation set scores no token (every target is -100); use batches with targets")
    clean = total / tokens
    if not math.isfinite(clean):
        raise ValueError(f"the intact model's loss on the evaluation set is {clean}: its weights or inputs are not "
                         "finite; probe a checkpoint from before the loss diverged")
    return clean, tokens, {index: m / positions for index, m in mass.items()}


def _means(collect: dict[int, dict[int, list]] | None) -> dict[int, dict[int, Tensor]] | None:
    """row -> column -> (D,) float32 mean over the evaluation set's tokens, from `Knockout.collect`."""
    if not collect:
        return None
    return {i: {c: (total / n).to(torch.float32) for c, (total, n) in row.items()} for i, row in collect.items()}


def _require_source_knockouts(residual: nn.Module) -> None:
    if not getattr(residual, "source_knockouts", False):
        raise ValueError(f"{type(residual).__name__} has no source knock-outs (its mixing is not a softmax over "
                         "sources, see attnres.probes); use layer knock-outs, or a Block / Full AttnRes model")


def probe_routing(
    model: nn.Module,
    batches: Sequence[Batch],
    mode: str = "remove",
    sources: bool = True,
    layers: bool = True,
    batched: bool = True,
    max_stack: int = 16,
    should_stop: Callable[[], bool] | None = None,
) -> RoutingProbe:
    """Source knock-outs (if the strategy has them and `sources`) and layer knock-outs (if
    `layers`) of `model` (an `attnres.Transformer`, or any module with `.residual` whose
    forward maps idx (B, T) to {"logits": (B, T, V)}) on the evaluation set `batches`. `mode`:
    "remove" or "mean" (module docstring). `batched`: the knock-outs of a row share passes of at
    most `max_stack` copies of the batch, and the prefix is reused; False: one full forward each.
    Eval mode and no gradients inside; the model's mode is restored after. `should_stop` is
    asked before every pass; True raises `ProbesStopped`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if isinstance(max_stack, bool) or not isinstance(max_stack, int) or max_stack < 1:
        raise ValueError(f"max_stack must be an int >= 1 (copies of the batch in one pass), got {max_stack!r}")
    batches = _check_batches(batches)
    residual = model.residual
    L = residual.num_layers
    do_sources = sources and getattr(residual, "source_knockouts", False)
    seconds: dict[str, float] = {}

    def check() -> None:
        if should_stop is not None and should_stop():
            raise ProbesStopped("the routing probes were asked to stop")

    with _EvalMode(model):
        start = time.perf_counter()
        collect: dict[int, list] | None = {} if do_sources and mode == "mean" else None
        clean, tokens, mass = _intact_pass(model, batches, collect)
        means = _means(collect)
        seconds["intact"] = time.perf_counter() - start
        name, cols, what = residual.depth_layout()
        rows = sorted(mass)
        width = max((len(mass[r]) for r in rows), default=0)
        cols = list(cols) if len(cols) >= width else [f"source {i}" for i in range(width)]
        probe = RoutingProbe(strategy=name, num_layers=L, mode=mode, clean_loss=clean, tokens=tokens,
                             batches=len(batches), rows=rows, row_labels=[sublayer_label(r, L) for r in rows],
                             col_labels=cols[:width], sources=what or "source")
        if rows:
            probe.mass = np.full((len(rows), width), np.nan)
            for r, index in enumerate(rows):
                probe.mass[r, : len(mass[index])] = mass[index].numpy()
        # knock-outs to run: (row, [columns]) and [layers]
        plan = [(index, list(range(len(mass[index])))) for index in rows if len(mass[index]) > 1] if do_sources else []
        src_sums = {(index, c): 0.0 for index, cs in plan for c in cs}
        layer_sums = dict.fromkeys(range(L) if layers else (), 0.0)
        device = _device(model)
        t_src = t_layer = 0.0
        for inputs, targets in batches:
            inputs, targets = inputs.to(device), targets.to(device)
            outputs: list[Tensor] = []
            if batched:  # the intact outputs of this batch, reused as every pass's prefix
                with knockout(residual, Knockout(outputs=outputs)):
                    _loss_sums(model, inputs, targets)
            t0 = time.perf_counter()
            for index, cs in plan:
                groups = [cs[i : i + max_stack] for i in range(0, len(cs), max_stack)] if batched else [[c] for c in cs]
                for group in groups:
                    check()
                    ko = Knockout(copies=len(group), row=index, columns=group, mode=mode, means=means,
                                  prefix=outputs[:index] if batched else None)
                    with knockout(residual, ko):
                        sums, _ = _loss_sums(model, inputs, targets, len(group))
                    for c, s in zip(group, sums.tolist(), strict=True):
                        src_sums[(index, c)] += s
            t1 = time.perf_counter()
            for layer in layer_sums:
                check()
                with knockout(residual, Knockout(layer=layer, prefix=outputs[:layer] if batched else None)):
                    sums, _ = _loss_sums(model, inputs, targets)
                layer_sums[layer] += sums.item()
            t_src, t_layer = t_src + (t1 - t0), t_layer + (time.perf_counter() - t1)
        if do_sources and rows:
            probe.source_effect = np.full((len(rows), width), np.nan)
            for (index, c), s in src_sums.items():
                probe.source_effect[rows.index(index), c] = s / tokens - clean
        if layers:
            probe.layer_effect = np.array([layer_sums[layer] / tokens - clean for layer in range(L)])
        seconds.update(sources=t_src, layers=t_layer, total=time.perf_counter() - start)
        probe.seconds = seconds
    return probe


def source_knockout(model: nn.Module, batches: Sequence[Batch], row: int, source: int, mode: str = "remove") -> float:
    """The change in loss when sublayer `row` (num_layers: the output aggregation) loses source
    `source` (its heatmap column) by `mode`: one full forward per batch, nothing reused.
    Refuses a row of a single source, and indices the row does not have."""
    residual = model.residual
    _require_source_knockouts(residual)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    batches = _check_batches(batches)
    with _EvalMode(model):
        collect: dict[int, list] | None = {} if mode == "mean" else None
        clean, tokens, mass = _intact_pass(model, batches, collect)
        L = residual.num_layers
        if row not in mass:
            raise ValueError(f"row={row} is not a sublayer with depth weights; valid rows: "
                             f"{', '.join(map(str, sorted(mass)))} ({L} = the output)")
        S = len(mass[row])
        if not 0 <= source < S:
            raise ValueError(f"sublayer {sublayer_label(row, L)} has sources 0..{S - 1}, not source={source}")
        if S == 1:
            raise ValueError(single_source_message(residual, row, source))
        means = _means(collect)
        total, device = 0.0, _device(model)
        for inputs, targets in batches:
            with knockout(residual, Knockout(row=row, columns=[source], mode=mode, means=means)):
                total += _loss_sums(model, inputs.to(device), targets.to(device))[0].item()
    return total / tokens - clean


def layer_knockout(model: nn.Module, batches: Sequence[Batch], layer: int) -> float:
    """The change in loss when sublayer `layer`'s output is removed (module docstring): one full
    forward per batch, nothing reused."""
    residual = model.residual
    L = residual.num_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L:
        raise ValueError(f"layer={layer!r} must be a sublayer index 0..{L - 1}")
    batches = _check_batches(batches)
    with _EvalMode(model):
        clean, tokens, _ = _intact_pass(model, batches, None)
        total, device = 0.0, _device(model)
        for inputs, targets in batches:
            with knockout(residual, Knockout(layer=layer)):
                total += _loss_sums(model, inputs.to(device), targets.to(device))[0].item()
    return total / tokens - clean
