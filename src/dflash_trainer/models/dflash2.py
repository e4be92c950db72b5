"""DFlash2's two additions to the DFlash drafter (docs/dflash2.md): a grouped dynamic causal
convolution around every attention and MLP sublayer, and a low-rank pairwise candidate selector
that rescores each block slot's top-k tokens given the previous slot's choice.

The decoder layer and the drafter stay in models/drafter.py (one backbone); this module holds the
two parts and the selector walk, nothing that knows about layers.

Convolution (per sublayer, identity at init so that a DFlash checkpoint warm-starts it exactly):

    delta = kernel_projection(x)  [.., 2, taps, groups]    (one projection for both sides)
    prepare: x'[t] = sum_o (base[0, o] + delta[t, 0, o, g(c)]) * x[t - o]       (sublayer input)
    finish:  y'[t] = sum_o (base[1, o] + delta[t, 1, o, g(c)]) * y[t - o]       (its output)

with t - o restricted to the same block (o <= slot of t): a slot never sees a later slot, nor
another block. Channel c belongs to group g(c) = c // group_size; the dynamic part is one
coefficient per group, the static part (base_kernel) one per channel.

Selector: score(prev, cand | h) = unary_logit(cand) + <pred[prev] * proj(h), succ[cand]>, over
the top_k unary candidates of each slot; drafting walks the block from the anchor, each slot
conditioned on the token chosen for the slot before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VARIANTS = ("dflash", "dflash2")

# The published DFlash2 drafters' shapes (speculators' defaults for its DFlash2 trainer).
DEFAULT_CONV_KERNEL_SIZE = 2
DEFAULT_CONV_GROUP_SIZE = 16
DEFAULT_SELECTOR_RANK = 256
DEFAULT_SELECTOR_TOP_K = 16


def check_shape(
    hidden_size: int, block_size: int, vocab_size: int, taps: int, group: int, rank: int, k: int
) -> None:
    """ValueError naming the drafter.* key when a DFlash2 shape cannot be built."""
    if taps < 1 or taps > block_size:
        raise ValueError(
            f"conv_kernel_size={taps} must be in 1..block_size ({block_size}): a tap looks back "
            "only at earlier slots of the same block"
        )
    if group < 1 or hidden_size % group:
        raise ValueError(f"conv_group_size={group} must divide hidden_size={hidden_size}")
    if rank < 1:
        raise ValueError(f"selector_rank={rank} must be >= 1")
    if not 1 <= k <= vocab_size:
        raise ValueError(f"selector_top_k={k} must be in 1..vocab_size ({vocab_size})")


def grouped_causal_conv(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int
) -> torch.Tensor:
    """x [B, L, H] (blocks of `block_size` consecutive rows; a last partial block is fine),
    delta [B, L, taps, G] per-row per-group coefficients, base [taps, H] per-channel ones
    -> [B, L, H]: out[t] = sum_o (base[o] + delta[t, o]) * x[t - o] over o <= slot(t)."""
    B, L, H = x.shape
    taps, G = delta.shape[-2], delta.shape[-1]
    xg = x.view(B, L, G, H // G)
    coef = base.to(x.dtype).view(1, 1, taps, G, H // G) + delta.to(x.dtype)[..., None]
    out = coef[:, :, 0] * xg
    slot = torch.arange(L, device=x.device) % block_size
    for o in range(1, taps):
        shifted = F.pad(xg[:, : L - o], (0, 0, 0, 0, o, 0))  # row t holds x[t - o]
        keep = (slot >= o).to(x.dtype).view(1, L, 1, 1)
        out = out + coef[:, :, o] * shifted * keep
    return out.view(B, L, H)


class GroupedDynamicCausalConv(nn.Module):
    """Both convolutions of one sublayer (input side 0, output side 1), driven by one projection
    of the sublayer's input. Parameter names are the published tensor names."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        self.taps, self.group_size, self.block_size = taps, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        """Identity on both sides: tap 0 = 1, the rest 0, no dynamic part. The projection's
        gradient is not zero there (it multiplies the input), so it trains."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0].fill_(1.0)
        self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Convolve the sublayer input; return it and the output side's coefficients."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)
        return grouped_causal_conv(x, delta[..., 0, :, :], self.base_kernel[0], self.block_size), (
            delta[..., 1, :, :]
        )

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return grouped_causal_conv(y, delta, self.base_kernel[1], self.block_size)


class CandidateSelector(nn.Module):
    """Low-rank pairwise rescoring of each slot's top_k unary candidates. The codebooks are bare
    parameters named as the published tensors (candidate_selector.predecessor_codebook, ...)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, init_std: float):
        super().__init__()
        self.top_k, self.init_std = top_k, init_std
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Codebooks ~ N(0, init_std), hidden_projection = 0: every pairwise term is 0, so the
        walk drafts the unary argmax (what a DFlash drafter drafts), and the projection still
        gets a gradient (pred * succ is not 0). All three at 0 would never train."""
        self.predecessor_codebook.normal_(0.0, self.init_std, generator=generator)
        self.successor_codebook.normal_(0.0, self.init_std, generator=generator)
        self.hidden_projection.weight.zero_()

    def pairwise(
        self, hidden: torch.Tensor, prev_ids: torch.Tensor, cand_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden [..., H], prev_ids [...], cand_ids [..., k] -> [..., k] pairwise scores."""
        ctx = self.predecessor_codebook[prev_ids] * self.hidden_projection(hidden).to(
            self.predecessor_codebook.dtype
        )
        succ = self.successor_codebook[cand_ids]  # [..., k, r]
        return torch.matmul(succ, ctx[..., None])[..., 0]

    def walk(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """The block's draft tokens [B, L] from hidden [B, L, H] and unary logits [B, L, V] of
        slots 1..L, starting from anchor_ids [B] (slot 0's token). Greedy at temperature 0;
        above it each slot's choice is a Gumbel-max sample of softmax(scores / T) over its
        candidates. The unary top-k and the projection are batched; only the L-step chain of
        small gathers is sequential."""
        unary, cand = torch.topk(logits.float(), self.top_k, dim=-1)  # [B, L, k]
        proj = self.hidden_projection(hidden).to(self.predecessor_codebook.dtype)  # [B, L, r]
        succ = self.successor_codebook[cand]  # [B, L, k, r]
        prev, path = anchor_ids, []
        for t in range(hidden.shape[1]):
            ctx = self.predecessor_codebook[prev] * proj[:, t]  # [B, r]
            scores = unary[:, t] + torch.matmul(succ[:, t], ctx[..., None])[..., 0].float()
            prev = cand[:, t].gather(-1, pick(scores, temperature, generator)[:, None])[:, 0]
            path.append(prev)
        return torch.stack(path, dim=1)


def pick(
    scores: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """argmax over the last dim; at T > 0 a Gumbel-max sample of softmax(scores / T)."""
    if temperature <= 0:
        return scores.argmax(dim=-1)
    u = torch.rand(scores.shape, device=scores.device, generator=generator)
    gumbel = -torch.log((-torch.log(u.clamp_min(1e-20))).clamp_min(1e-20))
    return (scores.float() / temperature + gumbel).argmax(dim=-1)


def warm_start_dflash2(dflash, fields: dict):
    """A DFlash2 drafter that starts from the DFlash drafter `dflash` (e.g. a loaded export):
    its every tensor copied, the convolutions identity and the selector's pairwise term 0, so
    it drafts exactly what `dflash` drafts until it trains. `fields`: DFlashConfig fields to
    override (variant, conv_kernel_size, ..., block_size); the rest stay `dflash`'s."""
    import dataclasses

    from dflash_trainer.models.drafter import DFlashDrafter

    if dflash.config.is_dflash2:
        raise ValueError("warm_start_dflash2 starts from a DFlash drafter, this one is DFlash2")
    keep = ("variant", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    over = {k: fields[k] for k in keep if k in fields}
    over["variant"] = "dflash2"
    if "block_size" in fields:
        over["block_size"] = fields["block_size"]
    ref = next(dflash.parameters())
    drafter = DFlashDrafter(dataclasses.replace(dflash.config, **over))
    missing, unexpected = drafter.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all("conv" in n or "candidate_selector" in n for n in missing)
    return drafter.to(device=ref.device, dtype=ref.dtype)
