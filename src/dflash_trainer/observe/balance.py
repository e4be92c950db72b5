"""Which stage bounds the pipeline, and what split of the hardware would balance it.

Read once at the end of a run from the workers' cumulative counters (host time, no device
reads). A stage's *capacity* is what it produced per second of its own busy time: for the
target, real tokens forwarded per busy second per worker; for the drafter, the same tokens
trained per busy second. Their ratio says how many target workers (devices) one drafter worker
can absorb; the busy fractions say which side waited on the other.

The same capacities size a `pipeline.split` job (T target ranks feeding D drafter ranks): over
N devices, the T:D that trains the most is the one that maximises min(T x target capacity,
D x drafter capacity) (`best_split`). In a split job the target workers run in other
processes: their figures reach drafter rank 0 through the store (`remote_target`).

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
    # pipeline.split (T, D) of the run, or None (co-located cells)
    split: tuple[int, int] | None = None
    devices: int = 0  # devices a split is advised for (0: none advised, e.g. a CPU run)

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
                "torchrun, each with its own targets, or more drafter ranks per target rank "
                "with pipeline.split; pipeline.precision=bfloat16), lower "
                "objective.num_anchors, or use fewer target devices per drafter"
            )
        elif self.verdict == "target-bound":
            tip = (
                "the drafter waits for the target: add target devices "
                "(pipeline.target_devices, or target ranks with pipeline.split), or raise "
                "objective.num_anchors (more training "
                "signal per target forward at no cost in throughput)"
            )
        elif self.verdict == "input-bound":
            tip = (
                "both stages waited on input: the prefetcher or the data source is the "
                "bound (see queue/work/* in metrics.jsonl)"
            )
        else:
            tip = "both stages are busy: the split fits this workload"
        return f"{head}. {tip[0].upper()}{tip[1:]}.{self._split_advice()}"

    def _split_advice(self) -> str:
        """The T:D split these capacities balance (pipeline.split), over the run's devices."""
        if self.devices < 2:
            return ""
        t, d = best_split(self.target_tok_s, self.drafter_tok_s, self.devices)
        r = self.targets_per_drafter  # T/D at which the capacities match
        ratio = f"1:{1 / r:.1f}" if r < 1 else f"{r:.1f}:1"
        now = f" (this run: {self.split[0]}:{self.split[1]})" if self.split else ""
        return (
            f" Target and drafter ranks balance at T:D = {ratio}: over {self.devices} devices "
            f"pipeline.split={t}:{d}{now}."
        )


def best_split(target_tok_s: float, drafter_tok_s: float, devices: int) -> tuple[int, int]:
    """(T, D) with T + D = `devices` that trains the most tokens per second, min(T x target,
    D x drafter capacity); a tie goes to more drafter ranks (the drafter is the part that
    learns: an idle target costs less than an idle drafter)."""
    if devices < 2:
        raise ValueError("a split needs at least 2 devices")
    t = max(
        range(1, devices), key=lambda t: (min(t * target_tok_s, (devices - t) * drafter_tok_s), -t)
    )
    return t, devices - t


def busy_seconds(w) -> float:
    """Work time of a worker: device time from its CUDA-event timer when it has one (host time
    under-counts asynchronous GPU work), else host time in the step body."""
    timer = getattr(w, "gpu_timer", None)
    if timer is not None and getattr(timer, "enabled", False) and timer.count:
        # Steps whose event pair was still in flight go untimed: scale to all steps.
        return timer.total_ms / 1e3 * (w.steps / timer.count)
    return w.busy_ns / 1e9


def figures(w) -> tuple[float, float, float]:
    """(busy seconds, busy fraction, tokens per busy second) of one worker."""
    busy_s = busy_seconds(w)
    lifetime = (w.busy_ns + w.wait_in_ns + w.wait_out_ns) / 1e9
    frac = min(1.0, busy_s / lifetime) if lifetime else 0.0
    return busy_s, frac, (w.tokens / busy_s if busy_s > 0 else 0.0)


def remote_target(w) -> dict[str, float]:
    """What a split job's target rank publishes of its target worker for drafter rank 0's
    verdict (`assess(remote=...)`)."""
    busy_s, frac, cap = figures(w)
    return {"target_busy_s": busy_s, "target_busy": frac, "target_cap": cap}


def assess(
    workers,
    min_busy_s: float = 1.0,
    remote: list[dict] | None = None,
    split: tuple[int, int] | None = None,
    devices: int = 0,
) -> StageBalance | None:
    """workers: WorkerCounters of one process. `remote`: the target workers of a split job's
    target ranks (`remote_target` each) instead of this process's; `split`: its (T, D);
    `devices`: the devices to advise a split over (0: none). None when there is too little to
    judge (a sequential schedule, or under `min_busy_s` of work in either stage)."""
    drafters = [w for w in workers if w.role == "drafter"]
    if remote is None:
        targets = [figures(w) for w in workers if w.role == "target"]
    else:
        targets = [(r["target_busy_s"], r["target_busy"], r["target_cap"]) for r in remote]
    if not targets or not drafters:
        return None
    d = drafters[0]
    d_busy_s, d_frac, d_cap = figures(d)
    if min(t[0] for t in targets) < min_busy_s or d_busy_s < min_busy_s or not d.tokens:
        return None
    t_frac = sum(t[1] for t in targets) / len(targets)
    t_cap = sum(t[2] for t in targets) / len(targets)
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
        split=split,
        devices=devices,
    )
