"""One draft-and-accept step: the drafter proposes a block, the target's choices accept a prefix.

Shared by the decode loop (the target verifies: its choices come from a forward over the block)
and by tau_sim (a replay on cached features: the choices are the data's next tokens).

The drafter seam is `Drafter.propose`: from the drafter's hidden states at the block's draft
slots, the draft tokens. DFlash's default (models/drafter.py) is the argmax of the target's LM
head at each slot, independently. A variant that walks the block (say, re-scoring the top-k
of each slot given the previous slot's choice) implements `propose` only; the loop, the
acceptance rule and tau_sim stay as they are.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trainer.precision import module_dtype


class Drafter(Protocol):
    """What decoding needs from a drafter (models/drafter.py: DFlashDrafter)."""

    config: Any  # .block_size, .mask_token_id, .target_layer_ids

    def new_cache(self) -> Any: ...  # object with .length (context positions cached)

    def forward_infer(
        self, block_embeds: torch.Tensor, new_features: torch.Tensor, cache: Any, start: int
    ) -> torch.Tensor: ...

    def propose(
        self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor
    ) -> torch.Tensor:
        """[B, k, H] hidden states of the draft slots, the LM head and the anchors [B] (slot 0's
        committed token) -> [B, k] draft token ids (greedy)."""
        ...


def check_drafter(drafter: Drafter | None, block_size: int, layer_ids: list[int]) -> Drafter:
    """`drafter`, checked to fit a loop with `block_size` over a target tapping `layer_ids`."""
    if drafter is None:
        raise ValueError("block_size > 1 needs a drafter")
    dcfg = drafter.config
    if block_size > dcfg.block_size:
        raise ValueError(
            f"block_size {block_size} exceeds the drafter's trained block size {dcfg.block_size}"
        )
    tl = getattr(dcfg, "target_layer_ids", None)
    if tl is not None and list(tl) != layer_ids:
        raise ValueError(
            f"drafter was trained on target layers {list(tl)}, but the target taps {layer_ids}"
        )
    return drafter


def draft_block(
    drafter: Drafter,
    embed_weight: torch.Tensor,
    lm_head: nn.Module,
    last: torch.Tensor,
    start: int,
    ctx: torch.Tensor,
    dcache: Any,
    q: int,
    k: int,
) -> torch.Tensor:
    """[1, k+1]: the committed token `last` ([1] device tensor) at position `start`, then the
    first k of the q-1 drafts. `ctx` [1, C, n*H]: the target features of the C positions before
    `start` the drafter has not seen yet. The drafter always sees its whole q-slot block, as in
    training; only the verified slots are proposed."""
    d_dtype = module_dtype(drafter, embed_weight.dtype)
    h_dtype = module_dtype(lm_head, embed_weight.dtype)
    mask_id = int(drafter.config.mask_token_id)
    block = torch.full((1, q), mask_id, dtype=torch.long, device=last.device)
    block[0, 0] = last[0]
    cached = getattr(dcache, "length", start - ctx.shape[1])
    if cached + ctx.shape[1] != start:
        raise RuntimeError(
            f"drafter cache holds {cached} context positions + "
            f"{ctx.shape[1]} new != block start {start}"
        )
    hidden = drafter.forward_infer(
        F.embedding(block, embed_weight).to(d_dtype), ctx.to(d_dtype), dcache, start
    )
    block[0, 1 : k + 1] = drafter.propose(hidden[:, 1 : k + 1].to(h_dtype), lm_head, block[:, 0])[0]
    return block[:, : k + 1]


def accepted(drafts: list[int], choices: list[int]) -> int:
    """a: how many leading drafts equal the target's choice at their position."""
    a, n = 0, min(len(drafts), len(choices))
    while a < n and drafts[a] == choices[a]:
        a += 1
    return a


def commit(new: list[int], remaining: int, stop: set[int]) -> tuple[list[int], bool]:
    """The tokens a cycle commits from its accepted drafts + bonus `new`: at most `remaining`,
    cut after the first stop id; and whether it stopped."""
    new = new[:remaining]
    for i, tok in enumerate(new):
        if tok in stop:
            return new[: i + 1], True
    return new, False


class AdaptiveVerify:
    """How many drafts the next cycle verifies (`eval.verify=adaptive`), none while drafting
    does not pay for its time.

    On a CPU the target's verify pass costs with the number of positions it scores (the
    embedded target in fp32 on 2 cores: 1 position 18.6 ms, 2-3 positions 20.6, 8 25, 16 36;
    bench/LOG.md), so verifying 15 drafts when the drafter gets 2 right pays for 13 positions
    that are thrown away. Verifying fewer is lossless (every emitted token is still the
    target's choice); it only caps a cycle's tokens. The cap follows the drafter: the most
    drafts accepted over the last `window` cycles plus `margin`, doubled whenever a cycle
    accepts every verified draft (the drafter may reach further). It starts at the whole block.
    On GPUs a verify pass costs the same for 16 positions as for 2, so `full` is right there.

    The gate (when the loop reports each cycle's seconds): a cycle that drafts costs the
    drafter's pass besides the verify, so where the drafter is often wrong (chat on a CPU: 1.37
    tokens a cycle against the ~1.45 a cycle must make to beat plain steps) plain steps are
    faster. Over each window of drafting cycles the gate compares their tokens per second with a
    plain step's; where plain steps win clearly (by `clear_loss`: a marginal window is noise,
    and drafting's bursts are lost while it is held off), the next `backoff` cycles are plain
    (no drafter pass, one position verified), after which drafting is tried again, the stretch
    doubling while it keeps losing (up to `max_backoff`). A plain step's cost is first measured
    when a window made fewer than `probe_below` tokens a cycle: a drafter that clearly pays is
    never interrupted (2: a drafting cycle costs 1.4-1.6 plain steps on 2 CPU cores, about 1 on
    a GPU). Every cycle, plain or not, is lossless. Measured on `make quality`'s drafter, AVX2
    and native (bench/LOG.md).
    """

    def __init__(
        self,
        max_drafts: int,
        window: int = 8,
        margin: int = 2,
        backoff: int = 8,
        max_backoff: int = 64,
        probe_below: float = 2.0,
        clear_loss: float = 0.9,
    ):
        self.max_drafts, self.margin = max_drafts, margin
        self.k = max_drafts  # drafts of the next drafting cycle
        self.recent: deque[int] = deque(maxlen=window)
        self.first_backoff, self.backoff, self.max_backoff = backoff, backoff, max_backoff
        self.probe_below = probe_below
        self.clear_loss = clear_loss  # hold off only where plain steps win by this much
        self.drafting: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds)
        self.step_s: float | None = None  # a plain step's seconds, once measured
        self.plain_left = 0  # plain cycles before drafting is tried again

    def drafts(self) -> int:
        """Drafts the next cycle verifies: 0 (a plain step) while the gate holds drafting off."""
        return 0 if self.plain_left > 0 else self.k

    def update(self, accepted: int, verified: int, seconds: float | None = None) -> None:
        """After a cycle that verified `verified` drafts (0: a plain step) and accepted
        `accepted` of them, in `seconds` (None: no timing, the window alone)."""
        if verified == 0:
            self.plain_left = max(0, self.plain_left - 1)
            if seconds is not None:
                self.step_s = seconds if self.step_s is None else (self.step_s + seconds) / 2
            return
        self.recent.append(accepted)
        if accepted >= verified:
            self.k = min(self.max_drafts, 2 * verified)
        else:
            self.k = min(self.max_drafts, max(self.recent) + self.margin)
        if seconds is None:
            return
        self.drafting.append((accepted + 1, seconds))
        if len(self.drafting) < (self.drafting.maxlen or 1):
            return
        tokens = sum(n for n, _ in self.drafting)
        spent = sum(t for _, t in self.drafting)
        if self.step_s is None:
            if tokens < self.probe_below * len(self.drafting):
                self._hold_off()  # its first plain steps measure what a plain step costs
        elif tokens * self.step_s < self.clear_loss * spent:
            self._hold_off()
        else:
            self.backoff = self.first_backoff

    def _hold_off(self) -> None:
        self.plain_left = self.backoff
        self.backoff = min(2 * self.backoff, self.max_backoff)
        self.drafting.clear()  # the next drafting stretch is judged on its own cycles
