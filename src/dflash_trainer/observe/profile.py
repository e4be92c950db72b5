"""GPU time per worker step from pooled CUDA events, resolved lazily (observability.md §7.1).

The worker records an event pair on the stream it already uses (`start` / `stop`: two
`cudaEventRecord` calls, no wait). The monitor calls `resolve()` each tick: it reads only pairs
whose end event reports done (`query()`), so `elapsed_time()` never blocks, and returns the events
to the pool. On CPU every call is a no-op and the same code path runs.

Thread-safety: one producer (the worker) appends to `_pending` and pops from `_free`; one
consumer (the monitor) pops from `_pending` and appends to `_free`. deque appends/pops are atomic.
`total_ms` and `count` are written only by the monitor.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from dflash_trainer.observe.counters import WorkerCounters


class StepTimer:
    def __init__(self, device, capacity: int = 256):
        self.enabled = torch.device(device).type == "cuda"
        self.capacity = capacity
        self._free: deque = deque()
        self._pending: deque = deque()
        self._created = 0
        self.total_ms = 0.0  # monitor-side accumulators
        self.count = 0
        self.dropped = 0  # steps not timed because every event pair was in flight

    def start(self, stream=None):
        """Worker: record the start event; returns a token for `stop` (None when disabled)."""
        if not self.enabled:
            return None
        try:
            pair = self._free.popleft()
        except IndexError:
            if self._created >= self.capacity:
                self.dropped += 1
                return None
            self._created += 1
            pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        pair[0].record(stream)
        return pair

    def stop(self, token, stream=None) -> None:
        """Worker: record the end event after the step's last kernel was enqueued."""
        if token is None:
            return
        token[1].record(stream)
        self._pending.append(token)

    def resolve(self) -> None:
        """Monitor: account every finished pair, FIFO, without waiting."""
        while self._pending:
            start, end = self._pending[0]
            if not end.query():
                return
            self._pending.popleft()
            self.total_ms += start.elapsed_time(end)
            self.count += 1
            self._free.append((start, end))


class StepMeter:
    """Where one worker's step time goes, kept outside the step: the worker starts it right
    before the step, the step calls `lap(phase)` where each phase ends (and `gauge` for a Python
    value), and the laps go to the worker's counters (None: a bare call, nothing recorded)."""

    __slots__ = ("counters", "_t")

    def __init__(self, counters: WorkerCounters | None = None):
        self.counters = counters
        self._t = time.perf_counter_ns()

    def start(self) -> None:
        self._t = time.perf_counter_ns()

    def lap(self, phase: str) -> None:
        now = time.perf_counter_ns()
        if self.counters is not None:
            self.counters.add_phase(phase, now - self._t)
        self._t = now

    def gauge(self, name: str, value: float) -> None:
        if self.counters is not None:
            self.counters.gauges[name] = value
