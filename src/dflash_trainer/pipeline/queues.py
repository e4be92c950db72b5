"""Bounded queues whose blocking calls always time out, re-check a stop event and are timed.

Producers and consumers time their own blocking `put`/`get`: that is where the queue-health
metrics (producer blocked, consumer starved, item age) come from, at the cost of two
`perf_counter_ns` calls per item.
"""

from __future__ import annotations

import queue
import threading
import time

from dflash_trainer.observe.counters import QueueCounters


class Stopped(Exception):
    """The stop event was set while a stage was blocked on a queue."""


def _heartbeat() -> None:
    """A stage blocked on a queue is waiting, not hung: refresh the calling thread's heartbeat
    (threads that own a `counters` with `beat()`), so the stall detector only sees stuck work."""
    c = getattr(threading.current_thread(), "counters", None)
    if c is not None:
        c.beat()


class BoundedQueue:
    """`producers` / `consumers`: how many threads put / get (the monitor divides the summed
    wait times by them, so its blocked / starved fractions stay within [0, 1])."""

    def __init__(
        self,
        name: str,
        capacity: int,
        poll_s: float = 0.1,
        *,
        producers: int = 1,
        consumers: int = 1,
    ):
        self._q: queue.Queue = queue.Queue(maxsize=capacity)
        self.counters = QueueCounters(name=name, capacity=capacity)
        self._count_lock = threading.Lock()  # several producers / consumers update counters
        self.name = name
        self.capacity = int(capacity)
        self.poll_s = poll_s
        self.producers, self.consumers = int(producers), int(consumers)

    def qsize(self) -> int:
        return self._q.qsize()

    def put(self, item, stop: threading.Event) -> None:
        """Block until there is room; raise Stopped if `stop` is set meanwhile."""
        t0 = time.perf_counter_ns()
        try:
            while True:
                if stop.is_set():
                    raise Stopped(self.name)
                try:
                    self._q.put(item, timeout=self.poll_s)
                    return
                except queue.Full:
                    _heartbeat()
                    continue
        finally:
            c = self.counters
            with self._count_lock:
                c.put_wait_ns += time.perf_counter_ns() - t0
                c.puts += 1

    def put_nowait(self, item) -> bool:
        """Best effort (for control messages during shutdown): False if full."""
        try:
            self._q.put_nowait(item)
            return True
        except queue.Full:
            return False

    def get(self, stop: threading.Event):
        """Block until an item arrives; raise Stopped if `stop` is set meanwhile."""
        t0 = time.perf_counter_ns()
        while True:
            if stop.is_set():
                raise Stopped(self.name)
            try:
                item = self._q.get(timeout=self.poll_s)
                break
            except queue.Empty:
                _heartbeat()
                continue
        now = time.perf_counter_ns()
        c = self.counters
        wait = now - t0
        enq = getattr(item, "enqueued_ns", None)
        with self._count_lock:
            c.get_wait_ns += wait
            c.get_waits_ns.append(wait)
            c.gets += 1
            if enq is not None:
                c.age_ns_sum += now - enq
        return item

    def drain(self) -> list:
        """Remove everything without blocking (shutdown)."""
        out = []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out
