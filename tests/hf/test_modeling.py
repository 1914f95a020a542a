"""attnres.hf without the runner: every strategy of conf/residual/ (and the paper's ablations) as a
Hugging Face model that saves, loads and decodes as the Transformer does; registration with the Auto
classes; the byte-level tokenizer; `import attnres` without transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("transformers", reason="needs the hf extra: pip install 'attnres[hf]'")
pytest.importorskip("safetensors", reason="needs the hf extra: pip install 'attnres[hf]'")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

from attnres.hf import AttnResConfig, AttnResForCausalLM, AttnResModel  # noqa: E402
from attnres.hf.tokenization import byte_tokenizer, save_tokenizer  # noqa: E402
from tests.helpers import CONF  # noqa: E402

SHAPE = {"vocab_size": 67, "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 48}


def strategy(name: str, **options) -> dict:
    """conf/residual/<name>.yaml resolved as the runner composes it (num_blocks=2), plus `options`."""
    root = OmegaConf.create({"num_blocks": 2, "residual": OmegaConf.load(CONF / "residual" / f"{name}.yaml")})
    spec = OmegaConf.to_container(root.residual, resolve=True)
    return {**spec, "kernel": "torch", **options} if "kernel" in spec else {**spec, **options}


STRATEGIES = {p.stem: strategy(p.stem) for p in sorted((CONF / "residual").glob("*.yaml"))}
ABLATIONS = {
    "block-query-input": strategy("block", query="input"),
    "block-mixing-static": strategy("block", mixing="static"),
    "block-sigmoid-no-key-norm": strategy("block", scoring="sigmoid", key_norm=False),
    "full-heads-2-window-2": strategy("full", heads=2, window=2),
    "hc-static": strategy("hc", dynamic=False),
    "denseformer-dilated": strategy("denseformer", dilation=2),
}


def model_of(residual: dict, seed: int = 0, **shape) -> AttnResForCausalLM:
    """A causal LM whose every parameter is moved off its initial value (zero-initialised
    pseudo-queries included, so that a weight left out of a save or load shows)."""
    torch.manual_seed(seed)
    model = AttnResForCausalLM(AttnResConfig(transformer={**SHAPE, **shape}, residual=residual)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def test_every_strategy_the_runner_offers_is_covered():
    assert {"standard", "block", "full", "denseformer", "hc", "mhc"} <= set(STRATEGIES)


@pytest.mark.parametrize("residual", [*STRATEGIES.values(), *ABLATIONS.values()], ids=[*STRATEGIES, *ABLATIONS])
def test_save_load_gives_the_same_logits_and_greedy_tokens(tmp_path, residual):
    model = model_of(residual)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is AttnResForCausalLM and loaded.dtype == torch.float32
    for name, value in model.transformer.state_dict().items():
        assert torch.equal(loaded.transformer.state_dict()[name], value), name
    idx = torch.randint(0, SHAPE["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.transformer(idx)["logits"]
        torch.testing.assert_close(loaded(idx).logits, expected, rtol=0, atol=1e-5)
    prompt = idx[:1, :7]
    reference = model.transformer.generate(prompt, 15, temperature=0)  # attnres's own KV-cached decoding
    assert loaded.generate(prompt, max_new_tokens=15, do_sample=False).tolist() == reference.tolist()


def test_tied_embeddings_are_stored_once_and_tied_after_loading(tmp_path):
    model = model_of(STRATEGIES["block"])
    model.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert "model.transformer.embed.weight" in stored and "model.transformer.head.weight" not in stored
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.transformer.head.weight is loaded.transformer.embed.weight
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight


def test_untied_embeddings_are_both_stored(tmp_path):
    model = model_of(STRATEGIES["full"], tie_embeddings=False)
    assert not model.config.tie_word_embeddings
    model.save_pretrained(tmp_path)
    assert "model.transformer.head.weight" in load_file(tmp_path / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.transformer.head.weight is not loaded.transformer.embed.weight
    assert torch.equal(loaded.transformer.head.weight, model.transformer.head.weight)


def test_decoding_step_by_step_with_a_dynamic_cache_is_the_full_forward():
    model = model_of(STRATEGIES["hc"])
    idx = torch.randint(0, SHAPE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        first = model(idx[:, :5], cache=cache)
        steps = [first.logits] + [model(idx[:, t : t + 1], cache=first.cache).logits for t in range(5, 12)]
    assert first.cache is cache and cache.get_seq_length() == 12
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_the_base_model_gives_the_final_hidden_state_and_the_loss_is_shifted():
    model = model_of(STRATEGIES["mhc"])
    idx = torch.randint(0, SHAPE["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        own = model.transformer(idx[:, :-1], targets=idx[:, 1:], return_hidden=True)
        out = model(idx, labels=idx)
        hidden = model.model(idx[:, :-1]).last_hidden_state
    torch.testing.assert_close(hidden, own["hidden"], rtol=0, atol=1e-6)
    shifted = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
    torch.testing.assert_close(out.loss, shifted)
    torch.testing.assert_close(out.loss, own["loss"], rtol=1e-6, atol=1e-6)


def test_embeddings_are_refused_in_one_line():  # padding: test_padding.py
    model = model_of(STRATEGIES["standard"])
    idx = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="not inputs_embeds"):
        model(inputs_embeds=torch.zeros(2, 4, SHAPE["n_embd"]))
    model(idx, attention_mask=torch.ones(2, 4, dtype=torch.long))  # all ones is no padding


def test_the_auto_classes_know_attnres(tmp_path):
    config = AutoConfig.for_model("attnres", transformer=SHAPE, residual=STRATEGIES["block"])
    assert type(config) is AttnResConfig
    assert (config.vocab_size, config.num_hidden_layers, config.hidden_size) == (67, 2, 16)
    assert type(AutoModel.from_config(config)) is AttnResModel
    lm = AutoModelForCausalLM.from_config(config)
    assert type(lm) is AttnResForCausalLM and lm.can_generate()
    config.save_pretrained(tmp_path)
    again = AutoConfig.from_pretrained(tmp_path)
    assert (again.transformer, again.residual) == (config.transformer, config.residual)


def test_a_constructor_argument_the_config_does_not_know_flows_through():
    config = AttnResConfig(transformer={**SHAPE, "mlp": "swiglu", "norm_eps": 1e-5})
    model = AttnResForCausalLM(config).transformer
    assert model.sublayers[1].activation == "swiglu" and model.norm.eps == 1e-5
    with pytest.raises(TypeError, match="no_such_argument"):
        AttnResForCausalLM(AttnResConfig(transformer={**SHAPE, "no_such_argument": 1}))


def test_a_residual_spec_must_name_a_strategy():
    with pytest.raises(ValueError, match="cannot be imported"):
        AttnResConfig(transformer=SHAPE, residual={"_target_": "no_such_package.Residual"}).build_transformer()
    with pytest.raises(ValueError, match="not a ResidualStrategy"):
        AttnResConfig(transformer=SHAPE, residual={"_target_": "torch.nn.Linear"}).build_transformer()


TEXTS = ["def f(x):\n    return x * 2  # twice\n", "héllo wörld, 中文, 🙂\t\r\n", "", "\x00\x7f"]


@pytest.mark.parametrize("text", TEXTS, ids=["code", "unicode", "empty", "controls"])
def test_the_byte_level_tokenizer_round_trips_utf8(tmp_path, text):
    tok = byte_tokenizer()
    assert tok.get_vocab_size() == 256
    assert tok.encode(text).ids == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text
    save_tokenizer(tok, tmp_path, max_length=128)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf(text)["input_ids"] == list(text.encode("utf-8"))
    assert hf.decode(list(text.encode("utf-8"))) == text


def test_importing_attnres_does_not_import_transformers():
    """The library; the runner imports Lightning, whose torchmetrics imports transformers itself when
    it is installed (torchmetrics.functional.text.bert)."""
    code = ("import sys, attnres, attnres.model, attnres.residual, attnres.probes, attnres.knockout; "
            "attnres.Transformer, attnres.BlockAttentionResidual, attnres.functional; import attnres.export.main; "
            "print(sorted(m for m in ('transformers', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
