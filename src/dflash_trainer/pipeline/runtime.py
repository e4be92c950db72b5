"""The pipeline's threads and their supervisor.

```
 TokenizedDataset
   -> BatchPrefetcher thread (CPU)  plan epoch -> build/pin batches -> WorkItem
   == work_q (BoundedQueue, pipeline.work_queue_size) ==>
   -> TargetWorker thread per target device: H2D -> tapped forward -> features to drafter device
   == hs_q (BoundedQueue, pipeline.hs_queue_size) ==>     HiddenBatch + ready_event
   -> DrafterWorker thread: wait event -> objective fwd/bwd -> guarded AdamW -> ScalarRing push
   Main thread (this module): Monitor.tick every metrics.tick_s, events queue, stall detector,
   skip-abort, signals, progress bar.
```

Where each piece lives: prefetcher.py (BatchPrefetcher), workers.py (TargetWorker, DrafterWorker,
SequentialWorker, and StepLoop, the drafter-side bookkeeping), steps.py (TargetStep, DrafterStep),
stage.py (the end/failure protocol and loop head every stage shares), queues.py, messages.py;
run/trainer.py builds and wires them for a run.

| stage     | consumes        | waits for                  | unblocked by                  | shutdown                          |
|-----------|-----------------|----------------------------|-------------------------------|-----------------------------------|
| prefetch  | dataset         | room in work_q             | a target worker's get         | End after last epoch; stop event  |
| target i  | work_q          | an item; room in hs_q      | prefetch put; drafter get     | on End: re-queue it, put End(i)   |
| drafter   | hs_q            | a HiddenBatch              | target put                    | End from every target; max_steps  |
| monitor   | counters, rings | nothing (tick timer)       | -                             | closed last, sinks flushed        |

Shutdown protocol: the first `StageFailure` on the events queue, a stall, too many consecutive
skipped steps, or a signal sets the shared stop event. Every blocking call polls it
(`pipeline.poll_s`), so each stage leaves within one poll interval; the supervisor joins them
with `pipeline.shutdown_deadline_s` and re-raises the failure naming the stage. A stage that exits
without `End` is a failure. The second SIGINT/SIGTERM exits at once (os._exit).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dflash_trainer.pipeline.messages import End, StageFailure

log = logging.getLogger(__name__)


class StageError(RuntimeError):
    """A pipeline stage failed; the message names it."""

    def __init__(self, stage: str, message: str, tb: str = ""):
        super().__init__(f"stage '{stage}' failed: {message}")
        self.stage, self.tb = stage, tb


@dataclass
class RunOutcome:
    reason: str  # "finished" (max_steps included) | "signal"
    wall_s: float
    failures: list = field(default_factory=list)


class SignalGuard:
    """First SIGINT/SIGTERM: request a graceful stop. Second: exit at once."""

    def __init__(self):
        self.requested = threading.Event()
        self.signum = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested.is_set():
            os._exit(128 + signum)
        self.signum = signum
        self.requested.set()
        log.warning(
            "signal %d: stopping, a checkpoint follows (send again to exit at once)", signum
        )

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


class Supervisor:
    """Starts the stage threads, watches them from the main thread, stops them in order."""

    def __init__(
        self,
        *,
        threads: Sequence[threading.Thread],
        events: queue.Queue,
        stop: threading.Event,
        done: threading.Event,
        monitor=None,
        tick_s: float = 0.5,
        deadline_s: float = 30.0,
        stall_timeout_s: float = 0.0,
        max_consecutive_skips: int = 0,
        consecutive_skips=None,
        on_tick=None,
        signals: SignalGuard | None = None,
    ):
        self.threads = threads
        self.events = events
        self.stop = stop
        self.done = done
        self.monitor = monitor
        self.tick_s = tick_s
        self.deadline_s = deadline_s
        self.stall_timeout_s = stall_timeout_s
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = consecutive_skips  # () -> latest device count read by monitor
        self.on_tick = on_tick
        self.signals = signals

    def _check_health(self) -> StageError | None:
        if self.monitor is not None and self.stall_timeout_s > 0:
            alive = {t.name for t in self.threads if t.is_alive()}
            stalled = [n for n in self.monitor.stalled(self.stall_timeout_s) if n in alive]
            if stalled:
                return StageError(
                    stalled[0],
                    f"no progress for more than "
                    f"{self.stall_timeout_s:.0f} s (pipeline.stall_timeout_s); "
                    "the stage is hung",
                )
        if self.max_consecutive_skips and self.consecutive_skips is not None:
            consec = self.consecutive_skips()
            if consec >= self.max_consecutive_skips:
                return StageError(
                    "drafter",
                    f"{int(consec)} consecutive optimizer steps had a "
                    "non-finite loss or gradient (optim.max_consecutive_skips); "
                    "lower optim.lr or check the data/target dtype",
                )
        return None

    def run(self) -> RunOutcome:
        t_start = time.monotonic()
        for t in self.threads:
            t.start()
        ended: set[str] = set()
        failure: StageError | None = None
        reason = "finished"
        while True:
            try:
                ev = self.events.get(timeout=self.tick_s)
            except queue.Empty:
                ev = None
            if isinstance(ev, StageFailure):
                failure = StageError(ev.stage, f"{type(ev.exc).__name__}: {ev.exc}", ev.tb)
                failure.__cause__ = ev.exc
                break
            if isinstance(ev, End):
                ended.add(ev.producer)
            if self.monitor is not None:
                self.monitor.tick()
            if self.on_tick is not None:
                self.on_tick()
            failure = self._check_health()
            if failure is not None:
                break
            if self.signals is not None and self.signals.requested.is_set():
                reason = "signal"
                break
            if self.done.is_set():
                reason = "finished"
                break
            dead = [t.name for t in self.threads if not t.is_alive() and t.name not in ended]
            if dead:
                # Give the events queue one more look: the End may be in flight.
                time.sleep(0.05)
                while not self.events.empty():
                    ev = self.events.get_nowait()
                    if isinstance(ev, End):
                        ended.add(ev.producer)
                    elif isinstance(ev, StageFailure) and failure is None:
                        failure = StageError(ev.stage, f"{type(ev.exc).__name__}: {ev.exc}", ev.tb)
                dead = [n for n in dead if n not in ended]
                if failure is not None:
                    break
                if dead:
                    failure = StageError(dead[0], "the thread ended without an end marker")
                    break
        self.shutdown()
        if failure is not None:
            log.error("%s", failure)
            log.debug("traceback of %s:\n%s", failure.stage, failure.tb)
            raise failure
        return RunOutcome(reason=reason, wall_s=time.monotonic() - t_start)

    def shutdown(self) -> list[str]:
        """Set the stop event and join every thread within the deadline; returns stragglers."""
        self.stop.set()
        deadline = time.monotonic() + self.deadline_s
        for t in self.threads:
            if t.is_alive():
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        stragglers = [t.name for t in self.threads if t.is_alive()]
        if stragglers:
            log.error(
                "stages still running after %.0f s: %s (abandoned; they are daemon threads)",
                self.deadline_s,
                ", ".join(stragglers),
            )
        return stragglers
