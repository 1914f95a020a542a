"""`AttnResModel` and `AttnResForCausalLM`: an `attnres.Transformer` as a Hugging Face model.

Both wrap the Transformer as it is (`model.transformer` in the base model, `model.model.transformer`
in the causal LM), so the logits are the Transformer's own. Decoding keeps keys and values in
transformers' own cache classes (`DynamicCache`, what `generate()` makes by default): a new token's
depth sources are its own sublayer outputs, computed in the same pass, and only attention reads
other positions, so the attention cache is all a step needs (as `attnres.model.KVCache`).

Positions are the cache's: a call continues at the position after what the cache holds. Batches
are unpadded (an `attention_mask` with zeros is refused, in one line); a sequence reaches
`block_size` positions at most (the rotary tables and what the model was trained on).
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


def pop_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a caller passed, under either of transformers' names for it."""
    cache = kwargs.pop("cache", None)
    legacy = kwargs.pop("past_key_values", None)
    return cache if cache is not None else legacy


def run_transformer(config: AttnResConfig, transformer: Transformer, input_ids: Tensor | None,
                    attention_mask: Tensor | None, cache: Any, use_cache: bool | None,
                    inputs_embeds: Tensor | None, return_hidden: bool) -> tuple[dict[str, Tensor], Any]:
    """The Transformer's forward over `input_ids` (B, T), continuing `cache` (made when `use_cache`)."""
    if inputs_embeds is not None or input_ids is None:
        raise ValueError("attnres models take input_ids (token ids), not inputs_embeds")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("attnres models take unpadded batches: an attention_mask with zeros is not supported; "
                         "pass prompts of one length (or one prompt at a time)")
    if input_ids.shape[-1] == 0:
        raise ValueError("an empty prompt (input_ids of 0 tokens): attnres models need at least one token to "
                         "start from; give a non-empty prompt (a byte-level model can start from '\\n')")
    if use_cache is None:
        use_cache = getattr(config, "use_cache", True)
    if cache is None and use_cache:
        cache = DynamicCache(config=config)
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
                                     inputs_embeds, return_hidden=True)
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
        fails on one with an IndexError from deep inside)."""
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        if isinstance(prompt, Tensor) and prompt.ndim >= 1 and prompt.shape[-1] == 0:
            raise ValueError("generate() got an empty prompt (input_ids of 0 tokens): attnres models need at least "
                             "one token to start from; give a non-empty prompt (a byte-level model can start from "
                             "'\\n')")
        return super().generate(inputs, *args, **kwargs)

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, inputs_embeds: Tensor | None = None,
                labels: Tensor | None = None, use_cache: bool | None = None, logits_to_keep: int = 0,
                return_dict: bool | None = None, **kwargs: Any) -> Any:
        cache = pop_cache(kwargs)
        out, cache = run_transformer(self.config, self.transformer, input_ids, attention_mask, cache, use_cache,
                                     inputs_embeds, return_hidden=False)
        logits = out["logits"]
        loss = None
        if labels is not None:  # position t predicts token t + 1
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        result = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE: cache})
        return result if return_dict is not False else result.to_tuple()
