"""Batching quality: padding efficiency and bucket mixing of our plan vs naive batching.

10k sequence lengths, log-normal (median 400, sigma 1) clipped to 20..3072, seeded. For each
token budget: our plan (buckets + token budget + interleaving), naive random batches of 8 and
batch size 1. Bucket entropy uses the same bucket edges for all three (a batch's bucket is the
bucket of its longest row) and windows of 64 batches. Targets: padding_eff >= 0.95, entropy >= 0.9.

    .venv/bin/python bench/bench_batching.py
"""

from __future__ import annotations

import json
import time

import numpy as np

from dflash_trainer import bench_harness
from dflash_trainer.config import BatchingConfig
from dflash_trainer.data.batching import (
    assign_buckets,
    bucket_edges,
    bucket_entropy,
    padding_efficiency,
    plan_epoch_detailed,
)


def naive(lengths, size, rng):
    order = rng.permutation(len(lengths))
    return [order[i : i + size].tolist() for i in range(0, len(order), size)]


def main() -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(400), 1.0, 10_000), 20, 3072).astype(np.int64)
    rows, result = (
        [],
        {"n": len(lengths), "len_p50": float(np.median(lengths)), "len_max": int(lengths.max())},
    )
    for budget in (16384, 8192):
        cfg = BatchingConfig(
            max_tokens=budget, max_batch_size=64, pad_multiple=16, num_buckets=8, seed=0
        )
        t0 = time.perf_counter()
        plan = plan_epoch_detailed(lengths, cfg, epoch=0)
        ms = (time.perf_counter() - t0) * 1e3
        edges = bucket_edges(lengths, cfg)
        k = len(edges) + 1
        cands = {"ours": (plan.batches, plan.buckets)}
        for size in (8, 1):
            bb = naive(lengths, size, np.random.default_rng(1))
            cands[f"random_bs{size}"] = (
                bb,
                [int(assign_buckets([lengths[b].max()], edges)[0]) for b in bb],
            )
        for name, (batches, buckets) in cands.items():
            eff = padding_efficiency(batches, lengths, cfg.pad_multiple)
            ent = bucket_entropy(buckets, k, window=64)
            rows.append((budget, name, len(batches), eff, ent))
            result[f"{name}@{budget}"] = {
                "batches": len(batches),
                "padding_eff": round(eff, 4),
                "bucket_entropy": round(ent, 4),
            }
        result[f"ours@{budget}"]["plan_ms"] = round(ms, 1)
        result[f"ours@{budget}"]["meets_targets"] = bool(
            result[f"ours@{budget}"]["padding_eff"] >= 0.95
            and result[f"ours@{budget}"]["bucket_entropy"] >= 0.9
        )
    print(
        f"{'max_tokens':>10} {'batching':<12} {'batches':>8} {'padding_eff':>12} "
        f"{'bucket_entropy':>15}"
    )
    for budget, name, n, eff, ent in rows:
        print(f"{budget:>10} {name:<12} {n:>8} {eff:>12.4f} {ent:>15.4f}")
    print(json.dumps({"bench": "batching", **result}))


# `dflash-trainer bench` (src/dflash_trainer/bench_harness.py) runs this script with these
# arguments (full run, --bench.quick) and turns its summary into rows with bench_rows.
BENCH_ARGS = {"full": [], "quick": []}


def bench_rows(s: dict) -> list[dict]:
    """This script's JSON summary as rows of the `dflash-trainer bench` table."""
    out = []
    for budget in sorted({k.split("@")[1] for k in s if "@" in k}, key=int):
        ours = s[f"ours@{budget}"]
        for base in ("random_bs8", "random_bs1"):
            b = s[f"{base}@{budget}"]
            for what, k in (
                ("padding efficiency", "padding_eff"),
                ("bucket entropy (window 64)", "bucket_entropy"),
            ):
                out.append(
                    bench_harness.row(
                        f"{what}, max_tokens {budget}",
                        "ours",
                        base,
                        ours[k] / b[k],
                        note=f"ours {ours[k]:.3f}, {base} {b[k]:.3f}",
                    )
                )
    return out


if __name__ == "__main__":
    main()
