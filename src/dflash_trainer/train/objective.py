"""The DFlash training objective (dflash-method.md §2.2-2.4): anchors -> blocks -> drafter ->
weighted CE.

Per row of the batch (S = padded length, N = num_anchors, bs = block_size):
  1. valid anchors p: loss_mask[p] and loss_mask[p+1] (a response token whose successor is
     supervised too; prompt tokens never anchor);
  2. N anchors drawn uniformly without replacement: random keys, +inf for invalid positions,
     the N smallest, then sorted. Rows with fewer valid positions get padding blocks
     (block_valid False) so every row has exactly N blocks: shapes never depend on data;
  3. block j = [input_ids[a_j], MASK x bs-1] embedded with the frozen target embedding
     (padding blocks: all MASK);
  4. labels are SAME-POSITION (pitfall §5.1): slot k predicts input_ids[a_j + k]; slot 0 is given
     and excluded; a label counts iff a_j+k < S, loss_mask[a_j+k] and the block is valid;
  5. loss = sum(w*mask*CE) / sum(w*mask), w_k = exp(-(k-1)/gamma).
     With logit distillation (kd_weight = lam > 0) each slot's term is
     (1 - lam) * CE + lam * T^2 * KL(p_target || p_drafter), both softmaxes at temperature T;
     p_target at slot k is the target's own next-token distribution at position a_j+k-1 (its
     final normed hidden state there through the frozen LM head, computed chunk by chunk here,
     so the target's logits never exist for the whole sequence).
     With label_source = "target" the labels of slots 1..K are the target's own argmax at
     position a_j+k-1 (the same final hidden states through the same head, chunk by chunk), not
     the data's tokens: on text the target did not write, the drafter learns what verification
     accepts. Validity (loss mask, block, sequence end) is the text labels'.
The LM head runs a chunk of blocks at a time and each chunk's input gradient is formed right
away (_ChunkCE), so the full [N*bs, V] logits never exist, in forward or backward.

Everything stays on the device: no .item(), no boolean indexing, no nonzero (one sync per logging
step is the caller's business). Metrics come back as one 1-D tensor plus a list of names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dflash_trainer.models.packed_linear import FrozenMatmuls

# Paper A.1 (gamma per block size); other sizes use bs / 2.3, which reproduces 16 -> 6.96,
# 10 -> 4.35, 8 -> 3.48 within rounding of the paper's choices.
_PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    return _PAPER_GAMMA.get(block_size, block_size / 2.3)


def needs_final_hidden(kd_weight: float, hidden_weight: float, label_source: str) -> bool:
    """Whether the objective reads the target's final hidden states, so the target forward
    runs past its last tap (and features captured while generating, which lack them, are not
    enough: pipeline/feature_cache.py)."""
    return kd_weight > 0 or hidden_weight > 0 or label_source == "target"


@dataclass
class StepOutput:
    loss: torch.Tensor  # 0-d, differentiable
    metrics: torch.Tensor  # 1-D, detached, on the device
    metric_names: list[str]
    # [B, N, K+1] bool: slot k's argmax equals its label (slot 0, given, False); detached
    correct: torch.Tensor | None = None
    # [B, N] long: where each block's successor would start at inference (p + accepted + 1)
    # where a scored slot was rejected, else -1 (train/anchor_policy.py); when asked for
    next_starts: torch.Tensor | None = None


class DFlashObjective:
    def __init__(
        self,
        block_size: int,
        num_anchors: int,
        gamma: float = 0.0,
        mask_token_id: int = 0,
        chunk_blocks: int = 0,
        attention: str | None = None,
        weighting: str = "decay",
        dpace_alpha: float = 0.5,
        feature_noise: float = 0.0,
        kd_weight: float = 0.0,
        kd_temperature: float = 1.0,
        loss_slots: int = 0,
        hidden_weight: float = 0.0,
        label_source: str = "text",
        extra_terms=None,
        reject_weight: float = 0.0,
    ):
        """`extra_terms`: a variant's loss terms beside the block loss (models/variants/base.py
        ObjectiveTerms), or None."""
        if block_size < 2:
            raise ValueError("block_size must be >= 2")
        if not 0.0 < dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha must be in (0, 1], got {dpace_alpha}")
        if not 0.0 <= kd_weight <= 1.0:
            raise ValueError(f"kd_weight must be in [0, 1], got {kd_weight}")
        if kd_temperature <= 0:
            raise ValueError(f"kd_temperature must be > 0, got {kd_temperature}")
        if not 0 <= loss_slots < 1 << 16:
            raise ValueError(f"loss_slots must be >= 0 (0 = every slot), got {loss_slots}")
        if hidden_weight < 0:
            raise ValueError(f"hidden_weight must be >= 0, got {hidden_weight}")
        if reject_weight < 0 or (reject_weight > 0 and kd_weight > 0):
            raise ValueError(
                f"reject_weight must be >= 0 and cannot be combined with kd_weight, got "
                f"{reject_weight} with kd_weight {kd_weight}"
            )
        self.reject_weight = float(reject_weight)
        if label_source not in ("text", "target"):
            raise ValueError(f"label_source must be 'text' or 'target', got {label_source!r}")
        self.label_source = label_source
        self.kd_weight = float(kd_weight)
        self.hidden_weight = float(hidden_weight)
        # Slots 1..K go through the LM head (CE/KD, accuracy metrics); 0 = all bs - 1.
        self.loss_slots = loss_slots if 0 < loss_slots < block_size else block_size - 1
        self.kd_temperature = float(kd_temperature)
        self.weighting = weighting
        self.dpace_alpha = float(dpace_alpha)
        self.feature_noise = float(feature_noise)
        self.block_size = block_size
        self.num_anchors = num_anchors
        self.gamma = float(gamma) if gamma and gamma > 0 else default_gamma(block_size)
        self.mask_token_id = int(mask_token_id)
        self.chunk_blocks = max(0, int(chunk_blocks))  # 0 = auto
        self.attention = attention
        self.metric_names = (
            ["loss", "acc"]
            + [f"acc_{k}" for k in range(1, self.loss_slots + 1)]
            + ["accept_len", "num_blocks", "num_label_tokens"]
            + (["ce", "kd"] if self.kd_weight > 0 else [])
            + (["reject"] if self.reject_weight > 0 else [])
            + (["hidden"] if self.hidden_weight > 0 else [])
            + (list(extra_terms.metric_names) if extra_terms is not None else [])
        )
        self.extra_terms = extra_terms

    @property
    def needs_target_hidden(self) -> bool:
        """Whether a step needs the target's final hidden states (KD, hidden regression, the
        target's labels)."""
        return needs_final_hidden(self.kd_weight, self.hidden_weight, self.label_source)

    @property
    def read_slots(self) -> int:
        """Slots per block whose final hidden state the loss reads: 0..K (K = loss_slots) when
        nothing else reads the rest (the hidden-state term and the variant's terms read every
        slot), else 0 = all. The drafter's last layer computes only those (drafter.forward)."""
        if self.extra_terms is not None or self.hidden_weight > 0:
            return 0
        return self.loss_slots + 1

    def slot_weights(self, device) -> torch.Tensor:
        """[bs]: 0 for slot 0, exp(-(k-1)/gamma) for k >= 1 (slot 1 has weight 1)."""
        k = torch.arange(self.block_size, device=device, dtype=torch.float32)
        w = torch.exp(-(k - 1) / self.gamma)
        return torch.where(k >= 1, w, torch.zeros_like(w))

    # ------------------------------------------------------------------------------------ data
    def step_anchors(self, anchor_counts: np.ndarray | None) -> int:
        """Blocks per row for a batch whose rows have `anchor_counts` ([B], host) anchor
        positions: num_anchors, or fewer where no row can fill them, rounded up to a multiple of
        num_anchors / 8 (at most 8 shapes, so compiled kernels meet few). Every row then keeps
        every anchor it had: the blocks dropped are padding blocks, whose loss weight is 0, and
        the anchors come from the same random keys, so the loss is the same (tests/
        test_objective.py). None (a batch from elsewhere) = num_anchors."""
        if anchor_counts is None or len(anchor_counts) == 0:
            return self.num_anchors
        q = max(1, self.num_anchors // 8)
        most = int(np.max(anchor_counts))
        return min(self.num_anchors, max(q, -(-most // q) * q))

    def query_tokens(self, anchor_counts: np.ndarray | None, rows: int) -> int:
        """Block tokens of a batch that hold an anchor (what the FLOP count and MFU credit):
        `rows` rows of `anchor_counts` ([B], host) anchor positions, rows x num_anchors blocks
        when unknown."""
        if anchor_counts is None:
            return rows * self.num_anchors * self.block_size
        return int(np.minimum(anchor_counts, self.num_anchors).sum()) * self.block_size

    def sample_anchors(
        self,
        loss_mask: torch.Tensor,
        generator: torch.Generator | None = None,
        num_anchors: int | None = None,
        preferred: torch.Tensor | None = None,
        preferred_count: int = 0,
    ):
        """loss_mask [B,S] -> anchors [B,N] long (sorted, valid first), block_valid [B,N] bool,
        N = `num_anchors` (default the objective's).

        `preferred` [B, M] (positions, -1 = none; train/anchor_policy.py): up to
        `preferred_count` of a row's valid preferred positions, drawn uniformly among them, are
        anchors; the rest of the row's N are drawn uniformly as usual. Padding anchors are 0
        (they are masked out everywhere). generator must live on loss_mask's device.
        """
        B, S = loss_mask.shape
        N = num_anchors or self.num_anchors
        dev = loss_mask.device
        lm = loss_mask.bool()
        ok = lm[:, :-1] & lm[:, 1:]  # p in 0..S-2
        P = ok.shape[1]
        keys = torch.rand(B, P, device=dev, generator=generator)
        k = min(N, P)  # shapes only
        if preferred is not None and preferred_count > 0:
            keys = _prefer(keys, ok, preferred, min(preferred_count, k), generator)
        keys = torch.where(ok, keys, torch.full_like(keys, math.inf))
        picked_keys, picked = torch.topk(keys, k, dim=1, largest=False, sorted=False)
        valid = torch.isfinite(picked_keys)
        # Sort by position with padding last: invalid entries get position + P.
        order_key = torch.where(valid, picked, picked + P)
        order_key, _ = torch.sort(order_key, dim=1)
        valid = order_key < P
        anchors = torch.where(valid, order_key, torch.zeros_like(order_key))
        if k < N:  # sequence shorter than the anchor count: pad with padding blocks
            pad = N - k
            anchors = F.pad(anchors, (0, pad), value=0)
            valid = F.pad(valid, (0, pad), value=False)
        return anchors.long(), valid

    def build_blocks(
        self, input_ids: torch.Tensor, anchors: torch.Tensor, block_valid: torch.Tensor
    ) -> torch.Tensor:
        """Block token ids [B,N,bs]: [token at anchor, MASK...]; padding blocks all MASK."""
        B, N = anchors.shape
        first = input_ids.gather(1, anchors)
        mask = torch.full_like(first, self.mask_token_id)
        first = torch.where(block_valid, first, mask)
        rest = mask[:, :, None].expand(B, N, self.block_size - 1)
        return torch.cat([first[:, :, None], rest], dim=2)

    def build_labels(self, input_ids, loss_mask, anchors, block_valid):
        """labels [B,N,bs] (same-position: input_ids[a+k]) and label_valid [B,N,bs] bool."""
        B, S = input_ids.shape
        slot = torch.arange(self.block_size, device=input_ids.device)
        pos = anchors[:, :, None] + slot  # [B,N,bs]
        in_range = pos < S
        pos_c = pos.clamp(max=S - 1).reshape(B, -1)
        labels = input_ids.gather(1, pos_c).view_as(pos)
        sup = loss_mask.bool().gather(1, pos_c).view_as(pos)
        valid = in_range & sup & block_valid[:, :, None] & (slot >= 1)
        return labels, valid

    @torch.no_grad()
    def target_labels(self, labels, teacher, lm_head) -> torch.Tensor:
        """`labels` [B,N,bs] with slots 1..K (K = loss_slots; later slots are never read) set
        to the target's argmax: its final hidden state at a_j+k-1 (`teacher` [B,N,bs-1,H],
        teacher_hidden) through the frozen `lm_head`, in the head's own dtype (autocast off:
        the target's logits, not a bf16 re-rounding of them), chunk_blocks blocks at a time."""
        B, N, bs = labels.shape
        K = self.loss_slots
        dtype = next(lm_head.parameters()).dtype
        chunk = self.chunk_blocks or _auto_chunk_blocks(lm_head, B, K)
        parts = []
        with torch.autocast(teacher.device.type, enabled=False):
            for c0 in range(0, N, chunk):
                parts.append(lm_head(teacher[:, c0 : c0 + chunk, :K].to(dtype)).argmax(-1))
        return torch.cat([labels[:, :, :1], torch.cat(parts, 1), labels[:, :, K + 1 :]], 2)

    # ------------------------------------------------------------------------------------ loss
    def __call__(
        self,
        drafter,
        embed_weight: torch.Tensor,
        lm_head,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        generator: torch.Generator | None = None,
        target_hidden: torch.Tensor | None = None,
        num_anchors: int | None = None,
        preferred: torch.Tensor | None = None,
        preferred_count: int = 0,
        want_next_starts: bool = False,
    ) -> StepOutput:
        """`target_hidden` [B,S,H]: the target's final normed hidden states, needed (and only
        read) when `needs_target_hidden` (kd_weight or hidden_weight > 0). `num_anchors`: blocks
        per row for this batch (step_anchors; default objective.num_anchors). `preferred`,
        `preferred_count`: sample_anchors. `want_next_starts`: fill the output's next_starts."""
        B, S = input_ids.shape
        bs, N = self.block_size, num_anchors or self.num_anchors
        anchors, block_valid = self.sample_anchors(
            loss_mask, generator, N, preferred, preferred_count
        )
        if self.feature_noise > 0:
            taps = unwrap(drafter).config.num_features
            features = add_feature_noise(features, self.feature_noise, taps, generator)
        block_ids = self.build_blocks(input_ids, anchors, block_valid)
        block_embeds = F.embedding(block_ids.reshape(B, N * bs), embed_weight.detach())
        hidden = drafter(
            block_embeds,
            features,
            anchors,
            block_valid,
            self.attention or None,
            out_slots=self.read_slots,
        )
        labels, label_valid = self.build_labels(input_ids, loss_mask, anchors, block_valid)
        teacher = None
        if self.needs_target_hidden:
            if target_hidden is None:
                raise ValueError(
                    "kd_weight > 0, hidden_weight > 0 or label_source=target needs the target's "
                    "final hidden states"
                )
            teacher = self.teacher_hidden(target_hidden, anchors)
            if self.label_source == "target":
                labels = self.target_labels(labels, teacher, lm_head)
        out = self.loss_from_hidden(hidden, lm_head, labels, label_valid, block_valid, teacher)
        if want_next_starts and out.correct is not None:
            out.next_starts = next_starts(anchors, block_valid, out.correct, label_valid)
        if self.extra_terms is None:
            return out
        weights = self.slot_weights(hidden.device)[: self.loss_slots + 1]
        chunk = self.chunk_blocks or _auto_chunk_blocks(lm_head, B, self.loss_slots)
        loss, metrics = self.extra_terms(
            unwrap(drafter), hidden, lm_head, labels, label_valid, weights, chunk
        )
        return StepOutput(
            loss=out.loss + loss,
            metrics=torch.cat([out.metrics, metrics]),
            metric_names=list(self.metric_names),
            correct=out.correct,
            next_starts=out.next_starts,
        )

    def teacher_hidden(self, target_hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """[B,N,bs-1,H]: for slot k >= 1 of block j, the target's final hidden state at position
        a_j+k-1, the one whose LM-head output is the target's distribution for the token at a_j+k
        (positions past the sequence are clamped; their labels are invalid anyway)."""
        B, S, H = target_hidden.shape
        k = torch.arange(self.block_size - 1, device=anchors.device)
        pos = (anchors[:, :, None] + k).clamp(max=S - 1)  # a + (slot - 1), slots 1..bs-1
        flat = pos.reshape(B, -1, 1).expand(-1, -1, H)
        return target_hidden.gather(1, flat).view(B, anchors.shape[1], self.block_size - 1, H)

    def loss_from_hidden(
        self, hidden, lm_head, labels, label_valid, block_valid, teacher=None
    ) -> StepOutput:
        """hidden [B,N*q,H] (q = bs, or K+1: read_slots) -> weighted CE (+ KD against `teacher`
        [B,N,bs-1,H], the target's hidden states for slots 1..bs-1) (+ hidden-state regression
        onto `teacher`) + metrics, LM head applied chunk_blocks at a time.

        Slot 0 is never decoded (it is given), so only slots 1..K (K = loss_slots) go through
        the LM head; the hidden-state term, which needs no LM head, covers every slot.
        """
        B, N, bs = labels.shape
        K = self.loss_slots
        if self.needs_target_hidden and teacher is None:
            raise ValueError("kd_weight > 0 or hidden_weight > 0 needs the teacher's hidden states")
        if any(p.requires_grad for p in lm_head.parameters()):
            raise ValueError(
                "lm_head must be frozen (requires_grad False): the chunked loss "
                "returns gradients for the drafter hidden states only"
            )
        h_all = hidden.view(B, N, -1, hidden.shape[-1])[:, :, 1:]  # every slot, or 1..K
        h = h_all[:, :, :K]
        valid = label_valid[:, :, 1 : K + 1].float()  # [B,N,K]
        weigh: _DPaceWeights | _FixedWeights
        if self.weighting == "dpace":
            weigh = _DPaceWeights(self.dpace_alpha)
        else:
            weigh = _FixedWeights(self.slot_weights(hidden.device)[1 : K + 1] * valid)
        need_grad = torch.is_grad_enabled() and hidden.requires_grad
        kd = (self.kd_weight, self.kd_temperature) if self.kd_weight > 0 else None
        # With KD each chunk holds two sets of logits (drafter, target): half the blocks.
        chunk = self.chunk_blocks or max(
            1, _auto_chunk_blocks(lm_head, B, K) // (2 if kd is not None else 1)
        )
        num_parts, den_parts, correct_parts, parts = [], [], [], []
        for c0 in range(0, N, chunk):
            c1 = min(N, c0 + chunk)
            t_c = teacher[:, c0:c1, :K] if kd is not None else None
            args = (
                h[:, c0:c1],
                lm_head,
                labels[:, c0:c1, 1 : K + 1],
                valid[:, c0:c1],
                weigh.at(c0, c1),
                t_c,
                kd,
                self.reject_weight,
            )
            num_c, den_c, corr_c, part_c = (
                _ChunkCE.apply(*args) if need_grad else _chunk_ce(*args)[:4]
            )
            num_parts.append(num_c)
            den_parts.append(den_c)
            correct_parts.append(corr_c)
            parts.append(part_c)
        num = torch.stack(num_parts).sum()
        den = torch.stack(den_parts).sum().clamp_min(1e-6)
        loss = num / den
        correct = torch.cat(correct_parts, dim=1)  # [B,N,K]
        correct = F.pad(correct, (1, 0), value=False)  # slot 0: given
        metrics = self._metrics(loss.detach(), correct, label_valid[:, :, : K + 1], block_valid)
        sums = torch.stack(parts).sum(0) / den  # weighted means of CE, KD, reject, for the logs
        if kd is not None:
            metrics = torch.cat([metrics, sums[:2]])
        if self.reject_weight > 0:
            metrics = torch.cat([metrics, sums[2:]])
        if self.hidden_weight > 0:
            w = self.slot_weights(hidden.device)[1:] * label_valid[:, :, 1:].float()
            hid = hidden_regression(h_all, teacher, w)
            loss = loss + self.hidden_weight * hid
            metrics = torch.cat([metrics, hid.detach().float().view(1)])
        return StepOutput(
            loss=loss, metrics=metrics, metric_names=list(self.metric_names), correct=correct
        )

    def _metrics(self, loss, correct, label_valid, block_valid) -> torch.Tensor:
        lv = label_valid.float()
        hit = (correct & label_valid).float()
        n_lab = lv.sum()
        acc = hit.sum() / n_lab.clamp_min(1.0)
        acc_k = hit.sum(dim=(0, 1))[1:] / lv.sum(dim=(0, 1))[1:].clamp_min(1.0)  # [K]
        # Simulated acceptance per block: longest correct prefix of slots 1..K (+1 bonus token;
        # with loss_slots < bs - 1 a lower bound, the unscored slots counted as rejected).
        accepted = hit[:, :, 1:].cumprod(dim=2).sum(dim=2) + 1.0  # [B,N]
        bv = block_valid.float()
        n_blocks = bv.sum()
        accept_len = (accepted * bv).sum() / n_blocks.clamp_min(1.0)
        return torch.cat(
            [
                loss.float().view(1),
                acc.view(1),
                acc_k,
                accept_len.view(1),
                n_blocks.view(1),
                n_lab.view(1),
            ]
        )


# Auto LM-head chunk: about this many fp32 logits per chunk.
# CPU, 128 MiB: measured with SmolLM2's 49,152 vocabulary, chunks of 16-32 blocks run as fast per
#   token as 128-block chunks (the elementwise passes stay closer to cache) at a quarter of the
#   memory.
# CUDA, 2 GiB: every chunk re-reads the whole LM head (Qwen3-8B: 1.2 GB in bf16), so a chunk
#   needs a few thousand rows to stay compute-bound (H200: ~200 FLOP per byte); 2 GiB of fp32
#   logits is ~3,500 rows at a 152k vocabulary.
_LOSS_CHUNK_ELEMS = {"cpu": 1 << 25, "cuda": 1 << 29}
# the target's LM head (frozen) on a float32 CPU: packed once, products on oneDNN's GEMM
_FROZEN_HEAD = FrozenMatmuls()


def _prefer(
    keys: torch.Tensor,
    ok: torch.Tensor,
    preferred: torch.Tensor,
    count: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """`keys` [B,P] (uniform in [0, 1), smallest drawn first) with up to `count` of each row's
    valid `preferred` positions ([B,M], -1 = none), drawn uniformly among them, moved below 0."""
    B, P = keys.shape
    pos = preferred.long()
    usable = (pos >= 0) & (pos < P)
    pos_c = pos.clamp(0, P - 1)
    usable &= ok.gather(1, pos_c)
    marked = torch.zeros(B, P, dtype=torch.int32, device=keys.device)
    marked = marked.scatter_add(1, pos_c, usable.int()) > 0  # duplicates counted once
    draw = torch.rand(B, P, device=keys.device, generator=generator)
    draw = torch.where(marked, draw, torch.full_like(draw, math.inf))
    drawn, at = torch.topk(draw, count, dim=1, largest=False, sorted=False)
    chosen = torch.zeros_like(marked).scatter(1, at, torch.isfinite(drawn))
    return torch.where(chosen, keys - 1.0, keys)


def next_starts(
    anchors: torch.Tensor, block_valid: torch.Tensor, correct: torch.Tensor, label_valid
) -> torch.Tensor:
    """[B,N]: where the block after each one would start at inference, p + a + 1 (a = drafted
    slots accepted: the leading scored slots whose argmax is the label), for the blocks whose
    first non-accepted scored slot was a rejection (a valid label the drafter got wrong); -1 for
    the rest (all scored slots right, the answer ending inside the block, padding).
    `correct` [B,N,K+1] and `label_valid` [B,N,>=K+1] as the objective holds them."""
    K = correct.shape[2] - 1
    lv = label_valid[:, :, 1 : K + 1]
    right = correct[:, :, 1:] & lv
    accepted = right.long().cumprod(dim=2).sum(dim=2)  # [B,N] in 0..K
    wrong = lv & ~correct[:, :, 1:]
    at = accepted.clamp(max=K - 1).unsqueeze(2)
    rejected = block_valid & (accepted < K) & wrong.gather(2, at).squeeze(2)
    return torch.where(rejected, anchors + accepted + 1, torch.full_like(anchors, -1))


def unwrap(drafter):
    """The drafter behind DDP (.module) or torch.compile (._orig_mod)."""
    for attr in ("module", "_orig_mod"):
        while hasattr(drafter, attr) and not hasattr(drafter, "config"):
            drafter = getattr(drafter, attr)
    return drafter


def _auto_chunk_blocks(lm_head, rows: int, slots: int) -> int:
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor):  # an opaque head module: assume 64k, CPU
        return chunk_blocks_for(1 << 16, "cpu", rows, slots)
    return chunk_blocks_for(weight.shape[0], weight.device.type, rows, slots)


def chunk_blocks_for(vocab: int, device_type: str, rows: int, slots: int) -> int:
    """Blocks per chunk so that rows * blocks * slots * vocab <= the device's logits budget."""
    budget = _LOSS_CHUNK_ELEMS.get(device_type, _LOSS_CHUNK_ELEMS["cpu"])
    return max(1, budget // (rows * slots * vocab))


def _chunk_ce(h, lm_head, labels, valid, weigh, teacher=None, kd=None, reject=0.0, need_grad=False):
    """h [B,n,k,H] -> (sum(w*term) 0-d, sum(w) 0-d, top-1 correct [B,n,k] bool, the unmixed
    sums [sum(w*CE), sum(w*KD), sum(w*reject)] (zeros where off), d sum / d h or None). The
    per-slot term is CE, or (1 - lam) CE + lam T^2 KL(target || drafter) with `kd` = (lam, T)
    and `teacher` [B,n,k,H] the target's hidden states; plus, with `reject` = r > 0, r times
    the rejected-proposal term where the drafter's top-1 is not the label: -log(1 - p(top-1)),
    which pushes down what verification would reject. `weigh(ce, valid)` gives the chunk's loss
    weights [B,n,k] (detached; 0 where the label is not valid) from its per-slot CE. The
    chunk's logits [B,n,k,V] exist only inside this call."""
    if isinstance(lm_head, nn.Linear) and lm_head.bias is None:
        if teacher is None:
            return _linear_ce(h, lm_head.weight, labels, valid, weigh, need_grad, reject)
        return _linear_kd(h, lm_head.weight, labels, valid, weigh, teacher, kd, need_grad)
    with torch.enable_grad() if need_grad else torch.no_grad():  # any frozen head module
        hh = h.detach().requires_grad_(need_grad)
        logits = lm_head(hh).float()
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
        ce = ce.view_as(valid)
        w = weigh(ce.detach(), valid)
        term, kl = ce, torch.zeros_like(ce)
        if teacher is not None:
            lam, T = kd
            with torch.no_grad():
                t_logp = torch.log_softmax(lm_head(teacher.to(h.dtype)).float() / T, dim=-1)
            d_logp = torch.log_softmax(logits / T, dim=-1)
            kl = (T * T) * (t_logp.exp() * (t_logp - d_logp)).sum(-1)
            term = (1.0 - lam) * ce + lam * kl
        top, arg = torch.softmax(logits, dim=-1).max(dim=-1)
        correct = arg == labels
        ul = -torch.log1p(-top.clamp(max=1.0 - 1e-6)) * (~correct).float()
        term = term + reject * ul
        num = (term * w).sum()
        grad_h = torch.autograd.grad(num, hh)[0] if need_grad else None
        sums = [(x.detach() * w).sum() for x in (ce, kl, ul)]
        parts = torch.stack(sums)
    return num.detach(), w.sum(), correct, parts, grad_h


@torch.no_grad()
def _linear_ce(h, weight, labels, valid, weigh, need_grad, reject=0.0):
    """Same as the generic path for a bias-free Linear head, with the CE gradient written by hand
    (softmax - onehot, weighted) into one fp32 [rows, V] buffer in place: one buffer at the peak
    instead of four (logits, log_softmax, its grad, the logits grad), and six passes over it
    instead of about eleven (these elementwise passes, not the matmul, are most of the chunk's
    time on CPU): max+argmax together, shift (fused with the fp32 upcast), exp, sum, scale, and
    the cast back for the grad matmul.
    """
    x = h.reshape(-1, h.shape[-1])
    lab = labels.reshape(-1, 1)
    logits = _FROZEN_HEAD.linear(x, weight)  # F.linear (which follows autocast) off fp32 CPU
    mx, arg = logits.max(dim=-1, keepdim=True)  # one pass for both
    correct = (arg == lab).view_as(labels)
    target = logits.gather(1, lab).float()
    mx = mx.float()
    # z = exp(logits - max) in fp32: in place for fp32 logits; bf16 logits are upcast by the
    # shift itself (one pass, bf16 in, fp32 out) and then freed.
    if logits.dtype == torch.float32:
        z = logits.sub_(mx)
    else:
        z = torch.sub(
            logits, mx, out=torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        )
    del logits
    z.exp_()
    se = z.sum(dim=-1, keepdim=True)
    lse = se.log().add_(mx)
    ce = lse - target  # [rows, 1]
    w = weigh(ce.view_as(valid), valid).reshape(-1, 1)
    num = (ce * w).sum()
    # rejected proposals: p(top-1) = exp(max - max) / se = 1 / se; -log(1 - p) where it is wrong
    p_top = se.reciprocal().clamp_(max=1.0 - 1e-6)
    wrong = (~correct).reshape(-1, 1).float()
    ul = -torch.log1p(-p_top) * wrong
    rejected = (ul * w).sum()
    parts = torch.stack([num, torch.zeros_like(num), rejected])
    num = num + reject * rejected
    grad_h = None
    if need_grad:
        # d(-log(1 - p_a)) / d z = p_a / (1 - p_a) (onehot(a) - softmax)
        c = (reject * w * wrong) * p_top / (1.0 - p_top)
        g = z.mul_((w - c) / se)  # (w - c) * softmax, in place
        g.scatter_add_(1, lab, -w)  # - w * onehot(label)
        g.scatter_add_(1, arg, c)  # + c * onehot(top-1)
        cdt = (
            x.dtype
            if not torch.is_autocast_enabled(x.device.type)
            else torch.get_autocast_dtype(x.device.type)
        )
        grad_h = _FROZEN_HEAD.back(g.to(cdt), weight.to(cdt)).to(h.dtype).view_as(h)
    return num, w.sum(), correct, parts, grad_h


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


@torch.no_grad()
def _linear_kd(h, weight, labels, valid, weigh, teacher, kd, need_grad):
    """The Linear-head path with logit distillation: per slot (1 - lam) CE + lam T^2 KL(p_t ||
    p_d), p_t = softmax(target logits / T), p_d = softmax(drafter logits / T). Gradient by hand:
    d term / d z = (1 - lam) (softmax(z) - onehot) + lam T (softmax(z / T) - p_t)."""
    lam, T = kd
    x = h.reshape(-1, h.shape[-1])
    lab = labels.reshape(-1, 1)
    logits = F.linear(x, weight).float()
    t_logits = F.linear(teacher.reshape(-1, teacher.shape[-1]).to(x.dtype), weight).float()
    correct = (logits.argmax(dim=-1, keepdim=True) == lab).view_as(labels)
    logp = torch.log_softmax(logits, dim=-1)
    ce = -logp.gather(1, lab)  # [rows, 1]
    t_logp = torch.log_softmax(t_logits.div_(T), dim=-1)
    del t_logits
    d_logp = logp if T == 1.0 else torch.log_softmax(logits / T, dim=-1)
    p_t = t_logp.exp()
    kl = (T * T) * (p_t * (t_logp - d_logp)).sum(-1, keepdim=True)
    del t_logp
    w = weigh(ce.view_as(valid), valid).reshape(-1, 1)
    term = (1.0 - lam) * ce + lam * kl
    num = (term * w).sum()
    parts = torch.stack([(ce * w).sum(), (kl * w).sum(), torch.zeros_like(num)])
    grad_h = None
    if need_grad:
        p_d = logp.exp_()  # softmax(z), in place: logp is not needed any more
        p_dT = p_d if T == 1.0 else d_logp.exp()
        g = p_dT.sub(p_t).mul_(lam * T * w)  # lam T w (softmax(z / T) - p_t)
        g.add_(p_d.mul_((1.0 - lam) * w))  # + (1 - lam) w softmax(z)
        g.scatter_add_(1, lab, -(1.0 - lam) * w)  # - (1 - lam) w onehot
        cdt = _compute_dtype(x)
        grad_h = _FROZEN_HEAD.back(g.to(cdt), weight.to(cdt)).to(h.dtype).view_as(h)
    return num, w.sum(), correct, parts, grad_h


def hidden_regression(h: torch.Tensor, teacher: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum(w * |h - t|^2 / |t|^2) / sum(w) over slots: the drafter's final hidden state [...,H]
    pulled toward the target's at the same position, relative to the target's norm (scale free:
    1 for h = 0, 0 for a match). Both go through the same frozen LM head, so matching the hidden
    state matches the whole next-token distribution, at no LM-head cost."""
    t = teacher.to(torch.float32)
    err = (h.to(torch.float32) - t).pow(2).sum(-1) / t.pow(2).sum(-1).clamp_min(1e-6)
    return (err * w).sum() / w.sum().clamp_min(1e-6)


class _FixedWeights:
    """exp(-(k-1)/gamma) per slot, times the label mask: known before any logits."""

    def __init__(self, wm: torch.Tensor):
        self.wm = wm  # [B,N,bs-1]

    def at(self, c0: int, c1: int):
        wm = self.wm[:, c0:c1]
        return lambda ce, valid: wm


class _DPaceWeights:
    """D-PACE: weights from the drafter's own detached confidence in each label (dpace_weights)."""

    def __init__(self, alpha: float):
        self.alpha = alpha

    def at(self, c0: int, c1: int):
        return lambda ce, valid: dpace_weights(ce, valid, self.alpha)


@torch.no_grad()
def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE position weights (arXiv 2605.18810, Eq. 7-8), detached, [..., k] over slots 1..k.

    q_i = exp(-CE_i) is the drafter's probability of label i; the floor q~_i = (1 - alpha) q_i
    + alpha keeps a slot the drafter still gets wrong from silencing every slot after it;
    w_j = sum_{m >= j} prod_{i <= m} q~_i is the chance that slots 1..j are all accepted times
    what acceptance at j is worth (the expected accepted length from j on). Slots without a
    valid label pass the product through (q~ = 1) and get weight 0. At alpha -> 0 the weighted
    CE's gradient is that of minus the expected accepted length sum_j prod_{i <= j} q_i (the
    acceptance-direct objective; tests/test_objective.py); the floor keeps blocks the drafter
    still gets wrong training, where that objective's gradient vanishes.
    """
    v = valid.to(torch.float32)
    q = torch.exp(-ce.to(torch.float32))
    qs = torch.where(v > 0, (1.0 - alpha) * q + alpha, torch.ones_like(q))
    reach = torch.cumprod(qs, dim=-1) * v
    return reach.flip(-1).cumsum(-1).flip(-1) * v


def add_feature_noise(
    features: torch.Tensor, rel_std: float, num_taps: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """features + N(0, (rel_std * rms)^2), rms of each tapped vector (so the noise is relative
    to each tap's own scale, which differs by orders of magnitude between shallow and deep
    layers). Training only: evaluation and decoding never call it."""
    B, S, D = features.shape
    x = features.view(B, S, num_taps, D // num_taps)
    rms = x.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
    noise = torch.randn(x.shape, device=x.device, generator=generator, dtype=torch.float32)
    return (x.float() + noise * (rel_std * rms)).to(features.dtype).view(B, S, D)


class _ChunkCE(torch.autograd.Function):
    """Chunked LM head + weighted CE whose input gradient is computed in the forward pass.

    This replaces activation checkpointing of the chunk (what SpecForge does): the memory bound is
    the same (one chunk of logits at a time, never all of them, in forward or backward) but the
    LM-head matmul runs twice per chunk (logits, grad input) instead of three times (logits,
    recompute, grad input). The LM head is the largest matmul of the step (V >> H), so that is
    about a quarter of the step on CPU. What is kept for backward is d num / d h, the size of h.
    Valid because the loss is linear in each chunk's num (loss = sum(num) / den, with den a sum
    of detached weights).
    """

    @staticmethod
    def forward(ctx, h, lm_head, labels, valid, weigh, teacher, kd, reject):
        num, den, correct, parts, grad_h = _chunk_ce(
            h, lm_head, labels, valid, weigh, teacher, kd, reject, need_grad=True
        )
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(den, correct, parts)
        return num, den, correct, parts

    @staticmethod
    def backward(ctx, g_num, g_den, g_correct, g_parts):
        (grad_h,) = ctx.saved_tensors
        return grad_h * g_num.to(grad_h.dtype), None, None, None, None, None, None, None
