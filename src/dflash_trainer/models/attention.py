"""Training attention of the DFlash drafter: many blocks in one pass (method doc §2.3).

Shapes (legend: B batch, hq/hkv query/kv heads, N blocks per row, bs block size, S context length,
Q = N*bs block tokens, d head dim):

    q          [B, hq,  Q,     d]   queries of the block tokens only: all bs slots of each block, or
                                    (dense and split) its first qs < bs slots, Q = N*qs
    k, v       [B, hkv, S + Q, d]   keys/values = [projected context (S) ; block tokens (Q)]
    anchors    [B, N]   long        block j's slot 0 sits at absolute position anchors[b, j]
    block_valid[B, N]   bool        False = padding block (row had fewer valid anchors than N)

Visibility for query slot o of block j:
    context key kv (kv < S):  kv < anchors[b, j]      (strictly before: pitfall §5.2)
    block key   (kv >= S):    same block j, both directions (no causal constraint: §5.3)
    padding block:            nothing; its output is exactly 0 (never NaN: §5.7)

Three implementations behind one function, ``block_attention(..., impl=...)``:
    dense  reference: one boolean [Q, S+Q] mask and an explicit masked softmax.
    split  CPU-efficient: a context part with a per-block prefix limit and a block-local part with
           [B, h, N, bs, bs] scores, merged by log-sum-exp (a shared per-row max). Never builds the
           [Q, Q] block mask; a custom autograd function works a chunk of blocks at a time in both
           passes and keeps only the output and the log-sum-exp for backward (flash-style).
    flex   FlexAttention with a BlockMask built from the mask's structure (H=None, pitfall
           §5.8); CUDA only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch.autograd.function import once_differentiable

IMPLS = ("dense", "split", "flex")

# Context-score chunk: at most this many (query x context-key) score elements per chunk of
# blocks, so the transient fp32 scores stay ~4 MiB whatever N and S are. Measured at
# bench/bench_attention.py's full shape (hidden 576, sequence 1024, 256 anchors, block 16) on one
# thread: 2^20 is faster than both 2^18 (per-op overhead) and 2^22-2^24 (the
# elementwise passes fall out of cache).
_SPLIT_CHUNK_ELEMS = 1 << 20


def resolve_impl(impl: str, device: torch.device | str) -> str:
    """'auto' = flex on CUDA (when importable), split elsewhere."""
    if impl == "auto":
        return "flex" if torch.device(device).type == "cuda" and flex_available() else "split"
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of auto/{'/'.join(IMPLS)}, got {impl!r}")
    if impl == "flex" and torch.device(device).type != "cuda":
        raise ValueError(
            f"drafter.attention=flex needs CUDA (FlexAttention has no backward on "
            f"{torch.device(device).type}); use split or auto"
        )
    return impl


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    anchors: torch.Tensor,
    block_valid: torch.Tensor,
    block_size: int,
    impl: str = "split",
    scale: float | None = None,
    mask_cache: dict | None = None,
) -> torch.Tensor:
    """Attention of block queries over [context ; blocks] under the DFlash training mask.

    Returns [B, hq, Q, d] in q's dtype. Padding blocks give zeros. `mask_cache`: a dict shared by
    the layers of one forward, so the mask (dense) or BlockMask (flex) is built once per forward,
    not once per layer; the split form needs none. q may hold only the first qs slots of every
    block (Q = N*qs; dense and split): their outputs are those the full set of queries would give,
    as every block's keys are all there.
    """
    impl = resolve_impl(impl, q.device)
    if impl == "split":
        return split_attention(q, k, v, anchors, block_valid, block_size, scale)
    fn = dense_attention if impl == "dense" else flex_block_attention
    return fn(q, k, v, anchors, block_valid, block_size, scale, mask_cache=mask_cache)


def _check(q, k, anchors, block_size):
    """(B, hq, N, S, d, qs): qs = query slots per block (block_size, or a prefix of the slots)."""
    B, hq, Q, d = q.shape
    N = anchors.shape[1]
    qs = Q // max(N, 1)
    assert Q == N * qs and 0 < qs <= block_size, (
        f"q has {Q} tokens, expected N*qs = {N}*qs with 0 < qs <= {block_size}"
    )
    assert hq % k.shape[1] == 0, "query heads must be a multiple of kv heads"
    S = k.shape[2] - N * block_size
    assert S >= 0, "k/v must hold [context ; block tokens]"
    return B, hq, N, S, d, qs


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, hkv, L, d] -> [B, hkv*groups, L, d] with query head h using kv head h // groups (GQA).
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


# ------------------------------------------------------------------------------------------------
# (a) dense reference
# ------------------------------------------------------------------------------------------------


def dense_mask(
    anchors: torch.Tensor,
    block_valid: torch.Tensor,
    block_size: int,
    context_len: int,
    query_slots: int | None = None,
) -> torch.Tensor:
    """The boolean "may attend" mask [B, Q, S+N*bs] of §2.3 (padding blocks: all False), for the
    first `query_slots` (default all) slots of every block as queries (Q = N*query_slots)."""
    B, N = anchors.shape
    dev = anchors.device
    qs = query_slots or block_size
    q_block = torch.arange(N * qs, device=dev) // qs  # [Q]
    kv = torch.arange(context_len + N * block_size, device=dev)  # [S+Q]
    q_anchor = anchors[:, q_block]  # [B, Q]
    ctx_ok = (kv[None, None, :] < context_len) & (kv[None, None, :] < q_anchor[:, :, None])
    kv_block = (kv - context_len).div(block_size, rounding_mode="floor")
    blk_ok = (kv[None, None, :] >= context_len) & (
        kv_block[None, None, :] == q_block[None, :, None]
    )
    return (ctx_ok | blk_ok) & block_valid[:, q_block][:, :, None]


def _cached(mask_cache: dict | None, key: str, build):
    if mask_cache is None:
        return build()
    if key not in mask_cache:
        mask_cache[key] = build()
    return mask_cache[key]


def dense_attention(q, k, v, anchors, block_valid, block_size, scale=None, mask_cache=None):
    """Reference: explicit [Q, S+Q] scores and boolean mask. Memory O(Q*(S+Q)); for tests/bench."""
    B, hq, N, S, d, qs = _check(q, k, anchors, block_size)
    groups = hq // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    mask = _cached(
        mask_cache,
        f"dense{qs}",  # [B,1,Q,S+N*bs]
        lambda: dense_mask(anchors, block_valid, block_size, S, qs)[:, None],
    )
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    # Fully masked rows (padding blocks) would give softmax(-inf...) = NaN. Replace their -inf row
    # by zeros before the softmax and zero their output afterwards: zeros out, zero gradients.
    row_any = mask.any(dim=-1, keepdim=True)  # [B,1,Q,1]
    scores = torch.where(row_any, scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float()) * row_any
    return out.to(q.dtype)


# ------------------------------------------------------------------------------------------------
# (b) split: context prefix + block-local, merged by log-sum-exp
# ------------------------------------------------------------------------------------------------


def split_attention(q, k, v, anchors, block_valid, block_size, scale=None):
    """Context part (kv < anchor) + block-local part, merged by log-sum-exp; flash-style memory.

    Per query row, with s_c the context scores and s_b the block scores:
        lse = log(sum exp s_c + sum exp s_b),   out = sum exp(s - lse) v   over both key sets,
    i.e. the softmax over the union, computed as two partial sums that share one row maximum.
    Each valid block sees at least its own bs keys, so lse is finite and no row is empty. A padding
    block is let to see its own block (finite, harmless) and its output and gradients are
    multiplied by 0, so it is exactly zero.

    Forward keeps only out and lse (fp32, the size of q); backward recomputes each chunk's scores
    once and forms the gradients by hand (dS = P * (dP - rowsum(dO * O))), so neither pass holds
    more than one chunk of [rows, S] context scores, and nothing is recomputed twice (activation
    checkpointing would rerun the whole forward of the chunk and then autograd's backward).
    """
    _check(q, k, anchors, block_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _SplitAttention.apply(q, k, v, anchors, block_valid, block_size, scale)


def _split_chunk_blocks(B, hq, bs, S) -> int:
    return max(1, (_SPLIT_CHUNK_ELEMS * _chunk_scale) // (B * hq * bs * max(S, bs)))


_chunk_scale = 1


@contextlib.contextmanager
def coarser_split_chunks(factor: int):
    """Split attention in chunks `factor` times larger while inside: for the memory plan's fake
    step (run/memory_plan.py), which pays per op, not per element. Its chunk temporaries grow by
    the same factor (each ~4 MiB at 1), which the plan then counts. Start-up only: the scale is
    module state, not meant for a run's threads."""
    global _chunk_scale
    before, _chunk_scale = _chunk_scale, max(1, int(factor))
    try:
        yield
    finally:
        _chunk_scale = before


class _SplitAttention(torch.autograd.Function):
    """Internal layout: [B, hkv, N, g, qs, ...] (g = query heads per kv head, qs = query slots
    per block), so a chunk of blocks is a contiguous slice and every product is one batched
    matmul over B*hkv with n*g*qs rows: GQA needs no repeat of k/v."""

    @staticmethod
    def forward(ctx, q, k, v, anchors, block_valid, block_size, scale):
        B, hq, N, S, d, qs = _check(q, k, anchors, block_size)
        hkv, bs = k.shape[1], block_size
        g = hq // hkv
        f32 = torch.float32  # fp32 scores and softmax statistics whatever the input dtype
        with torch.autocast(q.device.type, enabled=False):
            qp = _to_blocks(q, hkv, g, N, qs)  # [B,hkv,N,g,qs,d]
            k_ctx, v_ctx, k_blk, v_blk = _split_kv(k, v, S, N, bs)
            out = torch.empty(B, hkv, N, g, qs, d, dtype=f32, device=q.device)
            lse = torch.empty(B, hkv, N, g, qs, 1, dtype=f32, device=q.device)
            chunk = _split_chunk_blocks(B, hq, bs, S)
            for c0 in range(0, N, chunk):
                c1 = min(N, c0 + chunk)
                qc = qp[:, :, c0:c1] * scale  # [B,hkv,n,g,qs,d]
                s_blk = _block_scores(qc, k_blk[:, :, c0:c1])  # [..,g,qs,bs]
                m = s_blk.amax(dim=-1, keepdim=True)
                if S > 0:
                    s_ctx = _ctx_scores(qc, k_ctx, anchors[:, c0:c1])  # [..,g,qs,S]
                    m = torch.maximum(m, s_ctx.amax(dim=-1, keepdim=True))
                p_blk = s_blk.sub_(m).exp_()
                num = torch.matmul(p_blk.flatten(3, 4), v_blk[:, :, c0:c1]).view_as(qc)
                den = p_blk.sum(dim=-1, keepdim=True)
                if S > 0:
                    p_ctx = s_ctx.sub_(m).exp_()  # masked -> 0
                    num += torch.matmul(p_ctx.flatten(2, 4), v_ctx).view_as(qc)
                    den += p_ctx.sum(dim=-1, keepdim=True)
                out[:, :, c0:c1] = num.div_(den)
                lse[:, :, c0:c1] = den.log_().add_(m)
            out.mul_(_valid_view(block_valid))
        ctx.save_for_backward(q, k, v, anchors, block_valid, out, lse)
        ctx.block_size, ctx.scale = bs, scale
        return _from_blocks(out, q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, anchors, block_valid, out, lse = ctx.saved_tensors
        bs, scale = ctx.block_size, ctx.scale
        B, hq, N, S, d, qs = _check(q, k, anchors, bs)
        hkv = k.shape[1]
        g = hq // hkv
        f32 = torch.float32
        with torch.autocast(q.device.type, enabled=False):
            qp = _to_blocks(q, hkv, g, N, qs)
            do = _to_blocks(dout, hkv, g, N, qs).mul(_valid_view(block_valid))  # pad blocks: 0
            D = (do * out).sum(dim=-1, keepdim=True)  # [..,g,qs,1]
            k_ctx, v_ctx, k_blk, v_blk = _split_kv(k, v, S, N, bs)
            dq = torch.empty(B, hkv, N, g, qs, d, dtype=f32, device=q.device)
            dk_ctx = torch.zeros(B, hkv, S, d, dtype=f32, device=q.device)
            dv_ctx = torch.zeros(B, hkv, S, d, dtype=f32, device=q.device)
            dk_blk = torch.empty(B, hkv, N, bs, d, dtype=f32, device=q.device)
            dv_blk = torch.empty(B, hkv, N, bs, d, dtype=f32, device=q.device)
            chunk = _split_chunk_blocks(B, hq, bs, S)
            for c0 in range(0, N, chunk):
                c1 = min(N, c0 + chunk)
                qc = qp[:, :, c0:c1] * scale
                doc, Dc, lc = do[:, :, c0:c1], D[:, :, c0:c1], lse[:, :, c0:c1]
                kb, vb = k_blk[:, :, c0:c1], v_blk[:, :, c0:c1]
                # block-local part: [B,hkv,n,(g qs),bs]
                p = _block_scores(qc, kb).sub_(lc).exp_().flatten(3, 4)
                dv_blk[:, :, c0:c1] = torch.matmul(p.transpose(-1, -2), doc.flatten(3, 4))
                ds = torch.matmul(doc.flatten(3, 4), vb.transpose(-1, -2))
                ds = ds.sub_(Dc.flatten(3, 4)).mul_(p)
                dqc = torch.matmul(ds, kb).view_as(qc)
                dk_blk[:, :, c0:c1] = torch.matmul(ds.transpose(-1, -2), qc.flatten(3, 4))
                if S > 0:  # [B,hkv,(n g qs),S]
                    p = _ctx_scores(qc, k_ctx, anchors[:, c0:c1]).sub_(lc).exp_().flatten(2, 4)
                    dof = doc.flatten(2, 4)
                    dv_ctx += torch.matmul(p.transpose(-1, -2), dof)
                    ds = torch.matmul(dof, v_ctx.transpose(-1, -2))
                    ds = ds.sub_(Dc.flatten(2, 4)).mul_(p)
                    dqc += torch.matmul(ds, k_ctx).view_as(qc)
                    dk_ctx += torch.matmul(ds.transpose(-1, -2), qc.flatten(2, 4))
                dq[:, :, c0:c1] = dqc.mul_(scale)
            dq = _from_blocks(dq, q.dtype)
            dk = torch.cat([dk_ctx, dk_blk.flatten(2, 3)], dim=2).to(k.dtype)
            dv = torch.cat([dv_ctx, dv_blk.flatten(2, 3)], dim=2).to(v.dtype)
        return dq, dk, dv, None, None, None, None


def _split_kv(k, v, S, N, bs):
    """[B, hkv, S + N*bs, d] -> fp32 context k/v [B,hkv,S,d] and block k/v [B,hkv,N,bs,d]."""
    B, hkv, _, d = k.shape
    kf, vf = k.to(torch.float32), v.to(torch.float32)
    return (
        kf[:, :, :S],
        vf[:, :, :S],
        kf[:, :, S:].reshape(B, hkv, N, bs, d),
        vf[:, :, S:].reshape(B, hkv, N, bs, d),
    )


def _to_blocks(x, hkv, g, N, qs):
    """[B, hq, N*qs, d] (any dtype) -> fp32 [B, hkv, N, g, qs, d], contiguous."""
    B, _, _, d = x.shape
    return x.reshape(B, hkv, g, N, qs, d).transpose(2, 3).to(torch.float32).contiguous()


def _from_blocks(x, dtype):
    """fp32 [B, hkv, N, g, qs, d] -> [B, hq, N*qs, d] in dtype."""
    B, hkv, N, g, qs, d = x.shape
    return x.transpose(2, 3).reshape(B, hkv * g, N * qs, d).to(dtype)


def _valid_view(block_valid):
    return block_valid[:, None, :, None, None, None].to(torch.float32)


def _block_scores(qc, kb):
    """qc [B,hkv,n,g,qs,d] (scaled), kb [B,hkv,n,bs,d] -> [B,hkv,n,g,qs,bs]."""
    return torch.matmul(qc.flatten(3, 4), kb.transpose(-1, -2)).view(*qc.shape[:-1], kb.shape[3])


def _ctx_scores(qc, k_ctx, anchors_c):
    """qc [B,hkv,n,g,qs,d] (scaled), k_ctx [B,hkv,S,d] -> [B,hkv,n,g,qs,S], -inf at kv >= anchor."""
    S = k_ctx.shape[2]
    s = torch.matmul(qc.flatten(2, 4), k_ctx.transpose(-1, -2)).view(*qc.shape[:-1], S)
    hidden = torch.arange(S, device=qc.device) >= anchors_c[:, :, None]  # [B,n,S]
    return s.masked_fill_(hidden[:, None, :, None, None, :], float("-inf"))


# ------------------------------------------------------------------------------------------------
# (c) FlexAttention (CUDA)
# ------------------------------------------------------------------------------------------------


@functools.cache
def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention as fa
    except Exception:  # older torch / stripped builds
        return False
    if not hasattr(fa, "BlockMask") or not hasattr(fa.BlockMask, "from_kv_blocks"):
        return False
    # flex_block_mask passes seq_lengths, which older releases' from_kv_blocks lacks: those fall
    # back to the split kernels rather than fail on the first step.
    return "seq_lengths" in inspect.signature(fa.BlockMask.from_kv_blocks).parameters


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Default dynamic mode: padded lengths vary per batch; a static compile per shape would hit
    # the recompile limit.
    return torch.compile(flex_attention)


def flex_mask_mod(
    anchors: torch.Tensor, block_valid: torch.Tensor, block_size: int, context_len: int
):
    """mask_mod(b, h, q_idx, kv_idx) of §2.3 for FlexAttention (same rule as dense_mask)."""
    S, bs = context_len, block_size

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // bs
        ctx_ok = (kv_idx < S) & (kv_idx < anchors[b, blk])
        blk_ok = (kv_idx >= S) & ((kv_idx - S) // bs == blk)
        return (ctx_ok | blk_ok) & block_valid[b, blk]

    return mask_mod


def flex_block_mask(
    anchors: torch.Tensor,
    block_valid: torch.Tensor,
    block_size: int,
    context_len: int,
    q_len: int,
    kv_len: int,
    tile: int = 128,
):
    """The §2.3 BlockMask built from the mask's known structure: no mask_mod evaluation over the
    [Q, S+Q] grid and nothing compiled, only [B, Q] and [B, Q/tile, KV/tile] index arithmetic.

    Why not `create_block_mask`: on an H200 with torch 2.11 its compiled helper (a sort over the
    kv tiles) sent ptxas past five minutes on the drafter's first step and the step never ran;
    uncompiled, it materialises the whole [B, Q, S+Q] grid (GBs at Qwen3-8B's shape).

    Per query row r of block j = r // bs: context tiles entirely before min(anchor_j, S) are
    full, the one it ends in is partial; its own block's keys S + j*bs .. S + (j+1)*bs - 1 fall
    in one or two partial tiles. A tile is full for a query tile only if it is full for every
    row of it (rows past Q and padding blocks make nothing full); partial tiles run mask_mod.
    """
    from torch.nn.attention.flex_attention import BlockMask

    B, N = anchors.shape
    S, bs, dev = context_len, block_size, anchors.device
    nq, nkv = -(-q_len // tile), -(-kv_len // tile)
    rows = torch.arange(nq * tile, device=dev)
    blk = (rows // bs).clamp_max(N - 1)
    live = block_valid[:, blk] & (rows < q_len)  # [B, R]: rows that attend to anything
    seen = torch.where(live, anchors[:, blk].clamp(0, S), 0)  # visible context prefix
    ctx_any = ((seen + tile - 1) // tile).view(B, nq, tile).amax(-1)  # tiles [0, ctx_any)
    ctx_full = (seen // tile).view(B, nq, tile).amin(-1)  # tiles [0, ctx_full) are full
    # scalars, not device tensors made from Python numbers: those would be host-to-device copies
    own_lo = torch.where(live, (S + blk * bs) // tile, nkv).view(B, nq, tile).amin(-1)
    own_hi = torch.where(live, (S + (blk + 1) * bs - 1) // tile, -1).view(B, nq, tile).amax(-1)
    c = torch.arange(nkv, device=dev)
    full = c < ctx_full[..., None]  # [B, nq, nkv]
    partial = (c < ctx_any[..., None]) | ((c >= own_lo[..., None]) & (c <= own_hi[..., None]))
    partial &= ~full

    def ordered(m):  # ascending tile indices of True first, as flex expects
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return m.sum(-1, dtype=torch.int32)[:, None], idx[:, None]

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=tile,
        mask_mod=flex_mask_mod(anchors, block_valid, block_size, S),
        seq_lengths=(q_len, kv_len),
    )


def flex_block_attention(
    q, k, v, anchors, block_valid, block_size, scale=None, compile=True, mask_cache=None
):
    """FlexAttention with a BlockMask built for H=None (broadcast over heads; §5.8) by
    `flex_block_mask`.

    ``compile=False`` runs eager flex (slow, any device): used by CPU tests to check the mask_mod.
    Fully masked rows (padding blocks) come out as zeros from flex itself; multiplying by the
    validity keeps that explicit and independent of the kernel.
    """
    from torch.nn.attention.flex_attention import flex_attention

    B, hq, N, S, d, qs = _check(q, k, anchors, block_size)
    if qs != block_size:
        raise ValueError(
            f"flex attention needs every slot of a block as a query ({qs} of {block_size})"
        )
    Q, KV = q.shape[2], k.shape[2]
    bm = _cached(
        mask_cache,
        "flex",
        lambda: flex_block_mask(anchors, block_valid, block_size, S, Q, KV),
    )
    fn = _compiled_flex() if compile else flex_attention
    enable_gqa = hq != k.shape[1]
    # Under autocast q/k leave the fp32-weighted RMSNorms as fp32 while v is bf16: flex needs one
    # dtype, and v's is the autocast compute dtype.
    q, k = q.to(v.dtype), k.to(v.dtype)
    out = fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=enable_gqa)
    keep = block_valid.repeat_interleave(block_size, dim=1)[:, None, :, None]
    return out * keep.to(out.dtype)
