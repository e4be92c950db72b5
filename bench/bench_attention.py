"""Drafter training step (objective + forward + backward) on CPU: split vs dense attention.

Usage: .venv/bin/python bench/bench_attention.py [--quick] [--steps N] [--threads T]

Each variant runs in a fresh subprocess, so its peak resident memory (ru_maxrss) is its own.
"peak_step_mib" = ru_maxrss minus the RSS right before the first step (model, frozen
embedding/head and inputs already allocated), i.e. what the training step itself adds.
The last line printed is one JSON object with both variants and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from dflash_trainer import bench_harness
from dflash_trainer.pipeline.cores import usable_cpus

FULL = dict(
    hidden=576,
    layers=2,
    heads=9,
    kv_heads=3,
    head_dim=64,
    inter=1536,
    seq=1024,
    anchors=256,
    block=16,
    vocab=49152,
    taps=5,
    batch=1,
)

QUICK = dict(FULL, seq=512, anchors=128)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_variant(impl: str, shape: dict, steps: int, threads: int, chunk_blocks: int) -> dict:
    import torch

    from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter
    from dflash_trainer.train.objective import DFlashObjective

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    s = shape
    cfg = DFlashConfig(
        hidden_size=s["hidden"],
        num_layers=s["layers"],
        num_heads=s["heads"],
        num_kv_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        intermediate_size=s["inter"],
        block_size=s["block"],
        target_layer_ids=list(range(s["taps"])),
        num_target_layers=30,
        mask_token_id=s["vocab"] - 1,
        vocab_size=s["vocab"],
        rope_theta=1e5,
        attention=impl,
    )
    drafter = DFlashDrafter(cfg)
    embed = torch.randn(s["vocab"], s["hidden"]) * 0.02  # frozen target embedding
    head = torch.nn.Linear(s["hidden"], s["vocab"], bias=False).requires_grad_(False)
    B, S = s["batch"], s["seq"]
    ids = torch.randint(0, s["vocab"] - 1, (B, S))
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    loss_mask[:, S // 8 :] = True  # 1/8 prompt, rest response
    feats = torch.randn(B, S, s["taps"] * s["hidden"])
    obj = DFlashObjective(
        s["block"], s["anchors"], 0.0, cfg.mask_token_id, chunk_blocks=chunk_blocks
    )
    gen = torch.Generator().manual_seed(0)

    base = _rss_mib()
    times, loss = [], None
    for _ in range(steps + 1):  # first step = warm-up
        t0 = time.perf_counter()
        out = obj(drafter, embed, head, feats, ids, loss_mask, gen)
        out.loss.backward()
        drafter.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        loss = out.loss.item()  # bench only: one sync per step
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    step_s = min(times[1:]) if steps else times[0]
    tokens = B * s["anchors"] * s["block"]  # drafted (query) tokens per step
    return {
        "impl": impl,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "seq_tokens_per_s": B * S / step_s,
        "peak_rss_mib": peak,
        "peak_step_mib": peak - base,
        "loss": loss,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="seq 512, 128 anchors")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    ap.add_argument("--threads", type=int, default=min(2, usable_cpus()))
    ap.add_argument(
        "--chunk-blocks",
        type=int,
        default=0,
        help="objective.loss_chunk_blocks (LM-head chunk; its logits are a fixed cost "
        "shared by both variants); 0 = the product default (auto, ~128 MiB)",
    )
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # child-process mode
    a = ap.parse_args()
    shape = QUICK if a.quick else FULL
    if a.variant:
        print(json.dumps(run_variant(a.variant, shape, a.steps, a.threads, a.chunk_blocks)))
        return
    res = {}
    for impl in ("split", "dense"):
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            impl,
            "--steps",
            str(a.steps),
            "--threads",
            str(a.threads),
            "--chunk-blocks",
            str(a.chunk_blocks),
        ] + (["--quick"] if a.quick else [])
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                [
                    os.path.join(os.path.dirname(__file__), "..", "src"),
                    os.environ.get("PYTHONPATH", ""),
                ]
            ),
        )
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode:
            sys.exit(f"variant {impl} failed:\n{p.stderr}")
        res[impl] = json.loads(p.stdout.strip().splitlines()[-1])
        r = res[impl]
        print(
            f"{impl:6s} step {r['step_s']:.3f}s  {r['tokens_per_s']:.0f} block tok/s  "
            f"peak RSS {r['peak_rss_mib']:.0f} MiB (+{r['peak_step_mib']:.0f} MiB in the step)  "
            f"loss {r['loss']:.4f}",
            flush=True,
        )
    sp, de = res["split"], res["dense"]
    summary = {
        "bench": "attention",
        "shape": shape,
        "threads": a.threads,
        "chunk_blocks": a.chunk_blocks,
        "split": sp,
        "dense": de,
        "speedup_split_vs_dense": de["step_s"] / sp["step_s"],
        "step_mem_ratio_dense_over_split": de["peak_step_mib"] / max(sp["peak_step_mib"], 1),
        "rss_ratio_dense_over_split": de["peak_rss_mib"] / sp["peak_rss_mib"],
        "loss_abs_diff": abs(de["loss"] - sp["loss"]),
    }
    print(
        f"split vs dense: {summary['speedup_split_vs_dense']:.2f}x faster, "
        f"{summary['step_mem_ratio_dense_over_split']:.2f}x less step memory "
        f"({summary['rss_ratio_dense_over_split']:.2f}x less total peak RSS)"
    )
    print(json.dumps(summary))


# `dflash-trainer bench` (src/dflash_trainer/bench_harness.py) runs this script with these
# arguments (full run, --bench.quick) and turns its summary into rows with bench_rows.
BENCH_ARGS = {"full": [], "quick": ["--quick"]}


def bench_rows(s: dict) -> list[dict]:
    """This script's JSON summary as rows of the `dflash-trainer bench` table."""
    return [
        bench_harness.row(
            "drafter train step (fwd+bwd), time",
            "split",
            "dense",
            s["speedup_split_vs_dense"],
            note="speedup of split over dense",
        ),
        bench_harness.row(
            "drafter train step, peak step memory",
            "dense",
            "split",
            s["step_mem_ratio_dense_over_split"],
            note="dense / split",
        ),
    ]


if __name__ == "__main__":
    main()
