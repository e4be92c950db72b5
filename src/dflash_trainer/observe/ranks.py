"""Per-rank metrics of a torchrun job, merged on rank 0.

Every rank publishes a small snapshot (`rank_snapshot`) through the rendezvous store each
monitor tick (pipeline/distributed.py says why not a collective); rank 0 merges them
(`merge_snapshots`) into `dist/*` keys that `MergingSink` adds to every record it writes.
"""

from __future__ import annotations

import logging

from dflash_trainer.observe.sinks import Sink

log = logging.getLogger(__name__)

_SUMS = ("tokens", "steps", "micro_steps")
_PER_RANK = {
    "step_ms": "prof/{drafter}/host_step_ms",
    "drafter_tok_s": "tput/drafter_tok_s",
    "target_tok_s": "tput/target_tok_s",
    "balance": "tput/balance",
}


def rank_snapshot(
    state, latest: dict, counters=None, elapsed_s: float = 0.0, final: bool = False
) -> dict:
    """What one rank publishes: exact cumulative counters (TrainState) and its per-rank figures:
    the monitor's latest window where it has one, else the run's mean from the drafter worker's
    counters (short runs, the final snapshot)."""
    snap: dict[str, float] = {
        "tokens": int(state.tokens),
        "steps": int(state.step),
        "micro_steps": int(state.micro_step),
        "final": bool(final),
    }
    for name, key in _PER_RANK.items():
        # the drafter-side worker's own keys (drafter0 or sequential0)
        for drafter in [counters.name] if counters is not None else ("drafter0", "sequential0"):
            v = latest.get(key.format(drafter=drafter))
            if v is not None:
                snap[name] = float(v)
                break
    if counters is not None and counters.steps > 0:
        snap.setdefault("step_ms", counters.busy_ns / counters.steps / 1e6)
        if elapsed_s > 0:
            snap.setdefault("drafter_tok_s", counters.tokens / elapsed_s)
    return snap


def merge_snapshots(snaps: dict[int, dict], world_size: int) -> dict[str, float]:
    """Sums for counters; min/max/mean and the rank of the min/max for per-rank figures."""
    m: dict[str, float] = {
        "dist/world_size": float(world_size),
        "dist/ranks_reporting": float(len(snaps)),
    }
    if not snaps:
        return m
    for k in _SUMS:
        m[f"dist/{k}_total"] = float(sum(s.get(k, 0) for s in snaps.values()))
    steps = [s.get("steps", 0) for s in snaps.values()]
    m["dist/steps_spread"] = float(max(steps) - min(steps))
    for name in _PER_RANK:
        vals = {r: s[name] for r, s in snaps.items() if name in s}
        if not vals:
            continue
        lo = min(vals, key=lambda r: vals[r])
        hi = max(vals, key=lambda r: vals[r])
        m[f"dist/{name}/min"], m[f"dist/{name}/min_rank"] = vals[lo], float(lo)
        m[f"dist/{name}/max"], m[f"dist/{name}/max_rank"] = vals[hi], float(hi)
        m[f"dist/{name}/mean"] = sum(vals.values()) / len(vals)
    if "dist/drafter_tok_s/mean" in m:
        m["dist/tput/drafter_tok_s"] = m["dist/drafter_tok_s/mean"] * len(
            [s for s in snaps.values() if "drafter_tok_s" in s]
        )
    return m


class MergingSink(Sink):
    """Rank 0's sinks with the merged per-rank metrics added to every record (in place, so the
    monitor's `latest()` shows them too). Only rank 0 builds one; other ranks have no sinks."""

    def __init__(self, inner, ctx):
        # ctx: pipeline.distributed.DistContext (snapshots(), world_size)
        self.inner, self.ctx = inner, ctx

    @property
    def errors(self) -> int:
        return getattr(self.inner, "errors", 0)

    def log(self, metrics: dict, step: int) -> None:
        try:
            metrics.update(merge_snapshots(self.ctx.snapshots(), self.ctx.world_size))
        except Exception as e:  # a collector: best effort
            log.warning("merging rank metrics failed: %s", e)
        self.inner.log(metrics, step)

    def event(self, record: dict, step: int) -> None:
        self.inner.event(record, step)

    def close(self) -> None:
        self.inner.close()
