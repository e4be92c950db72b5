"""The demo's drafter step with the last layer on the slots the loss reads, against every slot.

With `objective.loss_slots` = K < block_size - 1 the loss reads slots 0..K of each block only;
the drafter's last layer then computes those slots' query, attention and MLP, and every slot's
keys and values (models/drafter.py, DecoderLayer.forward `query_slots`). This bench runs the
smollm2-cpu preset's drafter step (SmolLM2-135M's shapes: hidden 576, 9 heads, 2 layers, the
49,152-way LM head; 40 anchors x 16, loss_slots 4; 512-token batches of 2 x 256 tokens, half
answer) both ways on the same batches and seeds, interleaved so machine drift hits both: the
objective forward + backward + AdamW step, ms per step both ways, the ratio, and the largest
difference of loss and gradients (tests/test_drafter.py proves them equal in general). In the
dtype the preset trains in on this CPU (bf16 autocast where the CPU has native bf16, fp32
elsewhere), random weights: the step's cost does not depend on them.

Run: .venv/bin/python bench/bench_read_slots.py [--steps 12] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dflash_trainer import bench_harness
from dflash_trainer.bench_harness import StepWay
from dflash_trainer.precision import cpu_has_native_bf16, cpu_kind
from dflash_trainer.train.objective import DFlashObjective

H, V, BS = bench_harness.DEMO_HIDDEN, bench_harness.DEMO_VOCAB, bench_harness.DEMO_BLOCK
ANCHORS, SLOTS = 40, 4


class _EverySlot(DFlashObjective):
    """The same objective with the last layer computing every slot."""

    @property
    def read_slots(self) -> int:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="measured steps each way")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bf16 = cpu_has_native_bf16()
    heads_dtype = torch.bfloat16 if bf16 else torch.float32
    embed = torch.randn(V, H).to(heads_dtype)
    head = torch.nn.Linear(H, V, bias=False).to(heads_dtype).requires_grad_(False)
    ways = {
        "read": StepWay(
            DFlashObjective(BS, ANCHORS, mask_token_id=0, loss_slots=SLOTS), autocast=bf16
        ),
        "every": StepWay(_EverySlot(BS, ANCHORS, mask_token_id=0, loss_slots=SLOTS), autocast=bf16),
    }
    c = bench_harness.compare_drafter_steps(ways, embed, head, args.steps)
    ms, worst_loss, worst_grad = c.ms, c.worst_loss, c.worst_grad
    res = {
        "bench": "read_slots",
        "cpu": cpu_kind(),
        "dtype": "bf16 autocast" if bf16 else "float32",
        **c.record(),
    }
    print(
        f"{cpu_kind()}, {res['dtype']}: drafter step {ms['read']:.0f} ms with the last layer on "
        f"slots 0..{SLOTS} vs {ms['every']:.0f} ms on every slot: {res['speedup']:.2f}x; "
        f"largest relative difference: loss {worst_loss:.1e}, gradients {worst_grad:.1e}"
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
            f"the demo's drafter step ({s['dtype']}, loss_slots {SLOTS} of {BS - 1})",
            "last layer on the read slots",
            "on every slot",
            s["speedup"],
            note=f"{s['read_ms']:.0f} vs {s['every_ms']:.0f} ms per step; loss and gradients "
            f"equal (largest relative difference {s['max_loss_rel_diff']:.1e} / "
            f"{s['max_grad_rel_diff']:.1e})",
        )
    ]


if __name__ == "__main__":
    main()
