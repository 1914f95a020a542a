"""`AttnResModel` and `AttnResForCausalLM`: an `attnres.Transformer` as a Hugging Face model.

Both wrap the Transformer as it is (`model.transformer` in the base model, `model.model.transformer`
in the causal LM), so the logits are the Transformer's own. Decoding keeps keys and values in
transformers' own cache classes (`DynamicCache`, what `generate()` makes by default): a new token's
depth sources are its own sublayer outputs, computed in the same pass, and only attention reads
other positions, so the attention cache is all a step needs (as `attnres.model.KVCache`).

Positions are the cache's: a call continues at the position after what the cache holds. A batch
may be padded, on the left (batched `generate()`) or the right: an `attention_mask` (B, cached + T)
with zeros at padding. Then each row's positions count its own tokens only (`position_ids` when
given, else from the mask) and attention skips padded keys, so a padded row's logits and greedy
tokens are those of its prompt alone. A sequence reaches `block_size` positions at most (the rotary
tables and what the model was trained on).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from attnres.hf.configuration import AttnResConfig
from attnres.model import Transformer, rotary_tables

#: the name transformers gives the cache in outputs (and forward's keyword): `cache` from 5.2x on,
#: `past_key_values` before
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class CacheView:
    """`attnres.model.KVCache`'s interface (`pos`, `update(layer, k, v)`) over a transformers `Cache`."""

    def __init__(self, cache: Any) -> None:
        self.cache, self.pos = cache, cache.get_seq_length()

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = self.cache.update(k, v, layer)
        if keys.shape[2] != self.pos + k.shape[2]:
            written = self.pos + k.shape[2]
            raise ValueError(f"the cache returned {keys.shape[2]} positions where {written} were written; "
                             "attnres models decode with a DynamicCache (generate's default, "
                             "cache_implementation='dynamic'), not a static or sliding one")
        return keys, values


class PaddedView:
    """A `CacheView` (or no cache) plus what a padded batch needs (`attnres.model.KVCache`):
    `positions` (B, T) of the new tokens, `key_mask` (B, cached + T), False at padding."""

    def __init__(self, cache: Any, attention_mask: Tensor, position_ids: Tensor | None, T: int) -> None:  # noqa: N803 (T: new tokens, as in model.py)
        self.view = CacheView(cache) if cache is not None else None
        self.pos = self.view.pos if self.view is not None else 0
        self.key_mask = attention_mask.bool()
        if position_ids is None:  # each row counts its own tokens; a padded position's value is never read
            position_ids = attention_mask.long().cumsum(-1)[:, -T:] - 1
        self.positions = position_ids.long().expand(attention_mask.shape[0], T).clamp(min=0)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.view.update(layer, k, v) if self.view is not None else (k, v)


def pop_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a caller passed, under either of transformers' names for it."""
    cache = kwargs.pop("cache", None)
    legacy = kwargs.pop("past_key_values", None)
    return cache if cache is not None else legacy


def check_mask(attention_mask: Tensor, input_ids: Tensor, cached: int) -> None:
    """One line for a mask that is not (batch, cached + new tokens), and for a row with no token
    (all zeros: an empty prompt, refused as an empty `input_ids` is)."""
    B, T = input_ids.shape[0], input_ids.shape[-1]
    if attention_mask.ndim != 2 or tuple(attention_mask.shape) != (B, cached + T):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; attnres models take one of "
                         f"(batch, cached + new tokens) = ({B}, {cached + T}): the cached positions ({cached}) plus "
                         f"the new tokens ({T})")
    empty = (~attention_mask.bool().any(-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"row {empty[0]} of attention_mask is all zeros: an empty prompt; attnres models need at "
                         "least one token per row to start from (drop the row, or give it a token)")


def run_transformer(config: AttnResConfig, transformer: Transformer, input_ids: Tensor | None,
                    attention_mask: Tensor | None, cache: Any, use_cache: bool | None,
                    inputs_embeds: Tensor | None, return_hidden: bool,
                    position_ids: Tensor | None = None) -> tuple[dict[str, Tensor], Any]:
    """The Transformer's forward over `input_ids` (B, T), continuing `cache` (made when `use_cache`);
    an `attention_mask` with zeros makes it a padded batch (`PaddedView`)."""
    if inputs_embeds is not None or input_ids is None:
        raise ValueError("attnres models take input_ids (token ids), not inputs_embeds")
    if input_ids.shape[-1] == 0:
        raise ValueError("an empty prompt (input_ids of 0 tokens): attnres models need at least one token to "
                         "start from; give a non-empty prompt (a byte-level model can start from '\\n')")
    if use_cache is None:
        use_cache = getattr(config, "use_cache", True)
    if cache is None and use_cache:
        cache = DynamicCache(config=config)
    if attention_mask is not None:
        check_mask(attention_mask, input_ids, cache.get_seq_length() if cache is not None else 0)
    padded = attention_mask is not None and not bool(attention_mask.all())
    if padded:
        view: Any = PaddedView(cache, attention_mask, position_ids, input_ids.shape[-1])
    else:  # unpadded: positions are the cache's (a caller's position_ids say the same)
        view = CacheView(cache) if cache is not None else None
    return transformer(input_ids, return_hidden=return_hidden, kv_cache=view), cache


class AttnResPreTrainedModel(PreTrainedModel):
    config_class = AttnResConfig
    config: AttnResConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Transformer"]  # the residual strategy reads every sublayer: keep it on one device
    _supports_sdpa = True  # the Transformer's attention is scaled_dot_product_attention

    def _init_weights(self, module: nn.Module) -> None:
        """The Transformer initialises its own weights when built (`from_config`); a model built on
        the meta device (`from_pretrained`) gets them from the checkpoint. Only the rotary tables,
        buffers that are not saved, are computed here."""
        if isinstance(module, Transformer):
            head_dim = self.config.hidden_size // self.config.num_attention_heads
            cos, sin = rotary_tables(head_dim, module.block_size)
            with torch.no_grad():
                for name, table in (("rope_cos", cos), ("rope_sin", sin)):
                    buffer = getattr(module, name)
                    if buffer.is_meta:
                        setattr(module, name, table)
                    else:
                        buffer.copy_(table)


class AttnResModel(AttnResPreTrainedModel):
    """The base model: the final normalised hidden state (B, T, D) as `last_hidden_state`."""

    _tied_weights_keys = {"transformer.head.weight": "transformer.embed.weight"}  # when tie_word_embeddings

    def __init__(self, config: AttnResConfig) -> None:
        super().__init__(config)
        self.transformer = config.build_transformer()
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.transformer.embed = value

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, inputs_embeds: Tensor | None = None,
                use_cache: bool | None = None, return_dict: bool | None = None, **kwargs: Any) -> Any:
        cache = pop_cache(kwargs)
        out, cache = run_transformer(self.config, self.transformer, input_ids, attention_mask, cache, use_cache,
                                     inputs_embeds, return_hidden=True, position_ids=position_ids)
        result = BaseModelOutputWithPast(last_hidden_state=out["hidden"], **{CACHE: cache})
        return result if return_dict is not False else result.to_tuple()


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    """The causal LM: logits (B, T, V), a loss when `labels` are given (shifted inside, as every
    Hugging Face causal LM does), and `generate()`."""

    def __init__(self, config: AttnResConfig) -> None:
        super().__init__(config)
        self.model = AttnResModel(config)
        self.post_init()

    @property
    def transformer(self) -> Transformer:
        return self.model.transformer

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.transformer.embed = value

    def get_output_embeddings(self) -> nn.Module:
        return self.transformer.head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.transformer.head = value

    def generate(self, inputs: Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        """`GenerationMixin.generate`, with a clear refusal of an empty prompt (transformers itself
        fails on one with an IndexError from deep inside), of a row with no token, and of right
        padding: generate() continues every row from its last column, a pad in a right-padded row,
        so its tokens would not be its prompt's (transformers only warns)."""
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        if isinstance(prompt, Tensor) and prompt.ndim >= 1 and prompt.shape[-1] == 0:
            raise ValueError("generate() got an empty prompt (input_ids of 0 tokens): attnres models need at least "
                             "one token to start from; give a non-empty prompt (a byte-level model can start from "
                             "'\\n')")
        mask = kwargs.get("attention_mask")
        if isinstance(prompt, Tensor) and isinstance(mask, Tensor) and prompt.ndim == 2:
            check_mask(mask, prompt, 0)
            right = (~mask[:, -1].bool()).nonzero().flatten().tolist()
            if right:
                raise ValueError(f"generate() got a right-padded batch (row {right[0]} ends in padding): generation "
                                 "continues each row from its last column, so pad on the left (the tokenizer's "
                                 "padding_side='left')")
        return super().generate(inputs, *args, **kwargs)

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, inputs_embeds: Tensor | None = None,
                labels: Tensor | None = None, use_cache: bool | None = None, logits_to_keep: int = 0,
                return_dict: bool | None = None, **kwargs: Any) -> Any:
        cache = pop_cache(kwargs)
        out, cache = run_transformer(self.config, self.transformer, input_ids, attention_mask, cache, use_cache,
                                     inputs_embeds, return_hidden=False, position_ids=position_ids)
        logits = out["logits"]
        loss = None
        if labels is not None:  # position t predicts token t + 1
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        result = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE: cache})
        return result if return_dict is not False else result.to_tuple()
