"""The drafter trains batches in the plan's order, however many target workers feed it.

Target workers take work items in order but finish them in any order (on CPUs the shared lock
serialises whole forwards, yet the hand-offs after it can swap; on GPUs the lock orders kernel
launches, not completions). Training in arrival order would make the run depend on timing: the
losses would differ from a one-worker run, and a checkpoint's position would not be a prefix of
its epoch, so it could not be resumed exactly. `InOrder` holds a batch that arrives early until
the ones before it have been handed on: the drafter trains exactly what one worker would have
fed it, step for step. What it holds is bounded by what the other workers finish during one
forward of the late batch; its count is the drafter's `held` gauge.
"""

from __future__ import annotations

from dflash_trainer.pipeline.messages import HiddenBatch


class InOrder:
    def __init__(self, epoch: int, seq_no: int):
        """`(epoch, seq_no)`: the first batch of this run (a resume starts inside an epoch)."""
        self.next = (int(epoch), int(seq_no))
        self.sizes: dict[int, int] = {}  # epoch -> its batch count, once EpochEnd says it
        self.held: dict[tuple[int, int], HiddenBatch] = {}

    def add(self, hb: HiddenBatch) -> list[HiddenBatch]:
        """Take one arrival; return the batches now due, in order (often [hb], maybe none)."""
        key = (hb.epoch, hb.seq_no)
        if key < self.next or key in self.held:
            raise RuntimeError(f"batch {key} arrived twice (next due: {self.next})")
        self.held[key] = hb
        return self._due()

    def epoch_end(self, epoch: int, num_batches: int) -> list[HiddenBatch]:
        """The prefetcher queued all `num_batches` of `epoch`: the next epoch follows its last."""
        self.sizes[int(epoch)] = int(num_batches)
        return self._due()

    def _due(self) -> list[HiddenBatch]:
        out: list[HiddenBatch] = []
        while True:
            epoch, k = self.next
            if k >= self.sizes.get(epoch, k + 1):
                self.next = (epoch + 1, 0)
                continue
            hb = self.held.pop(self.next, None)
            if hb is None:
                return out
            out.append(hb)
            self.next = (epoch, k + 1)
