"""Achieved FLOP/s of the target forward and the drafter step vs the measured matmul peak of the
same threads (the CPU's practical limit), on the embedded target. Ratios from one run.

Run: .venv/bin/python bench/bench_flops.py [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dflash_trainer import bench_harness
from dflash_trainer.config_io import load_config
from dflash_trainer.models.target import TargetModel
from dflash_trainer.observe.flops import FlopsModel
from dflash_trainer.pipeline.cores import usable_cpus
from dflash_trainer.precision import use_autocast
from dflash_trainer.run.build import build_drafter
from dflash_trainer.train.objective import DFlashObjective


def timed(fn, reps):
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=usable_cpus())
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = load_config("smollm2-cpu")
    target = TargetModel.load(cfg.target, "cpu")
    drafter = build_drafter(cfg, target, "cpu")
    fm = FlopsModel.from_configs(
        target.model.config, max(target.layer_ids) + 1, drafter.config, seq_len=a.seq
    )
    B, S = a.batch, a.seq
    ids = torch.randint(3, target.vocab_size, (B, S))
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[:, S // 4 :] = True
    bf16 = use_autocast(cfg.pipeline.precision, "cpu")  # as the trainer decides
    # The peak of the dtypes this run computes in only: where bf16 is emulated (AVX2) its peak
    # alone took ~17 minutes of a core and says nothing about the run.
    used = {target.dtype, torch.bfloat16 if bf16 else torch.float32}
    peaks = {d: bench_harness.matmul_gflops(d, n=2048) / 1e3 for d in used}  # TFLOP/s

    t_target = timed(lambda: target.features(ids), 2)
    target_tflops = B * S * fm.target_flops_per_token(S) / t_target / 1e12

    feats = target.features(ids)
    obj = DFlashObjective(
        cfg.drafter.block_size,
        cfg.objective.num_anchors,
        0.0,
        drafter.config.mask_token_id,
        cfg.objective.loss_chunk_blocks,
    )
    gen = torch.Generator().manual_seed(0)

    def dstep():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = obj(drafter, target.embed_weight, target.lm_head, feats, ids, mask, gen)
        out.loss.backward()
        drafter.zero_grad(set_to_none=True)

    t_drafter = timed(dstep, 2)
    queries = B * cfg.objective.num_anchors * cfg.drafter.block_size
    d_flops = queries * fm.drafter_flops_per_query(S) + B * S * fm.drafter_flops_per_context_token()
    drafter_tflops = d_flops / t_drafter / 1e12
    t_dtype = target.dtype
    stages = {
        "target forward": {
            "dtype": str(t_dtype).replace("torch.", ""),
            "achieved_tflops": target_tflops,
            "peak_tflops": peaks[t_dtype],
        },
        "drafter step": {
            "dtype": "bfloat16" if bf16 else "float32",
            "achieved_tflops": drafter_tflops,
            "peak_tflops": peaks[torch.bfloat16 if bf16 else torch.float32],
        },
    }
    for k, v in stages.items():
        print(
            f"{k:15s} {v['achieved_tflops'] * 1e3:8.1f} GFLOP/s of {v['peak_tflops'] * 1e3:.1f}"
            f" ({v['dtype']} matmul peak, {a.threads} threads): "
            f"{v['achieved_tflops'] / v['peak_tflops']:.2f}"
        )
    print(
        json.dumps({"bench": "flops", "threads": a.threads, "batch": B, "seq": S, "stages": stages})
    )


# `dflash-trainer bench` (src/dflash_trainer/bench_harness.py) runs this script with these
# arguments (full run, --bench.quick) and turns its summary into rows with bench_rows.
BENCH_ARGS = {"full": [], "quick": []}


def bench_rows(s: dict) -> list[dict]:
    """This script's JSON summary as rows of the `dflash-trainer bench` table."""
    return [
        bench_harness.row(
            f"{k} achieved FLOP/s",
            k,
            f"measured {v['dtype']} matmul peak",
            v["achieved_tflops"] / v["peak_tflops"],
            note=f"{v['achieved_tflops'] * 1e3:.1f} of {v['peak_tflops'] * 1e3:.1f} GFLOP/s",
        )
        for k, v in s["stages"].items()
    ]


if __name__ == "__main__":
    main()
