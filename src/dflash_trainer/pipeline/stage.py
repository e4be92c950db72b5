"""`Stage`: the thread protocol every pipeline stage shares (runtime.py has the data flow).

A stage owns its counters (single writer), blocks only through BoundedQueue (timeouts + stop
event), and reports exactly one event to the supervisor when its thread ends: `End(name)` after
a normal end or a stop (`Stopped`), or `StageFailure` for any other exception. Stages that read
a queue of items ended by `End` markers loop over `items()`; a step body runs inside `guard()`
(the `pipeline.fault` test hook, and an out-of-memory error turned into a message that names the
stage, the batch shape and the setting to lower).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

import torch

from dflash_trainer.observe.counters import WorkerCounters
from dflash_trainer.pipeline.messages import End, EpochEnd, StageFailure
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
def oom_context(stage: str, shape) -> Iterator[None]:
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
            # the drafter's step grows with rows x num_anchors x block_size whatever the rows'
            # lengths: below the token budget, the row cap is what shrinks a batch of short rows
            else f"batching.max_batch_size (rows per batch, {rows} here) or "
            "objective.num_anchors (its step holds rows x anchors x block_size positions), or set "
            "objective.loss_chunk_blocks to a few blocks (0 = auto: 128 MiB of logits on CPU, "
            "2 GiB on CUDA)"
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


class Stage(threading.Thread):
    """Base of the prefetcher and the workers: runs `loop()` in a daemon thread (a hung stage
    cannot block exit) and turns its exit into one event on `events` (a queue, or a callable).
    """

    role = ""  # observe.counters.ROLES; each subclass names its own

    # Test hook: a callable(stage) -> context manager entered around the loop in this thread
    # (the zero-sync test installs a TorchDispatchMode that counts host-reading ops).
    thread_context = None

    def __init__(self, name: str, *, events, stop: threading.Event, threads: int = 0, faults=None):
        super().__init__(name=name, daemon=True)
        self.counters = WorkerCounters(name=name, role=self.role)
        self.events = events
        self.stop = stop
        self.threads = threads  # OpenMP team size on CPU (0: leave it)
        self.faults = faults  # FaultInjector or None

    def run(self) -> None:
        if self.threads > 0:
            torch.set_num_threads(self.threads)  # per-thread OpenMP team size on CPU
        try:
            if Stage.thread_context is not None:
                with Stage.thread_context(self):
                    self.loop()
            else:
                self.loop()
            self.report(End(self.name))  # the supervisor's proof of a normal end
        except Stopped:
            self.report(End(self.name))
        except BaseException as e:  # every failure must reach the supervisor
            self.counters.errors += 1
            self.report(StageFailure.capture(self.name, e))

    def report(self, event: End | StageFailure) -> None:
        if callable(self.events):
            self.events(event)
        else:
            self.events.put_nowait(event)

    def loop(self) -> None:
        raise NotImplementedError

    def get(self, q: BoundedQueue):
        """Blocking get (timeouts + stop event inside), timed as this stage's input wait."""
        t0 = time.perf_counter_ns()
        item = q.get(self.stop)
        self.counters.wait_in_ns += time.perf_counter_ns() - t0
        return item

    def items(self, q: BoundedQueue, ends: int = 1):
        """The work items from `q` until `ends` End markers have arrived (one per producer).
        Markers go to `on_end` / `on_epoch_end`, never to the caller."""
        seen = 0
        while seen < ends:
            item = self.get(q)
            if isinstance(item, End):
                seen += 1
                self.on_end(item)
            elif isinstance(item, EpochEnd):
                self.on_epoch_end(item)
            else:
                yield item

    def on_end(self, item: End) -> None:
        pass

    def on_epoch_end(self, item: EpochEnd) -> None:
        pass

    def check_fault(self, kind: str, step: int) -> None:
        if self.faults is not None:
            self.faults.check(kind, step, self.stop)

    @contextlib.contextmanager
    def guard(self, kind: str, shape, step: int):
        """Around one step body of kind "target" / "drafter": the fault hook, then the step;
        an out-of-memory error comes out as BatchOutOfMemory."""
        with oom_context(kind, shape):
            self.check_fault(kind, step)
            yield
