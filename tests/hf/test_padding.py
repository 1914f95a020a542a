"""Padded batches in attnres.hf: every strategy computes a padded row as it computes the prompt alone:
its logits at every real position with left or right padding (a forward pass, with and without a
cache), and its greedy tokens in a batched `generate()` with left padding, as lm-eval's
`generate_until` and any batched `generate()` need; Block AttnRes's step-by-step decoding of a
left-padded batch is its full forward. Right padding in `generate()`, a row with no token and a
mask that is not (batch, cached + new tokens) are refused in one line."""

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
        # a prefill of 9 columns: every row has a token in it (a row of padding only is an empty prompt)
        steps = [model(ids[:, :9], attention_mask=mask[:, :9], cache=cache).logits]
        steps += [model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits
                  for t in range(9, ids.shape[1])]
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, dim=1)[real], full[real], rtol=0, atol=1e-10)


@pytest.mark.parametrize("zeros", [False, True], ids=["all-ones", "with-zeros"])
@pytest.mark.parametrize("shape", [(2, 3), (2, 5), (3, 4), (4,)], ids=["T-1", "T+1", "B+1", "1-D"])
def test_a_mask_of_the_wrong_shape_is_refused_in_one_line(shape, zeros):
    model = model_of(STRATEGIES["standard"])
    mask = torch.ones(shape, dtype=torch.long)
    if zeros:
        mask[..., 0] = 0
    want = rf"attention_mask has shape \({', '.join(map(str, shape))},?\); .*\(batch, cached \+ new tokens\) = \(2, 4\)"
    for use_cache in (False, True):
        with pytest.raises(ValueError, match=want) as err:
            model(torch.ones(2, 4, dtype=torch.long), attention_mask=mask, use_cache=use_cache)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=want):
        model.generate(torch.ones(2, 4, dtype=torch.long), attention_mask=mask, max_new_tokens=2, pad_token_id=PAD)


def test_a_row_with_no_token_is_refused_as_an_empty_prompt_is():
    model = model_of(STRATEGIES["block"])
    ids, mask = padded(prompts(), "left")
    mask[1] = 0
    with pytest.raises(ValueError, match="an empty prompt"):
        model.generate(torch.ones(1, 0, dtype=torch.long), max_new_tokens=2, pad_token_id=PAD)
    with pytest.raises(ValueError, match="row 1 of attention_mask is all zeros: an empty prompt"):
        model(ids, attention_mask=mask)
    with pytest.raises(ValueError, match="row 1 of attention_mask is all zeros: an empty prompt"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=PAD)


def test_generation_refuses_right_padding_in_one_line():
    """generate() continues every row from its last column: a right-padded row would continue from a pad."""
    model = model_of(STRATEGIES["block"])
    ids, mask = padded(prompts(6), "right")
    with pytest.raises(ValueError, match=r"right-padded batch \(row 0 ends in padding\).*padding_side='left'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    left_ids, left_mask = padded(prompts(6), "left")
    assert model.generate(left_ids, attention_mask=left_mask, max_new_tokens=2, do_sample=False,
                          pad_token_id=PAD).shape == (len(LENGTHS), left_ids.shape[1] + 2)


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
