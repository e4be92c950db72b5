"""Where a training block starts: uniformly in the answer (the published recipe), or partly where
the drafter would start one at inference (`objective.anchors` = random | on_policy | mixed:P).

At inference a block starts right after the previous block's acceptance ended: at anchor p with
a drafted tokens accepted, the target's correction sits at p + a + 1 and the next block starts
there. Those positions are not uniform: they are where the drafter was just wrong. Every training
step already knows, for each of its blocks, how many leading drafted slots the drafter got right
against the target's answer (teacher forced, the same test verification applies to a greedy
answer), so the block's *next start* p + a + 1 comes for free; a block whose scored slots were
all right (a = loss_slots) has no failure to learn from and gives none.

`AnchorPolicy` keeps, per training sample, up to `slots` next starts from the last step that
trained on it, in one device tensor (no host round trip: the prefetcher and the step never read
it), and hands them to the objective the next time the sample is trained on: a share P of that
batch's anchors is drawn from them (those that are valid anchors), the rest uniformly
(train/objective.py `sample_anchors`). The memory is part of the checkpoint, so a resume
continues with the positions the run would have had.
"""

from __future__ import annotations

import torch

# Next starts kept per sample: enough for a share of a CPU recipe's anchors (tens), and a bounded
# table on a GPU data set (800K samples x 64 x int32 = 205 MB).
MAX_SLOTS = 64


class AnchorPolicy:
    """The drafter's next starts per training sample, on `device` (module docstring)."""

    def __init__(self, share: float, num_anchors: int, num_samples: int, device):
        self.share = float(share)
        self.slots = max(1, min(num_anchors, MAX_SLOTS))
        self.num_anchors = num_anchors
        self.device = torch.device(device)
        self.positions = torch.full((num_samples, self.slots), -1, dtype=torch.int32, device=device)

    def preferred_count(self, num_anchors: int) -> int:
        """Anchors of a row of `num_anchors` drawn from the next starts (at most `slots`)."""
        return min(self.slots, max(1, round(self.share * num_anchors)))

    def rows(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """The batch's sample ids as this memory's row index, on its device (once per step)."""
        return sample_ids.to(self.device, non_blocking=True).long()

    def preferred(self, rows: torch.Tensor) -> torch.Tensor:
        """[B, slots] next starts of the batch's samples (`rows`: self.rows), -1 = none."""
        return self.positions.index_select(0, rows)

    def record(self, rows: torch.Tensor, next_starts: torch.Tensor, generator: torch.Generator):
        """Keep up to `slots` of each row's `next_starts` [B, N] (-1: none), drawn at random
        among the row's, as its sample's memory (replacing the last one). `rows`: self.rows."""
        B, N = next_starts.shape
        has = next_starts >= 0
        keys = torch.rand(B, N, device=next_starts.device, generator=generator)
        keys = torch.where(has, keys, torch.full_like(keys, -1.0))
        k = min(self.slots, N)
        top, idx = torch.topk(keys, k, dim=1)
        kept = torch.where(top >= 0, next_starts.gather(1, idx), torch.full_like(idx, -1))
        if k < self.slots:
            kept = torch.nn.functional.pad(kept, (0, self.slots - k), value=-1)
        self.positions.index_copy_(0, rows, kept.to(torch.int32))

    def state_dict(self) -> dict:
        return {"share": self.share, "positions": self.positions}

    def load_state_dict(self, state: dict) -> None:
        saved = state["positions"]
        if tuple(saved.shape) != tuple(self.positions.shape):
            raise ValueError(
                f"the checkpoint's on-policy anchor memory is {tuple(saved.shape)} (samples x "
                f"slots), this run's {tuple(self.positions.shape)}: resume with the same data "
                "and objective.num_anchors"
            )
        self.positions.copy_(saved.to(self.positions.device))
