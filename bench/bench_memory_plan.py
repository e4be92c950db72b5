"""The memory plan (run/memory_plan.py) of the qwen3-8b preset's drafter GPU, per card.

A Qwen3-8B-shaped target (its config only: hidden 4096, 36 layers, vocab 151,936) and the preset's
drafter (5 layers), built on fake tensors: no weights are loaded or allocated, and the plan's
step is measured as every run measures it at start-up. For each card (an 80 GB H100: 79.2 GiB as
torch reports it; a 141 GB H200: 139.8 GiB) the preset as it applies there (the [gpu_80gb] table
on the H100) and the preset's own values: the planned peak against the card, the step's share,
what a row x anchor block costs.

The fake step runs on this CPU in bf16 autocast with the `split` attention (flash-style like the
GPU's flex: the plan's module docstring says why); the sizes of its tensors do not depend on the
device.

Run: .venv/bin/python bench/bench_memory_plan.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dflash_trainer import bench_harness, config_io
from dflash_trainer.bench_harness import QWEN3_8B_SHAPE
from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter
from dflash_trainer.run.build import build_objective
from dflash_trainer.run.memory_plan import HEADROOM, GiB, plan_memory

CARDS = {"H100 80 GB": 79.2, "H200 141 GB": 139.8}  # GiB, torch's total_memory


def qwen3_8b_target():
    """What the plan reads of a Qwen3-8B target, without its weights."""
    from transformers import Qwen3Config

    config = Qwen3Config(**QWEN3_8B_SHAPE, rope_theta=1e6, max_position_embeddings=40960)
    return SimpleNamespace(
        hidden_size=4096,
        num_layers=36,
        layer_ids=[1, 9, 17, 25, 33],  # the DFlash rule's 5 taps of 36 layers
        vocab_size=151936,
        model=SimpleNamespace(config=config),
        tokenizer=None,
    )


def plan_for(card_gib: float, table: bool) -> dict:
    def card(device: str) -> float:
        return card_gib if table else 200.0  # 200: no table applies (the preset's own values)

    config_io.card_memory_gib, before = card, config_io.card_memory_gib
    try:
        cfg = config_io.load_config(
            "qwen3-8b", None, ["--drafter.mask_token_id=151669", "--pipeline.drafter_device=cpu"]
        )
    finally:
        config_io.card_memory_gib = before
    target = qwen3_8b_target()
    dcfg = DFlashConfig.from_configs(cfg.drafter, target)
    with FakeTensorMode(), torch.device("cpu"):
        drafter = DFlashDrafter(dcfg)
    t0 = time.perf_counter()
    plan = plan_memory(
        cfg,
        drafter,
        build_objective(cfg, drafter),
        target.vocab_size,
        torch.device("cpu"),
        True,
        torch.bfloat16,  # the features a CUDA target hands over
        torch.bfloat16,  # the frozen heads: the bf16 target's, under autocast
    )
    plan.capacity, plan.feature_cache = int(card_gib * GiB), 0  # the GPU, not this host
    print("\n".join(plan.lines()), flush=True)
    return {
        "rows": plan.rows,
        "tokens": plan.tokens,
        "anchors": plan.anchors,
        "grad_accum": cfg.optim.grad_accum,
        "plan_gib": plan.total / GiB,
        "step_peak_gib": plan.step_peak / GiB,
        "block_mib": plan.per_block / (1 << 20),
        "card_gib": card_gib,
        "fits": plan.total <= HEADROOM * plan.capacity,
        "plan_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res: dict = {"bench": "memory_plan", "cases": {}}
    for name, gib in CARDS.items():
        for table in (True, False):
            if not table and name.startswith("H200"):
                continue  # no table applies on an H200: the preset's own values once
            label = f"{name}, preset {'as applied' if table else 'own values'}"
            print(f"== {label}", flush=True)
            res["cases"][label] = plan_for(gib, table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
    print(json.dumps(res))


# `dflash-trainer bench` (src/dflash_trainer/bench_harness.py) runs this script with these
# arguments (full run, --bench.quick) and turns its summary into rows with bench_rows.
BENCH_ARGS: dict[str, list[str]] = {"full": [], "quick": []}


def bench_rows(s: dict) -> list[dict]:
    """This script's JSON summary as rows of the `dflash-trainer bench` table: the plan's share
    of each card."""
    return [
        bench_harness.row(
            f"qwen3-8b drafter GPU memory plan, {label}",
            f"plan ({c['rows']} rows x {c['anchors']} anchors, accum {c['grad_accum']})",
            "card",
            c["plan_gib"] / c["card_gib"],
            note=f"{c['plan_gib']:.1f} of {c['card_gib']:.1f} GiB ("
            f"{'fits' if c['fits'] else 'does not fit'}); step peak {c['step_peak_gib']:.1f} "
            f"GiB, {c['block_mib']:.1f} MiB per row x anchor block",
        )
        for label, c in s["cases"].items()
    ]


if __name__ == "__main__":
    main()
