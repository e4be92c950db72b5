"""Step-time cost of DFlash2 over DFlash: the same drafter with and without the convolutions
and the selector (and its loss), forward + backward through the objective, alternating the two
so that load on shared cores hits both alike. Prints the median step of each and the ratio
measured in this run.

    PYTHONPATH=src python bench/bench_dflash2.py [--steps 6] [--hidden 256] [--vocab 8192]
    PYTHONPATH=src python bench/bench_dflash2.py --shape smollm2-cpu   # the CPU preset's drafter

`--shape smollm2-cpu`: the smollm2-cpu preset's drafter on its embedded target (SmolLM2-135M:
hidden 576, 9/3 heads of 64, MLP 1536, vocab 49,152, 5 taps), 2 layers, block 16, 40 anchors
per 512-token row, loss on slots 1..4, D-PACE weights: the step the preset trains, without the
target's forward (the same for both variants) and the optimizer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter
from dflash_trainer.models.variants.dflash2 import SelectorLoss
from dflash_trainer.train.objective import DFlashObjective

# the smollm2-cpu preset's drafter (presets/smollm2-cpu.toml) on SmolLM2-135M-Instruct
SHAPES = {
    "smollm2-cpu": dict(
        hidden=576, heads=9, kv_heads=3, head_dim=64, inter=1536, vocab=49152, layers=2,
        block=16, anchors=40, seq=512, taps=5, loss_slots=4, weighting="dpace",
    ),
}  # fmt: skip


def build(variant: str, a):
    cfg = DFlashConfig(
        hidden_size=a.hidden,
        num_layers=a.layers,
        num_heads=a.heads,
        num_kv_heads=a.kv_heads,
        head_dim=a.head_dim or a.hidden // a.heads,
        intermediate_size=a.inter or 3 * a.hidden,
        block_size=a.block,
        target_layer_ids=list(range(a.taps)),
        num_target_layers=a.taps + 3,
        mask_token_id=a.vocab - 1,
        vocab_size=a.vocab,
        variant=variant,
    )
    torch.manual_seed(0)
    obj = DFlashObjective(
        a.block,
        a.anchors,
        mask_token_id=a.vocab - 1,
        loss_slots=a.loss_slots,
        weighting=a.weighting,
        extra_terms=SelectorLoss() if variant == "dflash2" else None,
    )
    return DFlashDrafter(cfg), obj


def step_s(drafter, obj, inputs) -> float:
    t0 = time.perf_counter()
    out = obj(drafter, *inputs, generator=torch.Generator().manual_seed(1))
    out.loss.backward()
    drafter.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=0, help="0: hidden / heads")
    p.add_argument("--inter", type=int, default=0, help="MLP width; 0: 3 * hidden")
    p.add_argument("--taps", type=int, default=3, help="target layers fused into the context")
    p.add_argument("--loss-slots", type=int, default=0, help="0: every slot")
    p.add_argument("--weighting", default="decay", choices=("decay", "dpace"))
    p.add_argument("--shape", choices=sorted(SHAPES), help="a preset's shape (overrides the rest)")
    a = p.parse_args()
    if a.shape:
        vars(a).update(SHAPES[a.shape])
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(a.hidden, a.vocab, bias=False).requires_grad_(False)
    embed = torch.randn(a.vocab, a.hidden, generator=g)
    feats = torch.randn(1, a.seq, a.taps * a.hidden, generator=g)
    ids = torch.randint(0, a.vocab - 1, (1, a.seq), generator=g)
    mask = torch.ones(1, a.seq, dtype=torch.long)
    inputs = (embed, head, feats, ids, mask)
    runs = {v: build(v, a) for v in ("dflash", "dflash2")}
    times: dict[str, list[float]] = {v: [] for v in runs}
    for d, o in runs.values():  # warm-up, not timed
        step_s(d, o, inputs)
    for _ in range(a.steps):
        for v, (d, o) in runs.items():
            times[v].append(step_s(d, o, inputs))
    med = {v: statistics.median(t) for v, t in times.items()}
    print(
        f"shape {a.shape or 'custom'}: H={a.hidden} V={a.vocab} L={a.layers} block={a.block} "
        f"anchors={a.anchors} seq={a.seq} loss_slots={a.loss_slots or 'all'}, "
        f"{torch.get_num_threads()} threads, {a.steps} steps each (alternating)"
    )
    for v, m in med.items():
        print(f"{v:8s} median step {m * 1000:8.1f} ms")
    print(f"dflash2 / dflash step time: {med['dflash2'] / med['dflash']:.2f}x")


if __name__ == "__main__":
    main()
