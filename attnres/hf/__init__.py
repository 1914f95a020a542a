"""Hugging Face models of the Transformer (`pip install 'attnres[hf]'`): AttnResConfig, AttnResModel,
AttnResForCausalLM, registered with AutoConfig, AutoModel and AutoModelForCausalLM on import."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from attnres.hf.configuration import AttnResConfig
from attnres.hf.modeling import AttnResForCausalLM, AttnResModel, AttnResPreTrainedModel

AutoConfig.register(AttnResConfig.model_type, AttnResConfig, exist_ok=True)
AutoModel.register(AttnResConfig, AttnResModel, exist_ok=True)
AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)

__all__ = ["AttnResConfig", "AttnResForCausalLM", "AttnResModel", "AttnResPreTrainedModel"]
