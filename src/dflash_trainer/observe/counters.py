"""Counters kept by workers and queues; read (never written) by the monitor.

WorkerCounters have a single writer, the worker's thread: no locks, because a Python int/float
assignment is atomic under the GIL and the monitor tolerates a value that is one update stale.
QueueCounters are written by every producer (put_* fields) and every consumer (get_* fields) of
their queue, e.g. k target workers put into one hidden-state queue: `x += 1` from two threads
would lose updates, so BoundedQueue makes those updates under its own lock.

Every worker's counters carry its role (`ROLES`); the monitor and the balance verdict group
workers by role, never by thread name.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

# prefetch: plans and builds batches; target: target forwards; drafter: drafter training;
# sequential: both in one thread (its counters count the drafter side); feed: features sent to
# or received from another rank (pipeline.split, pipeline/feed.py).
ROLES = ("prefetch", "target", "drafter", "sequential", "feed")
TRAINING_ROLES = ("drafter", "sequential")  # roles whose counters count drafter training


@dataclass
class WorkerCounters:
    """Progress of one worker thread (`prefetch`, `target0`, `drafter0`, ...)."""

    name: str
    role: str  # one of ROLES
    steps: int = 0  # work items finished
    items: int = 0  # sequences finished
    tokens: int = 0  # real (unpadded) tokens finished
    padded_tokens: int = 0  # rows x padded length finished
    query_tokens: int = 0  # drafter: block query tokens trained (rows x anchors x block_size)
    errors: int = 0
    busy_ns: int = 0  # host time spent in finished step bodies
    # (busy_ns when the current step began, its perf_counter_ns start; 0 = between steps): one
    # attribute, so the monitor reads a consistent pair and counts a step that spans its log
    # windows in each window it covers (a 1.2 s step in 2 s windows read busy 1.3 then 0.6).
    busy_mark: tuple[int, int] = (0, 0)
    wait_in_ns: int = 0  # host time blocked on the input queue
    wait_out_ns: int = 0  # host time blocked on the output queue
    last_progress: float = field(default_factory=time.monotonic)  # heartbeat (monotonic s)
    phase_ns: dict[str, int] = field(
        default_factory=dict
    )  # per-phase host time (h2d, forward, ...)
    gauges: dict[str, float] = field(default_factory=dict)  # host-side values (lr, epoch)
    gpu_timer: object = None  # observe.profile.StepTimer of the worker's step (CUDA only)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"worker role {self.role!r} is not one of {', '.join(ROLES)}")

    def beat(self) -> None:
        self.last_progress = time.monotonic()

    def begin_busy(self, t0_ns: int) -> None:
        """A step body starts at `t0_ns` (time.perf_counter_ns)."""
        self.busy_mark = (self.busy_ns, t0_ns)

    def end_busy(self, t1_ns: int) -> int:
        """The step body begun by `begin_busy` ends at `t1_ns`; returns its duration (ns)."""
        ns = t1_ns - self.busy_mark[1]
        self.busy_ns += ns
        self.busy_mark = (self.busy_ns, 0)
        return ns

    def busy_ns_at(self, now_ns: int) -> int:
        """Busy time up to `now_ns` (perf_counter_ns), the running step's part included."""
        done, since = self.busy_mark
        return done + (now_ns - since) if since else self.busy_ns

    def add_phase(self, phase: str, ns: int) -> None:
        self.phase_ns[phase] = self.phase_ns.get(phase, 0) + ns


@dataclass
class QueueCounters:
    """Health of one bounded queue; producers write the put_* fields, consumers the get_* fields
    (under the queue's lock: several threads may do either)."""

    name: str
    capacity: int
    puts: int = 0
    gets: int = 0
    put_wait_ns: int = 0
    get_wait_ns: int = 0
    age_ns_sum: int = 0  # enqueue -> dequeue time, summed over gets
    # Recent get waits for percentiles; deque(maxlen) appends are atomic, the monitor copies it.
    get_waits_ns: deque = field(default_factory=lambda: deque(maxlen=512))
