"""The demo's fp32 drafter step with the target's frozen LM head on oneDNN's prepacked GEMM,
against PyTorch's default kernel.

The drafter's loss takes two products through the target's LM head W [49,152 x 576] per chunk of
loss rows (train/objective.py `_linear_ce`): the logits x W^T and the gradient to the drafter's
hidden states g W. The head is frozen, so `models/packed_linear.FrozenMatmuls` packs it once for
both. This bench runs the smollm2-cpu preset's drafter step in float32, what it trains in on a
CPU without native bf16 (SmolLM2-135M's shapes: hidden 576, 9 heads, 2 layers; 40 anchors x 16,
loss_slots 4; 512-token batches of 2 x 256 tokens, half answer) both ways on the same batches and
seeds, interleaved so machine drift hits both: the objective forward + backward + AdamW step, ms
per step, the ratio, and the largest difference of loss and gradients (fp32 rounding of another
GEMM). Random weights: the step's cost does not depend on them.

Run: .venv/bin/python bench/bench_frozen_head.py [--steps 12] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dflash_trainer import bench_harness
from dflash_trainer.bench_harness import StepWay
from dflash_trainer.models.packed_linear import FrozenMatmuls, available
from dflash_trainer.precision import cpu_kind
from dflash_trainer.train import objective as objective_module
from dflash_trainer.train.objective import DFlashObjective

H, V, BS = bench_harness.DEMO_HIDDEN, bench_harness.DEMO_VOCAB, bench_harness.DEMO_BLOCK
ANCHORS, SLOTS = 40, 4


class _DefaultKernels(FrozenMatmuls):
    """The same products on PyTorch's default kernels (what training used before)."""

    def _packed(self, x, w):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="measured steps each way")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    embed = torch.randn(V, H)
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    kernels = {"packed": FrozenMatmuls(), "default": _DefaultKernels()}

    def using(matmuls: FrozenMatmuls):
        return lambda: setattr(objective_module, "_FROZEN_HEAD", matmuls)

    ways = {
        w: StepWay(DFlashObjective(BS, ANCHORS, mask_token_id=0, loss_slots=SLOTS), using(m))
        for w, m in kernels.items()
    }
    try:
        c = bench_harness.compare_drafter_steps(ways, embed, head, args.steps)
    finally:
        objective_module._FROZEN_HEAD = kernels["packed"]
    ms, worst_loss, worst_grad = c.ms, c.worst_loss, c.worst_grad
    res = {
        "bench": "frozen_head",
        "cpu": cpu_kind(),
        "onednn": available(),
        **c.record(),
    }
    print(
        f"{cpu_kind()}, float32: drafter step {ms['packed']:.0f} ms with the frozen LM head "
        f"packed vs {ms['default']:.0f} ms on the default kernel: {res['speedup']:.2f}x; largest "
        f"relative difference: loss {worst_loss:.1e}, gradients {worst_grad:.1e}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
    print(json.dumps(res))


# `dflash-trainer bench` (src/dflash_trainer/bench_harness.py) runs this script with these
# arguments (full run, --bench.quick) and turns its summary into rows with bench_rows.
BENCH_ARGS = {"full": [], "quick": ["--steps", "4"]}


def bench_rows(s: dict) -> list[dict]:
    """This script's JSON summary as rows of the `dflash-trainer bench` table."""
    return [
        bench_harness.row(
            "the demo's drafter step in float32 (what a CPU without native bf16 trains in)",
            "frozen LM head on oneDNN's prepacked GEMM",
            "on the default kernel",
            s["speedup"],
            note=f"{s['packed_ms']:.0f} vs {s['default_ms']:.0f} ms per step; loss and gradients "
            f"equal to fp32 rounding (largest relative difference {s['max_loss_rel_diff']:.1e} / "
            f"{s['max_grad_rel_diff']:.1e})",
        )
    ]


if __name__ == "__main__":
    main()
