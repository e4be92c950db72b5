"""`make bench` within a wall-time budget on any machine: which scripts run in full, which quick.

Every bench script has a full mode and a quick one (fewer repeats, shorter runs: its BENCH_ARGS).
On a 2-core Zen 4 EPYC run as an AVX2 one the full set took ~17 minutes; a real AVX2 EPYC (Zen 3)
is about twice as slow at everything, which would put it past half an hour. So the plan decides
per script, just before it runs, from what the run has measured so far:

    slowness = seconds the scripts done took / their reference seconds (REFERENCE_S; 1 before any)
    full if   elapsed + slowness x (full(script) + quick(every script after it)) <= budget
    else      quick

Counting every later script at its quick cost keeps the whole run inside the budget whenever
the quick set fits at all, and a fast machine runs everything in full. Each row says which mode
measured it (results.md's header lists the quick ones). `--bench.quick` makes every script
quick; `--bench.time_budget_s=0` runs every script in full, whatever it takes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# Seconds each script took (full, quick) on the reference machine: a 2-core AMD EPYC Zen 4 run as
# an AVX2 one (CPU_KIND=avx2), 2026-12-08 (bench/LOG.md). Only their ratios matter here.
REFERENCE_S: dict[str, tuple[float, float]] = {
    "bench_batching.py": (1.5, 1.4),
    "bench_attention.py": (57.0, 21.0),
    "bench_taps.py": (62.0, 36.0),
    "bench_flops.py": (17.0, 16.0),
    "bench_pipeline.py": (429.0, 93.0),
    "bench_checkpoint.py": (22.0, 8.0),
    "bench_dtype.py": (7.0, 7.0),
    "bench_kd.py": (35.0, 10.0),
    "bench_generate.py": (107.0, 37.0),
    "bench_capture.py": (60.0, 31.0),
    "bench_decode.py": (80.0, 77.0),
    "bench_memory_plan.py": (57.0, 57.0),
    "bench_anchors.py": (91.0, 19.0),
    "bench_read_slots.py": (18.0, 10.0),
    "bench_frozen_head.py": (18.0, 10.0),
}
UNKNOWN_S = (60.0, 20.0)  # a script not in the table yet


def reference(script: str) -> tuple[float, float]:
    return REFERENCE_S.get(script, UNKNOWN_S)


class BenchPlan:
    """Full or quick for each script of one `bench` run (module docstring)."""

    def __init__(
        self, budget_s: float, quick: bool = False, clock: Callable[[], float] = time.monotonic
    ):
        self.budget_s, self.quick, self.clock = budget_s, quick, clock
        self.t0 = clock()
        self.spent_ref = self.spent = 0.0

    @property
    def slowness(self) -> float:
        """This machine's seconds per reference second, over the scripts done (1 before any)."""
        return self.spent / self.spent_ref if self.spent_ref > 0 else 1.0

    def mode(self, script: str, after: list[str]) -> str:
        """'full' or 'quick' for `script`, with `after` still to run behind it."""
        if self.quick:
            return "quick"
        if self.budget_s <= 0:
            return "full"
        elapsed = self.clock() - self.t0
        rest = sum(reference(s)[1] for s in after)
        projected = elapsed + self.slowness * (reference(script)[0] + rest)
        return "full" if projected <= self.budget_s else "quick"

    def done(self, script: str, mode: str, seconds: float) -> None:
        self.spent += seconds
        self.spent_ref += reference(script)[0 if mode == "full" else 1]
