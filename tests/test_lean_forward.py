"""models/lean_forward.py: the lean decoding forward against transformers' forward, family by
family, through every call the decode loop makes (prefill, single steps, verify blocks, a
left-padded batch, a crop), and the decode loop's tokens with and without it."""

import pytest
import torch

from dflash_trainer.decode.loop import decode
from dflash_trainer.models import packed_linear
from dflash_trainer.models.kv_cache import left_padded, new_kv_cache
from dflash_trainer.models.lean_forward import LeanForward, lean_forward, unsupported
from dflash_trainer.models.target import TargetModel
from families import tiny_family_model

pytestmark = pytest.mark.skipif(
    not packed_linear.available(), reason="no oneDNN in this torch build"
)

LEAN = ("llama", "llama3", "qwen2", "qwen3", "mistral")


def _target(family: str) -> TargetModel:
    # init_std 0.3: activations far from zero, so a wrong sign or scale shows. Mistral without
    # its window (v0.3 and later); a windowed one keeps transformers' forward (test below).
    shape = {"sliding_window": None} if family == "mistral" else {}
    model = tiny_family_model(family, init_std=0.3, **shape)
    return TargetModel.from_hf(model.eval(), None, [0, 2], family)


def _both(t: TargetModel, lean: LeanForward, ids, pos, caches, mask=None, keep=0):
    """The same call through transformers' forward and the lean one, each on its own cache."""
    want = t.forward(ids, pos, caches[0], taps=True, attention_mask=mask, logits_to_keep=keep)
    with torch.no_grad():
        got = lean(ids, pos, caches[1], taps=True, attention_mask=mask, logits_to_keep=keep)
    for g, w in zip(got, want):
        scale = float(w.abs().max())
        torch.testing.assert_close(g, w, atol=1e-5 * scale, rtol=1e-5)
    assert caches[0].get_seq_length() == caches[1].get_seq_length()
    return want


@pytest.mark.parametrize("family", LEAN)
def test_every_decoding_call_matches_transformers(family):
    t = _target(family)
    assert unsupported(t.model) is None
    lean = LeanForward(t.model, t.layer_ids)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 160, (1, 21), generator=g)
    caches = [new_kv_cache(t.model), new_kv_cache(t.model)]
    _both(t, lean, prompt, torch.arange(21)[None], caches, keep=1)  # prefill, last logits
    for p in range(21, 25):  # single steps
        _both(t, lean, torch.randint(3, 160, (1, 1), generator=g), torch.tensor([[p]]), caches)
    block = torch.randint(3, 160, (1, 6), generator=g)  # a verify block, then rejected drafts
    _both(t, lean, block, torch.arange(25, 31)[None], caches)
    for c in caches:
        c.crop(-4)
    _both(t, lean, block[:, 2:5], torch.arange(27, 30)[None], caches)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_left_padded_batch_matches_transformers(family):
    """Rows of different lengths prefilled one at a time into a left-padded cache (the decode
    loop's batch), then steps with the padding mask, one position and a block of two."""
    t = _target(family)
    lean = LeanForward(t.model, t.layer_ids)
    lens = [7, 12, 4]
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 160, (1, n), generator=g) for n in lens]
    per = [[new_kv_cache(t.model) for _ in rows] for _ in range(2)]
    for r, c0, c1 in zip(rows, *per):
        _both(t, lean, r, torch.arange(r.shape[1])[None], [c0, c1], keep=1)
    caches = [left_padded(per[0], 12), left_padded(per[1], 12)]
    mask = torch.tensor([[0] * (12 - n) + [1] * n for n in lens])
    pos = torch.tensor(lens)[:, None]
    for q in (1, 2, 1):
        mask = torch.cat([mask, torch.ones(3, q, dtype=torch.long)], 1)
        ids = torch.randint(3, 160, (3, q), generator=g)
        _both(t, lean, ids, pos + torch.arange(q)[None], caches, mask=mask)
        pos = pos + q


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_decode_loop_gives_the_same_tokens_and_taps_inside_decoding(family):
    """Greedy through the loop (a batch of three, taps kept) outside `decoding` (transformers'
    forward, default kernels) and inside it (the lean forward): identical tokens, taps close."""
    t = _target(family)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 160, (n,), generator=g).tolist() for n in (9, 5, 13)]
    plain = decode(t, prompts, 20, keep_features=True)
    with t.decoding():
        assert t._lean is not None
        lean = decode(t, prompts, 20, keep_features=True)
    assert t._lean is None
    assert [r.tokens for r in lean] == [r.tokens for r in plain]
    for a, b in zip(lean, plain):
        scale = float(b.features.abs().max())
        torch.testing.assert_close(a.features, b.features, atol=1e-5 * scale, rtol=1e-5)


@pytest.mark.parametrize("family", ["gemma3", "phi3", "qwen3_moe", "mistral"])
def test_other_families_keep_transformers_forward(family):
    """Gemma 3 (offset norms, windows), Phi-3 (fused projections), an MoE, a windowed Mistral."""
    t = TargetModel.from_hf(tiny_family_model(family).eval(), None, [0, 2], family)
    assert unsupported(t.model) is not None
    assert lean_forward(t.model, t.layer_ids) is None
    with t.decoding():
        assert t._lean is None


def test_bfloat16_and_packed_off_keep_transformers_forward():
    t = _target("llama")
    with t.decoding(packed=False):
        assert t._lean is None
    t16 = t.cast(torch.bfloat16)
    assert "float32" in str(unsupported(t16.model))
    with t16.decoding():
        assert t16._lean is None
