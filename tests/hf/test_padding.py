"""Padded batches in attnres.hf: every strategy computes a padded row as it computes the prompt alone
(logits at every real position, and greedy tokens of a batched `generate()` with left padding), as
lm-eval's `generate_until` and any batched `generate()` need."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra: pip install 'attnres[hf]'")

from transformers import DynamicCache  # noqa: E402

from tests.hf.test_modeling import SHAPE, STRATEGIES, model_of  # noqa: E402

LENGTHS = (7, 3, 11)  # three prompts of different lengths: rows 0 and 1 are padded
PAD = 0


def prompts(seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, SHAPE["vocab_size"], (n,), generator=g) for n in LENGTHS]


def padded(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each (B, longest), padded on `side` with PAD."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, cols], mask[i, cols] = r, 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_padded_row_has_the_logits_of_its_prompt_alone(name, side):
    model = model_of(STRATEGIES[name]).double()  # float64: differences are the order of sums only
    rows = prompts()
    ids, mask = padded(rows, side)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, use_cache=False).logits
        cached = model(ids, attention_mask=mask).logits  # the same through a DynamicCache
        for i, r in enumerate(rows):
            alone = model(r[None]).logits[0]
            real = batch[i][mask[i].bool()]
            torch.testing.assert_close(real, alone, rtol=0, atol=1e-10)
            torch.testing.assert_close(cached[i][mask[i].bool()], alone, rtol=0, atol=1e-10)
    assert torch.isfinite(batch).all()  # padded positions too (a padded query sees at least itself)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_batched_greedy_generation_with_left_padding_is_each_prompt_alone(name):
    model = model_of(STRATEGIES[name])
    rows = prompts(6)
    ids, mask = padded(rows, "left")
    new = 12
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=PAD)
    for i, r in enumerate(rows):
        alone = model.generate(r[None], max_new_tokens=new, do_sample=False, pad_token_id=PAD)
        assert out[i, -new:].tolist() == alone[0, -new:].tolist(), f"row {i}"
        assert alone[0, -new:].tolist() == model.transformer.generate(r[None], new, temperature=0)[0, -new:].tolist()


def test_decoding_a_padded_batch_step_by_step_is_its_full_forward():
    model = model_of(STRATEGIES["block"]).double()
    ids, mask = padded(prompts(7), "left")
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :6], attention_mask=mask[:, :6], cache=cache).logits]
        steps += [model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits
                  for t in range(6, ids.shape[1])]
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, dim=1)[real], full[real], rtol=0, atol=1e-10)


def test_a_mask_of_the_wrong_width_is_refused_in_one_line():
    model = model_of(STRATEGIES["standard"])
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 3\).*\(batch, 4\)"):
        model(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))


def test_a_padded_row_may_not_reach_past_block_size_but_its_padding_may():
    model = model_of(STRATEGIES["full"])
    block = SHAPE["block_size"]
    ids = torch.ones(2, block + 4, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # row 0: block tokens after 4 pads, positions 0 .. block - 1
    mask[1, :5] = 0
    with torch.no_grad():
        assert model(ids[:, :], attention_mask=torch.cat([mask[:1], mask[1:]]), use_cache=False).logits.shape[1] \
            == block + 4
    with pytest.raises(ValueError, match=f"exceeds block_size={block}"):
        model(ids[:, :], attention_mask=torch.ones_like(ids), use_cache=False)
