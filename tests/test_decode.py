"""decode/loop.py: one loop for 1 or N rows, greedy or sampled, plain or speculative; the taps of
every committed token kept on request (CPU, fp32, tiny random models)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from dflash_trainer.config import SamplingConfig
from dflash_trainer.decode.loop import decode
from dflash_trainer.models.target import TargetModel
from test_specdecode import (
    LAYER_IDS,
    OracleDrafter,
    TokenHead,
    ar_generate,
    full_taps,
    side,
    tiny_target,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 127, (int(l),), generator=g).tolist() for l in [3, 9, 5, 12][:n]]


@pytest.mark.parametrize(
    "sampler",
    [SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.8)],
    ids=["greedy", "sampled"],
)
def test_a_batch_decodes_each_row_as_it_would_alone(sampler):
    """Left padding, rows leaving the batch and per-row seeds change no row's tokens."""
    target = side(tiny_target("llama"))
    prompts, seeds = _prompts(4), [11, 12, 13, 14]
    stop = [5]
    batch = decode(target, prompts, 16, sampler, seeds=seeds, stop_ids=stop)
    for p, s, r in zip(prompts, seeds, batch):
        alone = decode(target, [p], 16, sampler, seeds=[s], stop_ids=stop)[0]
        assert r.tokens == alone.tokens and r.stopped == alone.stopped
        assert r.acceptance_lengths == [1] * (len(r.tokens) - 1)
    if sampler.greedy:  # and a one-row greedy decode is today's AR loop
        for p, r in zip(prompts, batch):
            assert (
                r.tokens == ar_generate(target.model, torch.tensor([p]), 16, stop_ids=stop).tokens
            )
    else:
        assert len({tuple(r.tokens) for r in batch}) == 4


def test_speculative_decoding_refuses_a_batch():
    target = side(tiny_target("llama"))
    drafter = OracleDrafter([], 3, 4)
    with pytest.raises(ValueError, match="decodes one prompt at a time, got 2"):
        decode(target, _prompts(2), 8, drafter=drafter, block_size=4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_kept_features_are_the_taps_of_prompt_and_answer(kind):
    """keep_features: the target's taps of the prompt and of every committed token, as one
    forward over prompt + answer gives them. Bit for bit only where the computation has the same
    shape (the prompt's taps are its prefill's): CPU GEMMs round a row differently with the row
    count (one nn.Linear, fp32: 2.4e-7 between M=1 and M=9), so the one-token and block forwards
    against the KV cache, and a longer full pass, agree at fp32 rounding, not in every bit."""
    model = tiny_target(kind)
    target = side(model)
    p = _prompts(1, seed=3)[0]
    res = decode(target, [p], 12, keep_features=True)[0]
    ids = torch.tensor([p + res.tokens])
    ref = full_taps(model, ids)[0]
    assert res.features is not None and res.features.shape == ref.shape
    assert_close(res.features[: len(p)], full_taps(model, torch.tensor([p]))[0], rtol=0, atol=0)
    tol = dict(rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    assert_close(res.features, ref, **tol)
    # a row that stops early, in a batch, still gets every committed token's taps
    rows = decode(target, [p, [7, 8]], 12, stop_ids=[res.tokens[3]], keep_features=True)
    assert rows[0].stopped and rows[0].tokens == res.tokens[:4]
    assert_close(rows[0].features, ref[: len(p) + 4], **tol)
    assert rows[1].features.shape[0] == 2 + len(rows[1].tokens)
    # speculative: the verify passes' taps of the committed positions
    drafter = OracleDrafter(res.tokens, len(p), 8, p_wrong=0.3)
    target.lm_head = TokenHead()  # the oracle's hidden states name its drafts
    spec = decode(target, [p], 12, drafter=drafter, block_size=4, keep_features=True)[0]
    assert spec.tokens == res.tokens and max(spec.acceptance_lengths) > 1
    assert_close(spec.features, ref, **tol)


def test_layer_ids_of_the_fixture():
    assert LAYER_IDS == side(tiny_target("llama")).layer_ids


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3"])
def test_rows_prefilled_alone_equal_the_padded_batch(family, monkeypatch):
    """Prompts of different lengths are prefilled one at a time into a left-padded cache
    (no pad position computed): the tokens and kept taps equal the padded batch's prefill, for
    every family; those with sliding-window layers (Mistral, Gemma 3) take the padded batch."""
    from dflash_trainer.decode import loop
    from dflash_trainer.models.kv_cache import all_growing, new_kv_cache
    from families import tiny_family_model

    model = tiny_family_model(family)
    target = TargetModel.from_hf(model, None, [0, 2])
    prompts = [[7, 9, 11], list(range(3, 40)), [5] * 12, list(range(20, 29))]
    alone = decode(target, prompts, 12, stop_ids=[], keep_features=True)
    monkeypatch.setattr(loop, "all_growing", lambda cache: False)  # the padded batch
    padded = decode(target, prompts, 12, stop_ids=[], keep_features=True)
    assert [r.tokens for r in alone] == [r.tokens for r in padded]
    for a, p in zip(alone, padded):
        assert a.features is not None and p.features is not None
        assert_close(a.features, p.features, rtol=1e-4, atol=1e-4)
    assert all_growing(new_kv_cache(model)) is (family not in ("mistral", "gemma3"))
