"""Which stage bounds the pipeline, and what split of the hardware would balance it.

Read once at the end of a run from the workers' cumulative counters (host time, no device
reads). A stage's *capacity* is what it produced per second of its own busy time: for the
target, real tokens forwarded per busy second per worker; for the drafter, the same tokens
trained per busy second. Their ratio says how many target workers (devices) one drafter worker
can absorb; the busy fractions say which side waited on the other.

Existing trainers leave this to the user (SpecForge found its 1 target + 7 trainer split by hand;
TorchSpec reports the imbalance but does not size it): docs/design/landscape.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# A stage busier than this while the other is not is the bound; below it both waited on input.
_BOUND = 0.85


@dataclass
class StageBalance:
    target_busy: float  # mean busy fraction of the target workers
    drafter_busy: float
    target_tok_s: float  # capacity per target worker (tokens per busy second)
    drafter_tok_s: float  # capacity of the drafter worker
    num_targets: int
    verdict: str  # "drafter-bound" | "target-bound" | "balanced" | "input-bound"

    @property
    def targets_per_drafter(self) -> float:
        """Target workers that one drafter worker can keep up with."""
        return self.drafter_tok_s / self.target_tok_s

    def advice(self) -> str:
        head = (
            f"pipeline {self.verdict}: target busy {self.target_busy:.0%} "
            f"({self.num_targets} worker{'s' if self.num_targets > 1 else ''}, "
            f"{self.target_tok_s:.0f} tok/s each when busy), drafter busy "
            f"{self.drafter_busy:.0%} ({self.drafter_tok_s:.0f} tok/s when busy); "
            f"one drafter can absorb {self.targets_per_drafter:.1f} target workers"
        )
        if self.verdict == "drafter-bound":
            tip = (
                "the target waits for the drafter: give the drafter more (more ranks via "
                "torchrun, each with its own targets; pipeline.precision=bfloat16), lower "
                "objective.num_anchors, or use fewer target devices per drafter"
            )
        elif self.verdict == "target-bound":
            tip = (
                "the drafter waits for the target: add target devices "
                "(pipeline.target_devices), or raise objective.num_anchors (more training "
                "signal per target forward at no cost in throughput)"
            )
        elif self.verdict == "input-bound":
            tip = (
                "both stages waited on input: the prefetcher or the data source is the "
                "bound (see queue/work/* in metrics.jsonl)"
            )
        else:
            tip = "both stages are busy: the split fits this workload"
        return f"{head}. {tip[0].upper()}{tip[1:]}."


def busy_seconds(w) -> float:
    """Work time of a worker: device time from its CUDA-event timer when it has one (host time
    under-counts asynchronous GPU work), else host time in the step body."""
    timer = getattr(w, "gpu_timer", None)
    if timer is not None and getattr(timer, "enabled", False) and timer.count:
        # Steps whose event pair was still in flight go untimed: scale to all steps.
        return timer.total_ms / 1e3 * (w.steps / timer.count)
    return w.busy_ns / 1e9


def assess(workers, min_busy_s: float = 1.0) -> StageBalance | None:
    """workers: WorkerCounters of one process. None when there is too little to judge (a
    sequential schedule, or under `min_busy_s` of work in either stage)."""
    targets = [w for w in workers if w.role == "target"]
    drafters = [w for w in workers if w.role == "drafter"]
    if not targets or not drafters:
        return None
    t_busy_s = [busy_seconds(w) for w in targets]
    d = drafters[0]
    d_busy_s = busy_seconds(d)
    if min(t_busy_s) < min_busy_s or d_busy_s < min_busy_s or not d.tokens:
        return None

    def frac(w, busy_s) -> float:
        lifetime = (w.busy_ns + w.wait_in_ns + w.wait_out_ns) / 1e9
        return min(1.0, busy_s / lifetime) if lifetime else 0.0

    t_frac = sum(frac(w, s) for w, s in zip(targets, t_busy_s)) / len(targets)
    d_frac = frac(d, d_busy_s)
    t_cap = sum(w.tokens / s for w, s in zip(targets, t_busy_s)) / len(targets)
    d_cap = d.tokens / d_busy_s
    if d_frac >= _BOUND and t_frac < _BOUND:
        verdict = "drafter-bound"
    elif t_frac >= _BOUND and d_frac < _BOUND:
        verdict = "target-bound"
    elif t_frac >= _BOUND and d_frac >= _BOUND:
        verdict = "balanced"
    else:
        verdict = "input-bound"
    return StageBalance(
        target_busy=t_frac,
        drafter_busy=d_frac,
        target_tok_s=t_cap,
        drafter_tok_s=d_cap,
        num_targets=len(targets),
        verdict=verdict,
    )
