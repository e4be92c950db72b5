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
- The other way round: while the drafter waits for a batch (the target is the slower stage), the
  target borrows its cores *between decoder layers* (`target_layer_threads`, from a pre-hook on
  each layer: a forward is one long step, so a per-step choice would come too late or hold the
  cores too long). Once the drafter takes a batch, the target's next layer gives them back; the
  drafter starts on its own share, so at most one layer runs with both teams on a core.

With 3 or more cores there are other integer splits, and the split itself follows the
bottleneck (`adapt`), in both directions:

- Each stage reports its steps' thread-seconds (elapsed x threads used). Every `window_s` the
  drafter thread compares the two sums: under linear scaling the split that equalises the stages
  gives the target `cores x work_target / (work_target + work_drafter)` threads. The allotment
  moves one thread at a time towards that, and only when it is more than 0.75 threads away
  (hysteresis: no see-saw between two neighbouring splits).
- Neither stage ever gets fewer than one thread (a stage with no threads would starve the other).
- A thread moves giver first: each stage runs with min(its allotment, cores - the threads the
  other stage runs with now), so the receiver's team grows only once the giver's next step has
  shrunk its own. No core is claimed twice across a move.

Parking still applies on top (a target a full queue ahead lends every core), and when the target
is the slower stage the split moves threads to it. On GPUs the same decision is a device ratio,
not threads: target devices per drafter device, sized from the balance line's "one drafter can
absorb N target workers".

Whether parking and borrowing pay is measured, not assumed (`trial_windows`): on some CPUs a
step on every core gains little over one on its share, and the park/resume hysteresis can leave
the drafter waiting for a batch, so sharing measured 0.92x the fixed split at the embedded
preset's shape on a 2-core AVX512-BF16 EPYC. So the drafter's first non-cached steps alternate
windows of `TRIAL_STEPS` steps with sharing on and off (the fixed split), `trial_windows` of
each, and the run keeps the mode that trained more tokens per wall second (median of its
windows). Batches from the feature cache always take every core (the target has nothing to do
then) and a window that meets one is not counted.

Applies with one target worker (several workers would need a count of parked producers).
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch

from dflash_trainer.observe.counters import WorkerCounters
from dflash_trainer.pipeline.queues import BoundedQueue, Stopped


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (taskset, a container's cpuset), not
    os.cpu_count()'s count of the host's, which would split threads for cores the process
    cannot use (a 2-CPU container on a 64-core host: 32 threads a stage)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        return os.cpu_count() or 1


TRIAL_STEPS = 8  # drafter steps per trial window (a few seconds on the embedded preset)


class ShareTrial:
    """Sharing on or off, decided by measurement (module docstring): windows of `steps` drafter
    steps alternate the two modes, `windows` of each, starting with sharing on; then the mode
    with the higher median trained tokens per wall second is kept. Fed by the drafter thread
    only; pure given its clock readings, for tests."""

    def __init__(self, windows: int, steps: int = TRIAL_STEPS):
        self.windows, self.steps = windows, steps
        self.rates: dict[bool, list[float]] = {True: [], False: []}
        self.sharing = True  # the mode of the window being measured
        self.decided: bool | None = None if windows > 0 else True
        self._t0: int | None = None  # the window's start: the end of the step before it
        self._n = self._tokens = 0

    def step_done(self, tokens: int, now_ns: int, from_cache: bool) -> bool:
        """One drafter step ended at `now_ns`. Returns whether the stages share from now on."""
        if self.decided is not None:
            return self.decided
        if self._t0 is None or from_cache:  # the first step (warm-up) or a cached batch: restart
            self._t0, self._n, self._tokens = now_ns, 0, 0
            return self.sharing
        self._n += 1
        self._tokens += tokens
        if self._n < self.steps:
            return self.sharing
        self.rates[self.sharing].append(self._tokens / max(now_ns - self._t0, 1) * 1e9)
        self._t0, self._n, self._tokens = now_ns, 0, 0
        if len(self.rates[False]) >= self.windows:
            on, off = self.medians()
            self.decided = on >= off
            return self.decided
        self.sharing = not self.sharing
        return self.sharing

    def medians(self) -> tuple[float, float]:
        """Median tokens/s of the windows with sharing on and with it off (both measured)."""
        return statistics.median(self.rates[True]), statistics.median(self.rates[False])

    def summary(self) -> str:
        if not self.rates[False]:
            return "not measured"
        on, off = self.medians()
        verdict = {None: "still measuring", True: "kept", False: "switched off"}[self.decided]
        windows = f"{len(self.rates[True])}+{len(self.rates[False])} windows of {self.steps} steps"
        return (
            f"sharing measured {on:.0f} vs the fixed split {off:.0f} tok/s "
            f"({on / max(off, 1e-9):.3f}x, {windows}): {verdict}"
        )


def rebalanced(target_threads: int, cores: int, work_target: float, work_drafter: float) -> int:
    """The target's next allotment: one thread towards the split that equalises the stages'
    thread-seconds, kept within [1, cores - 1]. Pure, for tests with fake busy profiles."""
    if cores < 3 or work_target + work_drafter <= 0:
        return target_threads
    ideal = cores * work_target / (work_target + work_drafter)
    if ideal > target_threads + 0.75:
        target_threads += 1
    elif ideal < target_threads - 0.75:
        target_threads -= 1
    return min(max(target_threads, 1), cores - 1)


class CoreShare:
    """Shared by the one target worker (`park_while_ahead`, `target_threads`) and the drafter
    (`drafter_threads`); both report their steps' work with `record`.

    `own`: the drafter's threads under the fixed split; `all_threads`: every core of the process.
    `adapt`: move threads between the stages (3 or more cores; see the module docstring).
    `trial_windows`: measure sharing against the fixed split first (ShareTrial); 0 = share
    from the start without measuring.
    """

    def __init__(
        self,
        hs_q: BoundedQueue,
        own: int,
        all_threads: int,
        park: bool = True,
        adapt: bool = False,
        window_s: float = 2.0,
        trial_windows: int = 0,
    ):
        self.hs_q = hs_q
        self.park = park  # False with several target workers: only cached batches borrow
        self.trial = ShareTrial(trial_windows if park else 0)
        # parking and borrowing between the stages now (written by the drafter thread only)
        self.sharing = park
        self.all_threads = int(all_threads)
        self.start_split = (self.all_threads - int(own), int(own))  # (target, drafter)
        self.target_alloc = self.start_split[0]  # written by the drafter thread only
        self.adapt = adapt and self.all_threads >= 3
        self.window_ns = int(window_s * 1e9)
        self._parked = threading.Event()
        # the threads each stage runs its current step with (each written by its own thread)
        self._running = {"target": self.start_split[0], "drafter": self.start_split[1]}
        self._step_team = self.start_split[0]  # the target's team for its current forward
        self._work = {"target": 0.0, "drafter": 0.0}  # thread-seconds in this window
        self._window_t0 = time.perf_counter_ns()
        self.moves = 0
        self.borrowed_steps = 0  # drafter steps run with every core (drafter thread only)
        self.steps = 0
        self.borrowed_layers = 0  # target decoder layers run with every core (target thread)
        self.layers = 0

    @property
    def own(self) -> int:
        """The drafter's allotment now."""
        return self.all_threads - self.target_alloc

    @property
    def parked(self) -> bool:
        return self._parked.is_set()

    def park_while_ahead(self, stop: threading.Event, poll_s: float) -> int:
        """Target worker, before a forward: if the queue is full, wait until it is empty.
        Returns the nanoseconds parked."""
        if not self.sharing or self.hs_q.qsize() < self.hs_q.capacity:
            return 0
        t0 = time.perf_counter_ns()
        self._parked.set()
        try:
            while self.hs_q.qsize() > 0 and self.sharing:  # a trial may switch sharing off
                if stop.is_set():
                    raise Stopped(self.hs_q.name)
                # Polling, not a condition variable: one check per poll_s while parked, and the
                # drafter's get path stays the plain queue's.
                time.sleep(min(poll_s, 0.002))
        finally:
            self._parked.clear()
        return time.perf_counter_ns() - t0

    def target_threads(self) -> int:
        """Target worker, before a forward (after parking): its OpenMP team size for it."""
        n = max(1, min(self.target_alloc, self.all_threads - self._running["drafter"]))
        self._running["target"] = self._step_team = n
        return n

    def target_layer_threads(self) -> int:
        """Target worker, before each decoder layer: every core while the drafter waits for a
        batch, its step's team (`target_threads`) otherwise."""
        self.layers += 1
        if self.sharing and self._running["drafter"] == 0:
            self.borrowed_layers += 1
            n = self.all_threads
        else:
            n = self._step_team
        self._running["target"] = n
        return n

    def drafter_threads(self, from_cache: bool) -> int:
        """Drafter, right after taking a batch: its OpenMP team size for this step."""
        self.steps += 1
        if from_cache or (self.sharing and self.parked and self.hs_q.qsize() > 0):
            self.borrowed_steps += 1
            n = self.all_threads
        else:
            n = max(1, min(self.own, self.all_threads - self._running["target"]))
        self._running["drafter"] = n
        return n

    def record(
        self, stage: str, elapsed_ns: int, threads: int, tokens: int = 0, from_cache: bool = False
    ) -> None:
        """A step's work (elapsed x threads), from the stage's own thread. The drafter's call
        (with the step's `tokens`) also feeds the sharing trial and rebalances the split once a
        window has passed."""
        self._work[stage] += elapsed_ns * 1e-9 * threads
        if stage != "drafter":
            return
        self._running["drafter"] = 0  # waiting for its next batch: the target may borrow
        now = time.perf_counter_ns()
        if self.park:
            self.sharing = self.trial.step_done(tokens, now, from_cache)
        if not self.adapt:
            return
        if now - self._window_t0 < self.window_ns:
            return
        new = rebalanced(
            self.target_alloc, self.all_threads, self._work["target"], self._work["drafter"]
        )
        if new != self.target_alloc:
            self.target_alloc = new
            self.moves += 1
        self._work = {"target": 0.0, "drafter": 0.0}
        self._window_t0 = now

    def summary(self) -> str:
        share = self.borrowed_steps / self.steps if self.steps else 0.0
        split = f"target {self.target_alloc} : drafter {self.own} of {self.all_threads}"
        if self.adapt:
            t0, d0 = self.start_split
            split += f" (adaptive: from {t0} : {d0}, {self.moves} moves)"
        text = (
            f"CPU threads: {split}; the drafter ran with all {self.all_threads} on {share:.0%} "
            "of its steps (target parked ahead or batch from the feature cache)"
        )
        if self.layers:
            lent = self.borrowed_layers / self.layers
            text += f", the target on {lent:.0%} of its layers (drafter waiting for a batch)"
        if self.park and self.trial.windows:
            text += f"; {self.trial.summary()}"
        return text


class DrafterTeam:
    """The drafter worker's side of CoreShare, around each step: before it, the OpenMP team size
    the share allows (every core while the target is parked or the batch came from the feature
    cache); after it, the step's measured work. `threads`: the team size the worker's Stage set
    at thread start."""

    def __init__(self, cores: CoreShare, threads: int):
        self.cores, self.threads = cores, threads

    def before(self, from_cache: bool, counters: WorkerCounters) -> None:
        want = self.cores.drafter_threads(from_cache)
        if want != self.threads:  # this worker thread's OpenMP team size
            torch.set_num_threads(want)
            self.threads = want
        counters.gauges["threads"] = want

    def after(self, elapsed_ns: int, tokens: int, from_cache: bool) -> None:
        self.cores.record("drafter", elapsed_ns, self.threads, tokens, from_cache)
