"""Worker threads of the pipeline. See runtime.py for the data flow and the shutdown protocol.

Every worker: owns its counters (single writer), blocks only through BoundedQueue (timeouts +
stop event), reports its end (`End`) or its failure (`StageFailure`) to the supervisor's
`events` queue as a value, and never reads a device value on the host.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

import torch

from dflash_trainer.observe.counters import WorkerCounters
from dflash_trainer.pipeline.messages import End, EpochEnd, HiddenBatch, StageFailure, WorkItem
from dflash_trainer.pipeline.queues import BoundedQueue, Stopped

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised by the `pipeline.fault` test hook."""


class BatchOutOfMemory(RuntimeError):
    """Out of memory on one batch: says which stage, the batch shape and the setting to lower."""


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    )  # CPU allocator


@contextlib.contextmanager
def oom_context(stage: str, shape) -> contextlib.AbstractContextManager:
    """Turn an OOM inside a step into a message a user can act on."""
    try:
        yield
    except BaseException as e:
        if not _is_oom(e):
            raise
        rows, seq = int(shape[0]), int(shape[1])
        hint = (
            "batching.max_tokens (token budget per batch) or data.max_length"
            if stage == "target"
            else "batching.max_tokens or drafter.num_anchors, or set drafter.loss_chunk_blocks to "
            "a few blocks (0 = auto: 128 MiB of logits on CPU, 2 GiB on CUDA)"
        )
        raise BatchOutOfMemory(
            f"out of memory in the {stage} step on a batch of {rows} x {seq} tokens; lower "
            f"{hint}, or give the stage more memory. ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]})"
        ) from e


class FaultInjector:
    """`STAGE[@RANK]:STEP[:KIND]`: when STAGE's step counter reaches STEP, raise (default), `hang`,
    `oom` (an out-of-memory error inside the step), or send this process a `sigterm` (tests the
    graceful-stop path end to end). With `@RANK` it
    fires only in that torchrun rank."""

    def __init__(self, spec: str, rank: int = 0):
        self.stage, self.step, self.kind = None, -1, "raise"
        if spec:
            parts = spec.split(":")
            self.stage, self.step = parts[0], int(parts[1])
            self.kind = parts[2] if len(parts) > 2 else "raise"
            if "@" in self.stage:
                self.stage, only = self.stage.split("@", 1)
                if int(only) != rank:
                    self.stage = None

    def check(self, stage: str, step: int, stop: threading.Event) -> None:
        if self.stage is None or not stage.startswith(self.stage) or step != self.step:
            return
        if self.kind == "sigterm":
            import os
            import signal

            self.stage = None  # once
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.kind == "oom":
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected in {stage} at step {step})")
        if self.kind == "hang":
            log.warning("fault hook: %s hangs at step %d", stage, step)
            while True:  # a stuck stage: ignores everything; the stall detector aborts
                time.sleep(1.0)
        raise InjectedFault(f"injected fault in stage '{stage}' at step {step}")


class Worker(threading.Thread):
    """Base: runs `loop()`, turns its exit into an End or a StageFailure on `events`."""

    role = ""  # observe.counters.ROLES; each subclass names its own

    def __init__(
        self,
        name: str,
        events: queue.Queue,
        stop: threading.Event,
        threads: int,
        faults: FaultInjector,
    ):
        super().__init__(name=name, daemon=True)  # daemon: a hung stage cannot block exit
        self.counters = WorkerCounters(name=name, role=self.role)
        self.events = events
        self.stop = stop
        self.threads = threads
        self.faults = faults

    # Test hook: a callable(worker) -> context manager entered around the loop in this thread
    # (the zero-sync test installs a TorchDispatchMode that counts host-reading ops).
    thread_context = None

    def run(self) -> None:
        if self.threads > 0:
            torch.set_num_threads(self.threads)  # per-thread OpenMP team size on CPU
        try:
            if Worker.thread_context is not None:
                with Worker.thread_context(self):
                    self.loop()
            else:
                self.loop()
            self.events.put(End(self.name))
        except Stopped:
            self.events.put(End(self.name))
        except BaseException as e:  # every failure must reach the supervisor
            self.counters.errors += 1
            self.events.put(StageFailure.capture(self.name, e))

    def loop(self) -> None:
        raise NotImplementedError

    def _get(self, q: BoundedQueue):
        """Blocking get (timeouts + stop event inside), timed as this worker's input wait."""
        t0 = time.perf_counter_ns()
        item = q.get(self.stop)
        self.counters.wait_in_ns += time.perf_counter_ns() - t0
        return item


class TargetWorker(Worker):
    """work_q -> TargetStep -> hs_q. Passes EpochEnd on; on End re-queues it for its siblings."""

    role = "target"

    def __init__(
        self,
        name,
        events,
        stop,
        threads,
        faults,
        *,
        step_fn,
        work_q: BoundedQueue,
        hs_q: BoundedQueue,
        lock: threading.Lock,
    ):
        super().__init__(name, events, stop, threads, faults)
        self.step_fn, self.work_q, self.hs_q, self.lock = step_fn, work_q, hs_q, lock

    def loop(self) -> None:
        c = self.counters
        while True:
            item = self._get(self.work_q)
            if isinstance(item, End):
                self.work_q.put_nowait(item)  # siblings must see it too
                self.hs_q.put(End(self.name), self.stop)
                return
            if isinstance(item, EpochEnd):
                self.hs_q.put(item, self.stop)
                continue
            assert isinstance(item, WorkItem), type(item)
            t1 = time.perf_counter_ns()
            with self.lock, oom_context("target", item.batch.input_ids.shape):
                # (the lock: the eval loop borrows the target between steps)
                self.faults.check("target", c.steps, self.stop)
                hb = self.step_fn(item, c)
            c.busy_ns += time.perf_counter_ns() - t1
            t2 = time.perf_counter_ns()
            self.hs_q.put(hb, self.stop)
            c.wait_out_ns += time.perf_counter_ns() - t2
            c.steps += 1
            c.items += int(item.batch.sample_ids.numel())
            c.tokens += item.batch.num_real_tokens
            c.padded_tokens += item.batch.num_padded_tokens
            c.beat()


class StepLoop:
    """The drafter side of the step loop, shared by the drafter worker and the sequential
    worker: runs the step function on each HiddenBatch and keeps the training position (for
    exact resume), the sample ledger, and the between-steps hooks (run by the thread that owns
    the drafter).

    `on_step_end(step)`: after every optimizer step (periodic checkpoint / eval), or None.
    `stop_vote()`: torchrun only, a collective run after every optimizer step on every rank (all
    ranks stop after the same step); True = stop now. None in a single process.
    """

    def __init__(
        self,
        *,
        step_fn,
        state,
        max_steps: int,
        on_step_end=None,
        stop_vote=None,
        queries_per_row: int = 0,
    ):
        self.step_fn = step_fn
        self.state = state  # checkpoint.TrainState
        if self.state.consumed is None:
            self.state.consumed = []
        if self.state.consumed_samples is None:
            self.state.consumed_samples = []
        self.max_steps = max_steps
        self.on_step_end = on_step_end
        self.stop_vote = stop_vote
        self.stopped_by_vote = False
        self.ledger: list[tuple[int, list[int]]] = []  # (epoch, sample ids) since last drain
        self.queries_per_row = queries_per_row  # anchors x block size (drafter FLOP counting)

    def consume(self, hb: HiddenBatch, counters: WorkerCounters) -> bool:
        """Train on one HiddenBatch. Returns False when max_steps is reached."""
        if hb.epoch != self.state.epoch:
            # First batch of a new epoch: the previous one is complete.
            self.state.epoch, self.state.consumed = hb.epoch, []
            self.state.consumed_samples = []
        t0 = time.perf_counter_ns()
        stepped = self.step_fn(hb, self.state.step, counters)
        counters.busy_ns += time.perf_counter_ns() - t0
        self.state.consumed.append(hb.seq_no)
        self.state.micro_step += 1
        self.state.tokens += hb.num_real_tokens
        ids = hb.sample_ids.tolist()  # CPU tensor: no device sync
        self.ledger.append((hb.epoch, ids))
        self.state.consumed_samples.extend(ids)
        counters.items += int(hb.sample_ids.numel())
        counters.tokens += hb.num_real_tokens
        counters.padded_tokens += int(hb.input_ids.numel())
        counters.query_tokens += hb.input_ids.shape[0] * self.queries_per_row
        counters.gauges["epoch"] = float(hb.epoch)
        if stepped:
            self.state.step += 1
            counters.steps += 1
            if self.on_step_end is not None:
                self.on_step_end(self.state.step)
            if self.stop_vote is not None and self.stop_vote():
                self.stopped_by_vote = True
                counters.beat()
                return False
        counters.beat()
        return not (self.max_steps and self.state.step >= self.max_steps)


class DrafterWorker(Worker):
    """hs_q -> StepLoop. Ends after an End from every target worker (or at max_steps)."""

    role = "drafter"

    def __init__(
        self,
        name,
        events,
        stop,
        threads,
        faults,
        *,
        step_loop: StepLoop,
        hs_q: BoundedQueue,
        num_producers: int,
        done: threading.Event,
    ):
        super().__init__(name, events, stop, threads, faults)
        self.step_loop, self.hs_q, self.num_producers, self.done = (
            step_loop,
            hs_q,
            num_producers,
            done,
        )

    def loop(self) -> None:
        c, ends = self.counters, 0
        while ends < self.num_producers:
            item = self._get(self.hs_q)
            if isinstance(item, End):
                ends += 1
                continue
            if isinstance(item, EpochEnd):
                log.info(
                    "drafter: epoch %d: all %d batches handed over", item.epoch, item.num_batches
                )
                continue
            with oom_context("drafter", item.input_ids.shape):
                self.faults.check("drafter", c.steps, self.stop)
                more = self.step_loop.consume(item, c)
            if not more:
                break
        self.done.set()


class SequentialWorker(Worker):
    """The baseline schedule: target step then drafter step in one thread, as existing
    trainers do. Same step functions as the pipelined schedule."""

    role = "sequential"

    def __init__(
        self,
        name,
        events,
        stop,
        threads,
        faults,
        *,
        target_step,
        step_loop: StepLoop,
        work_q: BoundedQueue,
        done: threading.Event,
        lock: threading.Lock,
    ):
        super().__init__(name, events, stop, threads, faults)
        self.target_step, self.step_loop, self.work_q = target_step, step_loop, work_q
        self.done, self.lock = done, lock

    def loop(self) -> None:
        c = self.counters
        while True:
            item = self._get(self.work_q)
            if isinstance(item, End):
                break
            if isinstance(item, EpochEnd):
                continue
            with self.lock, oom_context("target", item.batch.input_ids.shape):
                self.faults.check("target", c.steps, self.stop)
                hb = self.target_step(item, None)
            with oom_context("drafter", item.batch.input_ids.shape):
                self.faults.check("drafter", c.steps, self.stop)
                more = self.step_loop.consume(hb, c)
            if not more:
                break
        self.done.set()
