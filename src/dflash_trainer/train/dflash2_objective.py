"""DFlash2's objective: the DFlash block loss (train/objective.py: weighted CE, or KL with
drafter.kd_weight) plus a loss for the candidate selector (docs/dflash2.md).

Selector loss (what speculators' DFlash2 trainer and NeMo use: teacher-forced hard CE over the
serving-sized candidate set), per slot k >= 1 of every block:
  - candidates: the unary top_k of the drafter's own logits at slot k (what drafting rescores);
    when the label is not among them it replaces the weakest one, so every slot has a k-way
    label without scoring the whole vocabulary;
  - predecessor: the TRUE token at slot k-1 (the anchor for k = 1): teacher forcing, as the walk
    at inference conditions on the token drafted for the slot before, which is the true one
    exactly while the draft is still being accepted;
  - scores = unary logit + <pred[prev] * proj(h_k), succ[cand]>, CE against the label's index,
    weighted per slot like the block loss (exp(-(k-1)/gamma)), times drafter.selector_weight.
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

from dflash_trainer.train.objective import DFlashObjective, StepOutput, _auto_chunk_blocks

SELECTOR_METRICS = ["sel_loss", "sel_acc", "recall_k", "walk_accept_len"]


class DFlash2Objective(DFlashObjective):
    def __init__(self, *args, selector_weight: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        if selector_weight < 0:
            raise ValueError(f"selector_weight must be >= 0, got {selector_weight}")
        self.selector_weight = float(selector_weight)
        self.metric_names = self.metric_names + SELECTOR_METRICS

    def add_terms(self, out: StepOutput, drafter, hidden, lm_head, labels, label_valid):
        sel = _unwrap(drafter).candidate_selector
        if sel is None:
            raise ValueError("DFlash2Objective needs a DFlash2 drafter (drafter.variant=dflash2)")
        B, N, bs = labels.shape
        K = self.loss_slots
        h = hidden.view(B, N, bs, -1)[:, :, 1 : K + 1]
        tgt, prev = labels[:, :, 1 : K + 1], labels[:, :, :K]
        valid = label_valid[:, :, 1 : K + 1]
        chunk = self.chunk_blocks or _auto_chunk_blocks(lm_head, B, K)
        unary, cand, tgt_logit = top_candidates(h.detach(), lm_head, tgt, sel.top_k, chunk)
        hit = (cand == tgt[..., None]).any(-1)
        # a missing label replaces the weakest candidate (topk is sorted: the last one)
        cand_t = torch.cat([cand[..., :-1], torch.where(hit, cand[..., -1], tgt)[..., None]], -1)
        unary_t = torch.cat(
            [unary[..., :-1], torch.where(hit, unary[..., -1], tgt_logit)[..., None]], -1
        )
        pos = (cand_t == tgt[..., None]).int().argmax(-1)
        scores = unary_t + sel.pairwise(h, prev, cand_t).float()
        ce = F.cross_entropy(scores.flatten(0, 2), pos.flatten(), reduction="none").view_as(pos)
        w = self.slot_weights(hidden.device)[1 : K + 1] * valid.float()
        sel_loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
        with torch.no_grad():
            v = valid.float()
            n = v.sum().clamp_min(1.0)
            right = (scores.argmax(-1) == pos) & hit
            extra = torch.stack(
                [
                    sel_loss.detach().float(),
                    (right.float() * v).sum() / n,
                    (hit.float() * v).sum() / n,
                    walk_accept_len(sel, h.detach(), unary, cand, labels[:, :, 0], tgt, valid),
                ]
            )
        return StepOutput(
            loss=out.loss + self.selector_weight * sel_loss,
            metrics=torch.cat([out.metrics, extra]),
            metric_names=list(self.metric_names),
        )


def _unwrap(drafter):
    """The drafter behind DDP (.module) or torch.compile (._orig_mod)."""
    for attr in ("module", "_orig_mod"):
        while hasattr(drafter, attr) and not hasattr(drafter, "candidate_selector"):
            drafter = getattr(drafter, attr)
    return drafter


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
    previous choice, as drafting does (models/dflash2.CandidateSelector.walk)."""
    prev, alive = anchor, valid[:, :, 0]
    accepted = torch.ones_like(anchor, dtype=torch.float32)
    for t in range(h.shape[2]):
        scores = unary[:, :, t] + sel.pairwise(h[:, :, t], prev, cand[:, :, t]).float()
        prev = cand[:, :, t].gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
        alive = alive & valid[:, :, t] & (prev == tgt[:, :, t])
        accepted += alive.float()
    blocks = valid[:, :, 0].float()
    return (accepted * blocks).sum() / blocks.sum().clamp_min(1.0)
