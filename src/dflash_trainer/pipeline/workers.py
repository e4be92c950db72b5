"""The pipeline's worker threads (runtime.py has the data flow and the shutdown protocol) and the
drafter-side step loop they share. The thread protocol is Stage's (stage.py).

Every worker: owns its counters (single writer), blocks only through BoundedQueue (timeouts +
stop event), reports its end (`End`) or its failure (`StageFailure`) to the supervisor's
`events` queue as a value, and never reads a device value on the host.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from dflash_trainer.checkpoint import TrainState
from dflash_trainer.observe.counters import WorkerCounters
from dflash_trainer.observe.profile import StepMeter
from dflash_trainer.pipeline.cores import CoreShare, DrafterTeam
from dflash_trainer.pipeline.messages import End, EpochEnd, HiddenBatch, WorkItem
from dflash_trainer.pipeline.ordering import InOrder
from dflash_trainer.pipeline.protocols import DrafterStepFn, StepHooks, TargetStepFn
from dflash_trainer.pipeline.queues import BoundedQueue
from dflash_trainer.pipeline.stage import Stage
from dflash_trainer.train.budget import TimeBudget

log = logging.getLogger(__name__)


class TargetWorker(Stage):
    """work_q -> TargetStep -> hs_q. Passes EpochEnd on; on End re-queues it for its siblings."""

    role = "target"

    def __init__(
        self,
        name,
        *,
        events,
        stop,
        threads,
        faults,
        step_fn: TargetStepFn,
        work_q: BoundedQueue,
        hs_q: BoundedQueue,
        lock: threading.Lock,
        cores: CoreShare | None = None,
    ):
        super().__init__(name, events=events, stop=stop, threads=threads, faults=faults)
        self.step_fn, self.work_q, self.hs_q, self.lock = step_fn, work_q, hs_q, lock
        self.cores = cores  # CPU: pipeline.cores.CoreShare (parking, borrowing, the split)
        self.team = threads  # this thread's OpenMP team size now
        self._thread_ns, self._team_since = 0, 0  # the current step's thread-ns (set_team)
        self._ident: int | None = None  # this worker's thread, for the decoder-layer hooks

    def on_end(self, item: End) -> None:
        self.work_q.put_nowait(item)  # siblings must see it too
        self.hs_q.put(End(self.name), self.stop)

    def on_epoch_end(self, item: EpochEnd) -> None:
        self.hs_q.put(item, self.stop)

    def _count_team_span(self, now: int) -> None:
        """Adds the thread-ns the current team ran since the last change (or the step's start)."""
        self._thread_ns += (now - self._team_since) * self.team
        self._team_since = now

    def set_team(self, team: int) -> None:
        """This thread's OpenMP team size (between steps, or between decoder layers)."""
        if team != self.team:
            self._count_team_span(time.perf_counter_ns())
            torch.set_num_threads(team)
            self.team = self.counters.gauges["threads"] = team

    def _layer_hook(self, _module, _args):
        # the eval loop runs the same layers from its own thread: only this worker's forward
        if self.cores is not None and threading.get_ident() == self._ident:
            self.set_team(self.cores.target_layer_threads())

    def loop(self) -> None:
        hooks = []
        if self.cores is not None:  # pipeline/cores.py: borrowing
            self._ident = threading.get_ident()
            hooks = [
                layer.register_forward_pre_hook(self._layer_hook)
                for layer in self.step_fn.target.layers
            ]
        try:
            self._loop()
        finally:
            for h in hooks:
                h.remove()

    def _loop(self) -> None:
        c = self.counters
        c.gpu_timer = self.step_fn.timer
        meter = StepMeter(c)
        for item in self.items(self.work_q):
            assert isinstance(item, WorkItem), type(item)
            if self.cores is not None:
                parked = self.cores.park_while_ahead(self.stop, self.hs_q.poll_s)
                c.wait_out_ns += parked  # waiting on the drafter, like a blocked put
                c.add_phase("parked", parked)
                self.set_team(self.cores.target_threads())
            t1 = time.perf_counter_ns()
            self._thread_ns, self._team_since = 0, t1
            c.begin_busy(t1)
            # (the lock: the eval loop borrows the target between steps)
            with self.lock, self.guard("target", item.batch.input_ids.shape, c.steps):
                meter.start()
                hb = self.step_fn(item, meter)
            t2 = time.perf_counter_ns()
            c.end_busy(t2)
            if self.cores is not None:  # thread-ns, borrowed cores included
                self._count_team_span(t2)
                self.cores.record("target", self._thread_ns, 1)
            t3 = time.perf_counter_ns()
            self.hs_q.put(hb, self.stop)
            c.wait_out_ns += time.perf_counter_ns() - t3
            c.steps += 1
            c.items += int(item.batch.sample_ids.numel())
            c.tokens += item.batch.num_real_tokens
            c.padded_tokens += item.batch.num_padded_tokens
            c.beat()


class StepLoop:
    """The drafter side of the step loop, shared by the drafter worker and the sequential
    worker: runs the step function on each HiddenBatch and keeps the training position (for
    exact resume), the sample ledger, and runs the between-steps hooks (on the thread that owns
    the drafter).

    `hooks` (protocols.StepHooks, or None): `on_step_end(step)` after every optimizer step
    (periodic checkpoint / eval); where `hooks.votes` (torchrun), `stop_vote()`, a collective
    every rank runs after every optimizer step (all ranks stop after the same step).
    `ledger`: the list the (epoch, sample ids) of each batch are appended to; the checkpoint
    takes them (shared with the hooks).
    `budget`: a train.budget.TimeBudget (optim.time_budget_s), started at the first step; the
    loop ends after the step that spends it (under torchrun the stop vote carries it instead).
    """

    def __init__(
        self,
        *,
        step_fn: DrafterStepFn,
        state: TrainState,
        max_steps: int,
        hooks: StepHooks | None = None,
        ledger: list[tuple[int, list[int]]] | None = None,
        budget: TimeBudget | None = None,
        team: DrafterTeam | None = None,
    ):
        self.step_fn = step_fn
        self.team = team  # CPU pipelines with share_cores: the drafter's OpenMP team per step
        self.budget = budget
        self.state = state
        self.max_steps = max_steps
        self.hooks = hooks
        self.votes = hooks is not None and hooks.votes
        self.stopped_by_vote = False
        # (epoch, sample ids) since the last checkpoint took them
        self.ledger: list[tuple[int, list[int]]] = [] if ledger is None else ledger

    def consume(self, hb: HiddenBatch, counters: WorkerCounters) -> bool:
        """Train on one HiddenBatch. Returns False when max_steps is reached."""
        if hb.epoch != self.state.epoch:
            # First batch of a new epoch: the previous one is complete.
            self.state.epoch, self.state.consumed = hb.epoch, []
            self.state.consumed_samples = []
        if self.budget is not None:
            self.budget.start()
        if counters.gpu_timer is None:
            counters.gpu_timer = self.step_fn.timer
        if self.team is not None:
            self.team.before(hb.from_cache, counters)
        t0 = time.perf_counter_ns()
        counters.begin_busy(t0)
        stepped = self.step_fn(hb, self.state.step, StepMeter(counters))
        t1 = time.perf_counter_ns()
        counters.end_busy(t1)
        if self.team is not None:  # the token count is a shape: no device read
            self.team.after(t1 - t0, hb.input_ids.numel(), hb.from_cache)
        self.state.consumed.append(hb.seq_no)
        self.state.micro_step += 1
        self.state.tokens += hb.num_real_tokens
        ids = hb.sample_ids.tolist()  # CPU tensor: no device sync
        self.ledger.append((hb.epoch, ids))
        self.state.consumed_samples.extend(ids)
        counters.items += int(hb.sample_ids.numel())
        counters.tokens += hb.num_real_tokens
        counters.padded_tokens += int(hb.input_ids.numel())
        counters.query_tokens += self.step_fn.query_tokens(hb)  # useful blocks only
        counters.gauges["epoch"] = float(hb.epoch)
        if stepped:
            self.state.step += 1
            counters.steps += 1
            if self.hooks is not None:
                self.hooks.on_step_end(self.state.step)
            if self.votes and self.hooks is not None and self.hooks.stop_vote():
                self.stopped_by_vote = True
                counters.beat()
                return False
        counters.beat()
        if stepped and not self.votes and self.budget is not None and self.budget.spent():
            return False
        return not (self.max_steps and self.state.step >= self.max_steps)


class DrafterWorker(Stage):
    """hs_q -> StepLoop, in the plan's order (pipeline/ordering.py) from `start` = (epoch,
    seq_no), the prefetcher's start. Ends after an End from every target worker (or at
    max_steps)."""

    role = "drafter"

    def __init__(
        self,
        name,
        *,
        events,
        stop,
        threads,
        faults,
        step_loop: StepLoop,
        hs_q: BoundedQueue,
        num_producers: int,
        done: threading.Event,
        start: tuple[int, int] = (0, 0),
    ):
        super().__init__(name, events=events, stop=stop, threads=threads, faults=faults)
        self.step_loop, self.hs_q, self.num_producers = step_loop, hs_q, num_producers
        self.done = done
        self.order = InOrder(*start)
        self._due: list[HiddenBatch] = []  # released by an EpochEnd, trained next

    def on_epoch_end(self, item: EpochEnd) -> None:
        log.info("drafter: epoch %d: all %d batches handed over", item.epoch, item.num_batches)
        self._due += self.order.epoch_end(item.epoch, item.num_batches)

    def loop(self) -> None:
        for item in self.items(self.hs_q, ends=self.num_producers):
            self._due += self.order.add(item)
            self.counters.gauges["held"] = float(len(self.order.held))
            if not self._train_due():
                break
        else:
            self._train_due()
            if self.order.held:
                raise RuntimeError(
                    f"the target workers ended with batches {sorted(self.order.held)[:4]} held "
                    f"for order, batch {self.order.next} never arrived"
                )
        self.done.set()

    def _train_due(self) -> bool:
        """Train the batches due; False when the step loop is done (max_steps, budget)."""
        c = self.counters
        while self._due:
            item = self._due.pop(0)
            with self.guard("drafter", item.input_ids.shape, c.steps):
                more = self.step_loop.consume(item, c)
            if not more:
                return False
        return True


class SequentialWorker(Stage):
    """The baseline schedule: target step then drafter step in one thread, as existing
    trainers do. Same step functions as the pipelined schedule."""

    role = "sequential"

    def __init__(
        self,
        name,
        *,
        events,
        stop,
        threads,
        faults,
        target_step: TargetStepFn,
        step_loop: StepLoop,
        work_q: BoundedQueue,
        done: threading.Event,
        lock: threading.Lock,
    ):
        super().__init__(name, events=events, stop=stop, threads=threads, faults=faults)
        self.target_step, self.step_loop, self.work_q = target_step, step_loop, work_q
        self.done, self.lock = done, lock

    def loop(self) -> None:
        c = self.counters
        for item in self.items(self.work_q):
            shape = item.batch.input_ids.shape
            with self.lock, self.guard("target", shape, c.steps):
                hb = self.target_step(item)
            with self.guard("drafter", shape, c.steps):
                more = self.step_loop.consume(hb, c)
            if not more:
                break
        self.done.set()
