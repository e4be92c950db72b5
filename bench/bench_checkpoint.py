"""How long a checkpoint stalls training: synchronous write vs background write.

Usage: .venv/bin/python bench/bench_checkpoint.py [--params-m 100] [--repeats 3]

A model of `--params-m` million fp32 parameters with AdamW state (weights + 2 moments: 12 bytes
per parameter on disk) is checkpointed the way the trainer does it. "stall" is the time the
training thread is blocked: the whole snapshot + write + fsync when synchronous; the snapshot
(device/host copy) alone when the write goes to the background. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dflash_trainer import bench_harness
from dflash_trainer.checkpoint import (
    AsyncCheckpointWriter,
    TrainState,  # noqa: E402
    save_checkpoint,
    snapshot_checkpoint,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params-m", type=float, default=100.0, help="parameters, millions")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    width = 2048
    rows = max(1, int(a.params_m * 1e6 / width))
    model = torch.nn.Linear(width, rows, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # creates the two moment buffers
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    gen = torch.Generator().manual_seed(0)
    kw = dict(drafter=model, optimizer=opt, scheduler=sched, generator=gen, config={})
    sync_s, async_s, write_s = [], [], []
    with tempfile.TemporaryDirectory() as d:
        writer = AsyncCheckpointWriter(Path(d) / "async", keep_last=1)
        for r in range(a.repeats):
            t0 = time.perf_counter()
            save_checkpoint(Path(d) / "sync", state=TrainState(step=r), keep_last=1, **kw)
            sync_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            writer.submit(snapshot_checkpoint(state=TrainState(step=r), **kw))
            async_s.append(time.perf_counter() - t0)  # the training thread goes on here
            writer.wait()
            write_s.append(time.perf_counter() - t0)
    res = {
        "bench": "checkpoint",
        "params_m": a.params_m,
        "bytes_gb": rows * width * 12 / 1e9,
        "sync_stall_s": statistics.median(sync_s),
        "async_stall_s": statistics.median(async_s),
        "async_total_s": statistics.median(write_s),
    }
    res["stall_ratio_sync_over_async"] = res["sync_stall_s"] / res["async_stall_s"]
    print(
        f"{res['bytes_gb']:.2f} GB per checkpoint: training blocked {res['sync_stall_s']:.2f} s "
        f"(synchronous) vs {res['async_stall_s']:.2f} s (background; the write itself took "
        f"{res['async_total_s']:.2f} s): {res['stall_ratio_sync_over_async']:.1f}x shorter "
        "stall"
    )
    print(json.dumps(res))


# `dflash-trainer bench` (src/dflash_trainer/bench_harness.py) runs this script with these
# arguments (full run, --bench.quick) and turns its summary into rows with bench_rows.
BENCH_ARGS = {"full": [], "quick": ["--params-m", "25"]}


def bench_rows(s: dict) -> list[dict]:
    """This script's JSON summary as rows of the `dflash-trainer bench` table."""
    return [
        bench_harness.row(
            "training stall per checkpoint",
            "synchronous write",
            "background write",
            s["stall_ratio_sync_over_async"],
            note=f"{s['bytes_gb']:.2f} GB: {s['sync_stall_s']:.2f} s vs "
            f"{s['async_stall_s']:.2f} s blocked",
        )
    ]


if __name__ == "__main__":
    main()
