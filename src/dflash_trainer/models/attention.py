"""Training attention of the DFlash drafter: many blocks in one pass (method doc §2.3).

Shapes (legend: B batch, hq/hkv query/kv heads, N blocks per row, bs block size, S context length,
Q = N*bs block tokens, d head dim):

    q          [B, hq,  Q,     d]   queries of the block tokens only
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
           [Q, Q] block mask; the context scores are produced a chunk of blocks at a time.
    flex   FlexAttention with a compiled BlockMask (H=None, pitfall §5.8); CUDA only.
"""

from __future__ import annotations

import functools

import torch

IMPLS = ("dense", "split", "flex")

# Context-score chunk: at most this many (query x context-key) score elements per chunk of
# blocks, so the transient fp32 scores stay ~64 MiB whatever N and S are.
_SPLIT_CHUNK_ELEMS = 1 << 24


def resolve_impl(impl: str, device: torch.device | str) -> str:
    """'auto' = flex on CUDA (when importable), split elsewhere."""
    if impl == "auto":
        return "flex" if torch.device(device).type == "cuda" and flex_available() else "split"
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of auto/{'/'.join(IMPLS)}, got {impl!r}")
    return impl


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, anchors: torch.Tensor,
                    block_valid: torch.Tensor, block_size: int, impl: str = "split",
                    scale: float | None = None) -> torch.Tensor:
    """Attention of block queries over [context ; blocks] under the DFlash training mask.

    Returns [B, hq, Q, d] in q's dtype. Padding blocks give zeros.
    """
    impl = resolve_impl(impl, q.device)
    fn = {"dense": dense_attention, "split": split_attention, "flex": flex_block_attention}[impl]
    return fn(q, k, v, anchors, block_valid, block_size, scale)


def _check(q, k, anchors, block_size):
    B, hq, Q, d = q.shape
    N = anchors.shape[1]
    assert Q == N * block_size, f"q has {Q} tokens, expected N*bs = {N}*{block_size}"
    assert hq % k.shape[1] == 0, "query heads must be a multiple of kv heads"
    S = k.shape[2] - Q
    assert S >= 0, "k/v must hold [context ; block tokens]"
    return B, hq, N, S, d


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, hkv, L, d] -> [B, hkv*groups, L, d] with query head h using kv head h // groups (GQA).
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


# ------------------------------------------------------------------------------------------------
# (a) dense reference
# ------------------------------------------------------------------------------------------------

def dense_mask(anchors: torch.Tensor, block_valid: torch.Tensor, block_size: int,
               context_len: int) -> torch.Tensor:
    """The boolean "may attend" mask [B, Q, S+Q] of §2.3 (padding blocks: all False)."""
    B, N = anchors.shape
    dev = anchors.device
    q_block = torch.arange(N * block_size, device=dev) // block_size            # [Q]
    kv = torch.arange(context_len + N * block_size, device=dev)                   # [S+Q]
    q_anchor = anchors[:, q_block]                                                # [B, Q]
    ctx_ok = (kv[None, None, :] < context_len) & (kv[None, None, :] < q_anchor[:, :, None])
    kv_block = (kv - context_len).div(block_size, rounding_mode="floor")
    blk_ok = (kv[None, None, :] >= context_len) & (kv_block[None, None, :] == q_block[None, :, None])
    return (ctx_ok | blk_ok) & block_valid[:, q_block][:, :, None]


def dense_attention(q, k, v, anchors, block_valid, block_size, scale=None):
    """Reference: explicit [Q, S+Q] scores and boolean mask. Memory O(Q*(S+Q)); for tests/bench."""
    B, hq, N, S, d = _check(q, k, anchors, block_size)
    groups = hq // k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    mask = dense_mask(anchors, block_valid, block_size, S)[:, None]              # [B,1,Q,S+Q]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    # Fully masked rows (padding blocks) would give softmax(-inf...) = NaN. Replace their -inf row
    # by zeros before the softmax and zero their output afterwards: zeros out, zero gradients.
    row_any = mask.any(dim=-1, keepdim=True)                                      # [B,1,Q,1]
    scores = torch.where(row_any, scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float()) * row_any
    return out.to(q.dtype)


# ------------------------------------------------------------------------------------------------
# (b) split: context prefix + block-local, merged by log-sum-exp
# ------------------------------------------------------------------------------------------------

def split_attention(q, k, v, anchors, block_valid, block_size, scale=None, checkpoint=None):
    """Context part (kv < anchor) + block-local part, merged with one shared per-row max.

    With m = max over both parts (a constant for the gradient, so it is detached):
        out = (sum_ctx e^(s-m) v + sum_blk e^(s-m) v) / (sum_ctx e^(s-m) + sum_blk e^(s-m))
    which is the softmax over the union of both key sets, i.e. the log-sum-exp merge of the two
    partial softmaxes. Each valid block sees at least its own bs block keys, so m is finite and no
    row is empty. A padding block is let to see its own block (finite, harmless) and its output
    is multiplied by 0, so it is exactly zero with zero gradients.

    Rows of different blocks are independent, so the work runs a chunk of blocks at a time; with
    ``checkpoint`` (default: when grad is needed) each chunk is recomputed in backward, so neither
    pass ever holds more than one chunk's [chunk*bs, S] context scores (flash-style memory).
    """
    B, hq, N, S, d = _check(q, k, anchors, block_size)
    hkv = k.shape[1]
    groups = hq // hkv
    bs = block_size
    scale = d ** -0.5 if scale is None else scale
    if checkpoint is None:
        checkpoint = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                  or v.requires_grad)

    # Grouped layout: queries [B, hkv, groups, N, bs, d] so GQA needs no repeat of k/v.
    qg = q.reshape(B, hkv, groups, N, bs, d)
    k_ctx, v_ctx = k[:, :, :S], v[:, :, :S]
    k_blk = k[:, :, S:].reshape(B, hkv, N, bs, d)
    v_blk = v[:, :, S:].reshape(B, hkv, N, bs, d)

    per_block = B * hq * bs * max(S, bs)
    chunk = max(1, min(N, _SPLIT_CHUNK_ELEMS // per_block))
    outs = []
    for c0 in range(0, N, chunk):
        c1 = min(N, c0 + chunk)
        args = (qg[:, :, :, c0:c1], k_ctx, v_ctx, k_blk[:, :, c0:c1], v_blk[:, :, c0:c1],
                anchors[:, c0:c1], block_valid[:, c0:c1])
        if checkpoint:
            o = torch.utils.checkpoint.checkpoint(_split_chunk, *args, scale, use_reentrant=False,
                                                  preserve_rng_state=False)
        else:
            o = _split_chunk(*args, scale)
        outs.append(o)
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return out.reshape(B, hq, N * bs, d)


def _split_chunk(qg, k_ctx, v_ctx, k_blk, v_blk, anchors, block_valid, scale):
    """One chunk of n blocks. qg [B,hkv,g,n,bs,d]; k/v_ctx [B,hkv,S,d]; k/v_blk [B,hkv,n,bs,d]."""
    f32 = torch.float32  # softmax statistics in fp32 whatever the input dtype (bf16 autocast)
    S = k_ctx.shape[2]
    qf = qg.to(f32) * scale                                  # scale the small side, not scores
    s_blk = torch.einsum("bhgnqd,bhnkd->bhgnqk", qf, k_blk.to(f32))                # [..,bs,bs]
    if S > 0:
        s_ctx = torch.einsum("bhgnqd,bhkd->bhgnqk", qf, k_ctx.to(f32))             # [..,bs,S]
        vis = torch.arange(S, device=qg.device)[None, None, :] < anchors[:, :, None]   # [B,n,S]
        s_ctx = s_ctx.masked_fill(~vis[:, None, None, :, None, :], float("-inf"))
    with torch.no_grad():  # the shift m is a constant for the gradient: no graph, nothing saved
        m = s_blk.amax(dim=-1, keepdim=True)
        if S > 0:
            m = torch.maximum(m, s_ctx.amax(dim=-1, keepdim=True))
    p_blk = torch.exp(s_blk - m)
    num = torch.einsum("bhgnqk,bhnkd->bhgnqd", p_blk, v_blk.to(f32))
    den = p_blk.sum(dim=-1, keepdim=True)
    if S > 0:
        p_ctx = torch.exp(s_ctx - m)                                               # masked -> 0
        num = num + torch.einsum("bhgnqk,bhkd->bhgnqd", p_ctx, v_ctx.to(f32))
        den = den + p_ctx.sum(dim=-1, keepdim=True)
    out = (num / den) * block_valid[:, None, None, :, None, None]
    return out.to(qg.dtype)


# ------------------------------------------------------------------------------------------------
# (c) FlexAttention (CUDA)
# ------------------------------------------------------------------------------------------------

@functools.cache
def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention as fa
    except Exception:  # older torch / stripped builds
        return False
    return hasattr(fa, "create_block_mask") and hasattr(fa, "flex_attention")


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    # Default dynamic mode: padded lengths vary per batch; a static compile per shape would hit
    # the recompile limit.
    return torch.compile(flex_attention)


def flex_mask_mod(anchors: torch.Tensor, block_valid: torch.Tensor, block_size: int,
                  context_len: int):
    """mask_mod(b, h, q_idx, kv_idx) of §2.3 for FlexAttention (same rule as dense_mask)."""
    S, bs = context_len, block_size

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // bs
        ctx_ok = (kv_idx < S) & (kv_idx < anchors[b, blk])
        blk_ok = (kv_idx >= S) & ((kv_idx - S) // bs == blk)
        return (ctx_ok | blk_ok) & block_valid[b, blk]

    return mask_mod


def flex_block_attention(q, k, v, anchors, block_valid, block_size, scale=None, compile=True):
    """FlexAttention with a BlockMask built for H=None (broadcast over heads; §5.8).

    ``compile=False`` runs eager flex (slow, any device): used by CPU tests to check the mask_mod.
    Fully masked rows (padding blocks) come out as zeros from flex itself; multiplying by the
    validity keeps that explicit and independent of the kernel.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, hq, N, S, d = _check(q, k, anchors, block_size)
    Q, KV = q.shape[2], k.shape[2]
    mask_mod = flex_mask_mod(anchors, block_valid, block_size, S)
    bm = create_block_mask(mask_mod, B, None, Q, KV, device=q.device, _compile=compile)
    fn = _compiled_flex() if compile else flex_attention
    enable_gqa = hq != k.shape[1]
    # Under autocast q/k leave the fp32-weighted RMSNorms as fp32 while v is bf16: flex needs one
    # dtype, and v's is the autocast compute dtype.
    q, k = q.to(v.dtype), k.to(v.dtype)
    out = fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=enable_gqa)
    keep = block_valid.repeat_interleave(block_size, dim=1)[:, None, :, None]
    return out * keep.to(out.dtype)

