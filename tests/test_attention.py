"""Training attention: split and flex against the dense boolean-mask reference (method §2.3)."""

import shutil

import pytest
import torch

from dflash_trainer.models import attention as A

BS = 4


def _inputs(B=3, hq=4, hkv=2, N=6, S=13, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, hq, N * BS, d, generator=g, dtype=dtype)
    k = torch.randn(B, hkv, S + N * BS, d, generator=g, dtype=dtype)
    v = torch.randn(B, hkv, S + N * BS, d, generator=g, dtype=dtype)
    # Row 0: overlapping anchors (spacing < bs) incl. anchor 0 (no visible context at all).
    # Row 1: 4 valid blocks + 2 padding blocks. Row 2: a fully padded row.
    anchors = torch.tensor([[0, 1, 3, 4, 6, 12], [2, 5, 7, 11, 0, 0], [0, 0, 0, 0, 0, 0]])
    valid = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0], [0] * 6]).bool()
    return q, k, v, anchors[:B], valid[:B]


def test_dense_mask_matches_definition():
    _, k, _, anchors, valid = _inputs()
    S = k.shape[2] - anchors.shape[1] * BS
    m = A.dense_mask(anchors, valid, BS, S)
    B, Q, KV = m.shape
    for b in range(B):
        for qi in range(Q):
            j = qi // BS
            for kv in range(KV):
                if not valid[b, j]:
                    want = False
                elif kv < S:
                    want = kv < anchors[b, j]
                else:
                    want = (kv - S) // BS == j
                assert bool(m[b, qi, kv]) == want, (b, qi, kv)


@pytest.mark.parametrize("chunk_elems", [1 << 24, 1])  # one chunk / one block per chunk
def test_split_matches_dense_values_and_grads(monkeypatch, chunk_elems):
    monkeypatch.setattr(A, "_SPLIT_CHUNK_ELEMS", chunk_elems)
    q, k, v, anchors, valid = _inputs()
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    leaves2 = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = A.dense_attention(*leaves, anchors, valid, BS)
    out = A.split_attention(*leaves2, anchors, valid, BS)
    torch.testing.assert_close(out, ref)
    w = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * w).sum(), leaves)
    g_out = torch.autograd.grad((out * w).sum(), leaves2)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b)


def test_padding_blocks_are_zero_and_finite():
    q, k, v, anchors, valid = _inputs()
    for fn in (A.dense_attention, A.split_attention):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves, anchors, valid, BS)
        keep = valid.repeat_interleave(BS, dim=1)[:, None, :, None]
        assert torch.isfinite(out).all()
        assert (out * ~keep).abs().max() == 0  # padding blocks output exactly zero
        assert out[0].abs().sum() > 0  # ... and valid ones do not
        grads = torch.autograd.grad(out.sum(), leaves)
        assert all(torch.isfinite(g).all() for g in grads)
        assert grads[0][2].abs().max() == 0  # fully padded row: no gradient


def test_block_sees_only_its_prefix_and_own_block():
    """Changing context at/after the anchor or other blocks' keys leaves a block unchanged."""
    q, k, v, anchors, valid = _inputs()
    S = k.shape[2] - anchors.shape[1] * BS
    b, j = 0, 2  # anchor 3; overlaps blocks 1 and 3
    a = int(anchors[b, j])
    base = A.split_attention(q, k, v, anchors, valid, BS)
    k2, v2 = k.clone(), v.clone()
    k2[b, :, a:S] += 5.0
    v2[b, :, a:S] -= 3.0
    others = [S + i for i in range(anchors.shape[1] * BS) if i // BS != j]
    k2[b, :, others] = torch.randn_like(k2[b, :, others])
    v2[b, :, others] = torch.randn_like(v2[b, :, others])
    out = A.split_attention(q, k2, v2, anchors, valid, BS)
    sl = slice(j * BS, (j + 1) * BS)
    torch.testing.assert_close(out[b, :, sl], base[b, :, sl])
    # The test can fail: a change strictly before the anchor does move the block.
    k3 = k.clone()
    k3[b, :, a - 1] += 5.0
    out3 = A.split_attention(q, k3, v, anchors, valid, BS)
    assert (out3[b, :, sl] - base[b, :, sl]).abs().max() > 1e-4


def test_split_bf16_close_to_fp32():
    q, k, v, anchors, valid = _inputs()
    ref = A.dense_attention(q, k, v, anchors, valid, BS)
    out = A.split_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), anchors, valid, BS)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_resolve_impl():
    assert A.resolve_impl("auto", "cpu") == "split"
    assert A.resolve_impl("dense", "cpu") == "dense"
    with pytest.raises(ValueError):
        A.resolve_impl("eager", "cpu")
    with pytest.raises(ValueError, match="CUDA"):  # CPU flex has no backward
        A.resolve_impl("flex", "cpu")


@pytest.mark.skipif(not A.flex_available(), reason="FlexAttention not importable")
def test_flex_mask_mod_matches_dense_eager_cpu():
    """Eager (uncompiled) flex runs forward on CPU: checks the mask_mod against the reference."""
    import torch.nn.attention.flex_attention as FA

    q, k, v, anchors, valid = _inputs(hq=2, hkv=2)
    ref = A.dense_attention(q, k, v, anchors, valid, BS)
    built, real = [], FA.create_block_mask
    cache: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FA, "create_block_mask", lambda *a, **k: built.append(1) or real(*a, **k))
        with pytest.warns(UserWarning):
            for _ in range(2):  # two layers of one forward share the BlockMask
                out = A.flex_block_attention(
                    q, k, v, anchors, valid, BS, compile=False, mask_cache=cache
                )
    torch.testing.assert_close(out, ref)
    assert len(built) == 1


@pytest.mark.skipif(
    not A.flex_available() or shutil.which("g++") is None,
    reason="compiled FlexAttention on CPU needs inductor's C++ compiler",
)
def test_flex_compiled_forward_matches_dense_cpu():
    """The compiled flex kernel (inductor, CPU) with our BlockMask, GQA included, against dense.

    CPU flex has no backward and inductor cannot compile create_block_mask on CPU, so the block
    mask is built eagerly here; on CUDA both are compiled (test below)."""
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v, anchors, valid = _inputs(hq=4, hkv=2, N=6, S=13, d=16)
    S = k.shape[2] - q.shape[2]
    ref = A.dense_attention(q, k, v, anchors, valid, BS)
    bm = create_block_mask(
        A.flex_mask_mod(anchors, valid, BS, S),
        q.shape[0],
        None,
        q.shape[2],
        k.shape[2],
        device="cpu",
        _compile=False,
    )
    out = A._compiled_flex()(q, k, v, block_mask=bm, enable_gqa=True)
    keep = valid.repeat_interleave(BS, dim=1)[:, None, :, None]
    torch.testing.assert_close(out * keep, ref)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not A.flex_available(),
    reason="compiled FlexAttention needs CUDA",
)
def test_flex_matches_dense_cuda():
    q, k, v, anchors, valid = (t.cuda() for t in _inputs(N=6, S=13, d=16))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    leaves2 = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = A.dense_attention(*leaves, anchors, valid, BS)
    out = A.flex_block_attention(*leaves2, anchors, valid, BS)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    g_ref = torch.autograd.grad(ref.sum(), leaves)
    g_out = torch.autograd.grad(out.sum(), leaves2)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
