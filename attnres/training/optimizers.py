"""The optimiser groups (`parameter_groups`, also `lit.parameter_groups`) and the optimisers
built from them: `MuonWithAdamW` (`optim=muon`), Muon on the hidden weight matrices and AdamW on
everything else, as one `torch.optim.Optimizer`, so that Lightning steps, clips, schedules and
checkpoints it as it does AdamW alone; and the start line's words for an optimiser config
(`describe_optimizer`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

#: the groups `parameter_groups(..., hidden_matrices=True)` marks for Muon carry this key and value
MUON_GROUP = ("optimizer", "muon")


def parameter_groups(model: nn.Module, query_lr_scale: float, hidden_matrices: bool = False,
                     lr_scales: dict[int, float] | None = None) -> list[dict[str, Any]]:
    """AdamW groups: decay on weight matrices only; norms, biases, embeddings and the residual
    strategy's parameters without decay; pseudo-queries also at `query_lr_scale` times the
    learning rate (DESIGN.md section 2b: they are sensitive to it). With `hidden_matrices` the
    2-D weights other than the embedding and the LM head (`model.head`) come first, in a group of
    their own marked for Muon (`optimizers.MUON_GROUP`, `optim=muon`). `lr_scales` (id of a
    parameter: factor; `Transformer.lr_scales`, model.parametrization=mup) splits each group by
    factor: a group's parameters at factor f go to a group of their own named `<name> x<f>`."""
    no_decay_ids = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding) or "norm" in type(module).__name__.lower():
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    residual = getattr(model, "residual", None)
    residual_names = {id(p): n for n, p in residual.named_parameters()} if residual is not None else {}
    head = getattr(model, "head", None)
    head_ids = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    matrices, decay, no_decay, queries, seen = [], [], [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if "query" in residual_names.get(id(p), ""):
            queries.append(p)
        elif id(p) in residual_names or id(p) in no_decay_ids or p.dim() < 2:
            no_decay.append(p)
        elif hidden_matrices and p.dim() == 2 and id(p) not in head_ids:
            matrices.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": matrices, "lr_scale": 1.0, "name": "hidden_matrix", MUON_GROUP[0]: MUON_GROUP[1]},
        {"params": decay, "lr_scale": 1.0, "name": "decay"},  # the optimiser's own weight_decay
        {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0, "name": "no_decay"},
        {"params": queries, "weight_decay": 0.0, "lr_scale": query_lr_scale, "name": "pseudo_query"},
    ]
    if lr_scales:
        groups = [part for group in groups for part in split_by_scale(group, lr_scales)]
    return [g for g in groups if g["params"]]


class MuonWithAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` on the parameter groups marked `"optimizer": "muon"` (the 2-D weights of
    the attention and MLP sublayers), `torch.optim.AdamW` on the others (embeddings, LM head, norms,
    biases, the residual strategy's parameters), stepped together.

    `lr`, `betas`, `eps` and `weight_decay` are AdamW's; `muon` holds Muon's keyword arguments
    (`lr`, `momentum`, `nesterov`, `weight_decay`, `ns_steps`, `adjust_lr_fn`). A group's own
    keys win over both, as in any torch optimiser (the no-decay groups set `weight_decay: 0`).
    Given plain parameters instead of groups, every 2-D one goes to Muon (torch's own example;
    for a language model that includes the embedding, which the runner's groups keep on AdamW).

    `param_groups` lists Muon's groups, then AdamW's: the same dicts the two optimisers step with,
    so a learning-rate scheduler (and `lr_scale` in `LitLanguageModel`) moves both. `state_dict()`
    is `{"muon": ..., "adamw": ...}`, each the optimiser's own, so a resumed run continues with
    Muon's momentum buffers and AdamW's moments exactly where they were.
    """

    #: `LitLanguageModel` asks `parameter_groups` to mark the hidden matrices for this optimiser
    hidden_matrices = True

    def __init__(self, params: Iterable[Any], lr: float = 3e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1, muon: Mapping[str, Any] | None = None) -> None:
        key, value = MUON_GROUP
        params = list(params)
        if params and not any(isinstance(g, Mapping) for g in params):  # plain tensors: torch's own example split
            params = [{"params": [p for p in params if p.ndim == 2], key: value},
                      {"params": [p for p in params if p.ndim != 2]}]
        groups = [dict(g) for g in params if g["params"]]
        matrices = [g for g in groups if g.get(key) == value]
        others = [g for g in groups if g.get(key) != value]
        if not matrices:
            raise ValueError("MuonWithAdamW got no parameter group marked for Muon "
                             f"({key}: {value}); build the groups with parameter_groups(..., hidden_matrices=True)")
        self.muon = torch.optim.Muon(matrices, **dict(muon or {}))
        self.adamw = torch.optim.AdamW(others, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay) \
            if others else None
        super().__init__(self._inner_groups(), {})
        self._link()

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    def _inner_groups(self) -> list[dict[str, Any]]:
        return [g for o in self._optimizers() for g in o.param_groups]

    def _link(self) -> None:
        """`param_groups` and `state` are the inner optimisers' own (rebuilt after a load, which
        replaces the inner lists and dicts)."""
        self.param_groups = self._inner_groups()
        self.state = _JointState(self._optimizers())  # type: ignore[assignment]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self._optimizers():
            optimizer.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict() if self.adamw else None}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError("this optimiser state is not MuonWithAdamW's (no 'muon' and 'adamw' parts): it was "
                             "saved by another optimiser; continue it with the optimiser it was trained with")
        self.muon.load_state_dict(state_dict["muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state_dict["adamw"])
        self._link()

    def describe(self) -> str:
        """Which parameters each optimiser got: counts of tensors and of values, per group."""
        parts = []
        for name, optimizer in (("Muon", self.muon), ("AdamW", self.adamw)):
            if optimizer is None:
                continue
            groups = ", ".join(f"{g.get('name', '?')} {len(g['params'])} tensors / "
                               f"{sum(p.numel() for p in g['params']):,} values at lr {g['lr']:g}"
                               for g in optimizer.param_groups)
            parts.append(f"{name}: {groups}")
        return "optimiser groups: " + "; ".join(parts)


def split_by_scale(group: dict[str, Any], lr_scales: Mapping[int, float]) -> list[dict[str, Any]]:
    """`group` split by its parameters' learning-rate factors (`lr_scales`: id of a parameter to
    its factor, 1 where absent): the factor-1 part keeps the name, the others are `<name> x<f>`
    with `lr_scale` times f, largest factor first."""
    factors: dict[float, list] = {}
    for p in group["params"]:
        factors.setdefault(lr_scales.get(id(p), 1.0), []).append(p)
    return [{**group, "params": params, "lr_scale": group["lr_scale"] * factor,
             "name": group["name"] if factor == 1.0 else f"{group['name']} x{factor:.4g}"}
            for factor, params in sorted(factors.items(), key=lambda item: -item[0])]


class _JointState(MutableMapping):
    """The per-parameter states of several optimisers as one mapping: a read finds a parameter's
    state in its own optimiser, a write goes there too (Lightning moves states between devices
    by writing them back)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def _owner(self, param: Any) -> torch.optim.Optimizer:
        for optimizer in self.optimizers:
            if param in optimizer.state or any(p is param for g in optimizer.param_groups for p in g["params"]):
                return optimizer
        raise KeyError(param)

    def __getitem__(self, param: Any) -> Any:
        return self._owner(param).state[param]

    def __setitem__(self, param: Any, value: Any) -> None:
        self._owner(param).state[param] = value

    def __delitem__(self, param: Any) -> None:
        del self._owner(param).state[param]

    def __iter__(self) -> Iterator[Any]:
        return (p for optimizer in self.optimizers for p in optimizer.state)

    def __len__(self) -> int:
        return sum(len(optimizer.state) for optimizer in self.optimizers)


def describe_optimizer(optimizer: Mapping[str, Any]) -> str:
    """The start line's words for `optim.optimizer`: `lr 0.003`, or for `optim=muon` both rates and
    the split (`Muon lr 0.003 on hidden matrices, AdamW lr 0.003 on the rest`)."""
    muon = optimizer.get("muon")
    if not str(optimizer.get("_target_", "")).endswith("MuonWithAdamW") or not isinstance(muon, Mapping):
        return f"lr {optimizer.get('lr')}"
    return (f"Muon lr {muon.get('lr')} on hidden matrices, AdamW lr {optimizer.get('lr')} on embeddings, "
            "head, norms, biases and residual")
