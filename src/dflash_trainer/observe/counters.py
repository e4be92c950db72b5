"""Single-writer counters kept by workers and queues; read (never written) by the monitor.

Why no locks: each field has exactly one writer thread, a Python int/float assignment is atomic
under the GIL, and the monitor tolerates a value that is one update stale. Multi-writer counters
(`x += 1` from two threads) would lose updates, so a counter object belongs to one thread.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class WorkerCounters:
    """Progress of one worker thread (`prefetch`, `target0`, `drafter0`, ...)."""

    name: str
    steps: int = 0  # work items finished
    items: int = 0  # sequences finished
    tokens: int = 0  # real (unpadded) tokens finished
    padded_tokens: int = 0  # rows x padded length finished
    query_tokens: int = 0  # drafter: block query tokens trained (rows x anchors x block_size)
    errors: int = 0
    skipped_steps: int = 0  # non-finite steps skipped (drafter)
    busy_ns: int = 0  # host time spent in the step body
    wait_in_ns: int = 0  # host time blocked on the input queue
    wait_out_ns: int = 0  # host time blocked on the output queue
    last_progress: float = field(default_factory=time.monotonic)  # heartbeat (monotonic s)
    phase_ns: dict[str, int] = field(
        default_factory=dict
    )  # per-phase host time (h2d, forward, ...)
    gauges: dict[str, float] = field(default_factory=dict)  # host-side values (lr, epoch)
    gpu_timer: object = None  # observe.profile.StepTimer of the worker's step (CUDA only)

    def beat(self) -> None:
        self.last_progress = time.monotonic()

    def add_phase(self, phase: str, ns: int) -> None:
        self.phase_ns[phase] = self.phase_ns.get(phase, 0) + ns


@dataclass
class QueueCounters:
    """Health of one bounded queue; producers write the put_* fields, consumers the get_* fields."""

    name: str
    capacity: int
    puts: int = 0
    gets: int = 0
    put_wait_ns: int = 0
    get_wait_ns: int = 0
    age_ns_sum: int = 0  # enqueue -> dequeue time, summed over gets
    # Recent get waits for percentiles; deque(maxlen) appends are atomic, the monitor copies it.
    get_waits_ns: deque = field(default_factory=lambda: deque(maxlen=512))
