"""CPU pipelines: the drafter borrows the target's cores while the target is parked ahead of it.

On a CPU the two stages split the cores (`pipeline.target_thread_share`). A fixed split leaves
cores idle whenever one stage is faster: with 2 cores the only split is 1:1, and a target that
needs half the drafter's time sits blocked on a full queue half the run (measured: target busy
46%, drafter 100%, process CPU 1.09x wall). Rebalancing the split cannot help there (there is no
other integer split of 2), so the stages time-share instead:

- A target worker that is a full hidden-state queue ahead of the drafter *parks* before its next
  forward, and stays parked until the drafter has drained the queue (hysteresis: parking at
  "full" and resuming at "empty" is what leaves the drafter whole steps with every core; resuming
  at "one free slot" would wake the target after every drafter step).
- The drafter, right after taking a batch, runs its step with every core when the target is
  parked and the queue still holds a batch. The queue only shrinks when the drafter takes a batch,
  so the target cannot resume during that step: no core is ever claimed twice.
- Batches served from the feature cache leave the target idle too (pipeline/feature_cache.py).

When the target is the slower stage the drafter already waits on an empty queue; the balance line
(observe/balance.py) then advises more anchors (free training signal) or more target devices.
On GPUs the same decision is a device ratio, not threads: target devices per drafter device,
sized from the balance line's "one drafter can absorb N target workers".

Applies with one target worker (several workers would need a count of parked producers).
"""

from __future__ import annotations

import threading
import time

from dflash_trainer.pipeline.queues import BoundedQueue, Stopped


class CoreShare:
    """Shared by the one target worker (`park_while_ahead`) and the drafter (`drafter_threads`).

    `own`: the drafter's threads under the fixed split; `all_threads`: every core of the process.
    """

    def __init__(self, hs_q: BoundedQueue, own: int, all_threads: int, park: bool = True):
        self.hs_q = hs_q
        self.park = park  # False with several target workers: only cached batches borrow
        self.own, self.all_threads = int(own), int(all_threads)
        self._parked = threading.Event()
        self.borrowed_steps = 0  # drafter steps run with every core (drafter thread only)
        self.steps = 0

    @property
    def parked(self) -> bool:
        return self._parked.is_set()

    def park_while_ahead(self, stop: threading.Event, poll_s: float) -> int:
        """Target worker, before a forward: if the queue is full, wait until it is empty.
        Returns the nanoseconds parked."""
        if not self.park or self.hs_q.qsize() < self.hs_q.capacity:
            return 0
        t0 = time.perf_counter_ns()
        self._parked.set()
        try:
            while self.hs_q.qsize() > 0:
                if stop.is_set():
                    raise Stopped(self.hs_q.name)
                # Polling, not a condition variable: one check per poll_s while parked, and the
                # drafter's get path stays the plain queue's.
                time.sleep(min(poll_s, 0.002))
        finally:
            self._parked.clear()
        return time.perf_counter_ns() - t0

    def drafter_threads(self, from_cache: bool) -> int:
        """Drafter, right after taking a batch: its OpenMP team size for this step."""
        self.steps += 1
        if from_cache or (self.parked and self.hs_q.qsize() > 0):
            self.borrowed_steps += 1
            return self.all_threads
        return self.own

    def summary(self) -> str:
        share = self.borrowed_steps / self.steps if self.steps else 0.0
        return (
            f"CPU threads: drafter {self.own} of {self.all_threads}, all {self.all_threads} "
            f"on {share:.0%} of its steps (target parked ahead or batch from the feature cache)"
        )
