"""DFlash2's two additions to the DFlash drafter (docs/guides/dflash2.md): a grouped dynamic causal
convolution around every attention and MLP sublayer, and a low-rank pairwise candidate selector
that rescores each block slot's top-k tokens given the previous slot's choice.

The decoder layer and the drafter stay in models/drafter.py (one backbone); this file holds the
variant: its two parts, the selector walk, its objective terms and its export names.

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

Objective: the DFlash block loss (train/objective.py) plus `SelectorLoss`, the selector's loss
(what speculators' DFlash2 trainer and NeMo use: teacher-forced hard CE over the serving-sized
candidate set), per slot k >= 1 of every block:
  - candidates: the unary top_k of the drafter's own logits at slot k (what drafting rescores);
    when the label is not among them it replaces the weakest one, so every slot has a k-way
    label without scoring the whole vocabulary;
  - predecessor: the TRUE token at slot k-1 (the anchor for k = 1): teacher forcing, as the walk
    at inference conditions on the token drafted for the slot before, which is the true one
    exactly while the draft is still being accepted;
  - scores = unary logit + <pred[prev] * proj(h_k), succ[cand]>, CE against the label's index,
    weighted per slot like the block loss (exp(-(k-1)/gamma)), times objective.selector_weight.
The unary logits enter as constants (the block loss alone trains them: one LM-head pass fewer in
backward; speculators lets the selector loss reach them too); the hidden state gets the selector
loss's gradient through hidden_projection. The top-k needs the slot's logits once more: one extra
forward LM-head pass per step, chunked like the block loss, without gradient.

Metrics (on the device, appended to the block loss's): sel_loss; sel_acc, the teacher-forced
selector top-1 accuracy where the label is a candidate; recall_k, how often the label is among
the top_k; walk_accept_len, the simulated acceptance of the greedy selector walk from the anchor
over each block (self-conditioned: what drafting does), to read beside accept_len (the argmax
drafts of the same logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trainer.config import ObjectiveConfig
from dflash_trainer.models.variants.base import DrafterShape, DrafterVariant, pick


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


class SelectorLoss:
    """The selector's teacher-forced k-way CE (module docstring), weighted per slot like the
    block loss, times objective.selector_weight."""

    metric_names = ["sel_loss", "sel_acc", "recall_k", "walk_accept_len"]

    def __init__(self, weight: float = 1.0):
        if weight < 0:
            raise ValueError(f"selector_weight must be >= 0, got {weight}")
        self.weight = float(weight)

    def __call__(self, drafter, hidden, lm_head, labels, label_valid, slot_weights, chunk_blocks):
        sel = getattr(drafter, "candidate_selector", None)
        if sel is None:
            raise ValueError("the selector loss needs a DFlash2 drafter (drafter.variant=dflash2)")
        B, N, bs = labels.shape
        K = slot_weights.shape[0] - 1
        h = hidden.view(B, N, bs, -1)[:, :, 1 : K + 1]
        tgt, prev = labels[:, :, 1 : K + 1], labels[:, :, :K]
        valid = label_valid[:, :, 1 : K + 1]
        unary, cand, tgt_logit = top_candidates(h.detach(), lm_head, tgt, sel.top_k, chunk_blocks)
        hit = (cand == tgt[..., None]).any(-1)
        # a missing label replaces the weakest candidate (topk is sorted: the last one)
        cand_t = torch.cat([cand[..., :-1], torch.where(hit, cand[..., -1], tgt)[..., None]], -1)
        unary_t = torch.cat(
            [unary[..., :-1], torch.where(hit, unary[..., -1], tgt_logit)[..., None]], -1
        )
        pos = (cand_t == tgt[..., None]).int().argmax(-1)
        scores = unary_t + sel.pairwise(h, prev, cand_t).float()
        ce = F.cross_entropy(scores.flatten(0, 2), pos.flatten(), reduction="none").view_as(pos)
        w = slot_weights[1:] * valid.float()
        sel_loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
        with torch.no_grad():
            v = valid.float()
            n = v.sum().clamp_min(1.0)
            right = (scores.argmax(-1) == pos) & hit
            metrics = torch.stack(
                [
                    sel_loss.detach().float(),
                    (right.float() * v).sum() / n,
                    (hit.float() * v).sum() / n,
                    walk_accept_len(sel, h.detach(), unary, cand, labels[:, :, 0], tgt, valid),
                ]
            )
        return self.weight * sel_loss, metrics


@torch.no_grad()
def top_candidates(h, lm_head, tgt, k: int, chunk: int):
    """h [B,N,K,H] -> (top-k logits [B,N,K,k] fp32, their token ids, the label's logit [B,N,K]),
    `chunk` blocks at a time so that only one chunk's logits exist."""
    parts = []
    for c0 in range(0, h.shape[1], chunk):
        logits = lm_head(h[:, c0 : c0 + chunk]).float()
        val, idx = torch.topk(logits, k, dim=-1)
        parts.append((val, idx, logits.gather(-1, tgt[:, c0 : c0 + chunk, :, None])[..., 0]))
    return tuple(torch.cat(p, dim=1) for p in zip(*parts))


@torch.no_grad()
def walk_accept_len(sel, h, unary, cand, anchor, tgt, valid) -> torch.Tensor:
    """Mean simulated acceptance (+1 bonus token) of the greedy selector walk over blocks whose
    first label is valid: the walk starts at the anchor and conditions each slot on its own
    previous choice, as drafting does (CandidateSelector.walk)."""
    prev, alive = anchor, valid[:, :, 0]
    accepted = torch.ones_like(anchor, dtype=torch.float32)
    for t in range(h.shape[2]):
        scores = unary[:, :, t] + sel.pairwise(h[:, :, t], prev, cand[:, :, t]).float()
        prev = cand[:, :, t].gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
        alive = alive & valid[:, :, t] & (prev == tgt[:, :, t])
        accepted += alive.float()
    blocks = valid[:, :, 0].float()
    return (accepted * blocks).sum() / blocks.sum().clamp_min(1.0)


# Per layer two convolutions, once the selector (its codebooks are bare tensors, no ".weight",
# as the reference package and vLLM load them).
_CONV_PARAMS = tuple(
    f"{conv}.{p}"
    for conv in ("attention_conv", "mlp_conv")
    for p in ("base_kernel", "kernel_projection.weight")
)
_SELECTOR_PARAMS = (
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
    "candidate_selector.hidden_projection.weight",
)


class DFlash2(DrafterVariant):
    name = "dflash2"
    architecture = "DFlash2DraftModel"
    # DFlashDraftModel would load a DFlash2 export without its convolutions and selector, with
    # a warning only
    reference_class = "DFlash2DraftModel"
    options = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    objective_options = ("selector_weight",)
    warm_starts_from = ("dflash",)

    def check(self, cfg: DrafterShape) -> None:
        o = cfg.options
        check_shape(
            cfg.hidden_size,
            cfg.block_size,
            cfg.vocab_size,
            o["conv_kernel_size"],
            o["conv_group_size"],
            o["selector_rank"],
            o["selector_top_k"],
        )

    def layer_parts(self, cfg: DrafterShape) -> dict[str, tuple[str, nn.Module]]:
        o = cfg.options
        shape = (cfg.hidden_size, o["conv_kernel_size"], o["conv_group_size"], cfg.block_size)
        return {
            "attention": ("attention_conv", GroupedDynamicCausalConv(*shape)),
            "mlp": ("mlp_conv", GroupedDynamicCausalConv(*shape)),
        }

    def drafter_parts(self, cfg: DrafterShape) -> dict[str, nn.Module]:
        o = cfg.options
        selector = CandidateSelector(
            cfg.vocab_size, cfg.hidden_size, o["selector_rank"], o["selector_top_k"], cfg.init_std
        )
        return {"candidate_selector": selector}

    @torch.no_grad()
    def reset_parts(self, drafter: nn.Module, generator: torch.Generator | None = None) -> None:
        """Convolutions identity, selector pairwise term 0: the drafter drafts what a DFlash
        drafter with the same other weights drafts."""
        for m in drafter.modules():
            if isinstance(m, GroupedDynamicCausalConv):
                m.reset_identity()
            elif isinstance(m, CandidateSelector):
                m.reset_parameters(generator)

    def propose(self, drafter, hidden, logits, anchor_ids, temperature=0.0, generator=None):
        """The selector walk over each slot's top_k candidates, each slot conditioned on the
        token drafted for the slot before; a drafter whose selector was set to None (an
        ablation: the same weights) drafts each slot's argmax."""
        selector = getattr(drafter, "candidate_selector", None)
        if selector is None:
            return pick(logits, temperature, generator)
        return selector.walk(hidden, logits, anchor_ids, temperature, generator)

    def objective_terms(self, section: ObjectiveConfig, cfg: DrafterShape) -> SelectorLoss:
        return SelectorLoss(section.selector_weight)

    def tensor_names(self, num_layers: int) -> list[str]:
        names = [f"layers.{i}.{p}" for i in range(num_layers) for p in _CONV_PARAMS]
        return names + list(_SELECTOR_PARAMS)


DFLASH2 = DFlash2()
