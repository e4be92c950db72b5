"""Step-time cost of DFlash2 over DFlash on one small CPU shape: the same drafter with and
without the convolutions and the selector (and its loss), forward + backward through the
objective, alternating the two so that load on shared cores hits both alike. Prints the median
step of each and the ratio measured in this run.

    PYTHONPATH=src python bench/bench_dflash2.py [--steps 6] [--hidden 256] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter
from dflash_trainer.train.dflash2_objective import DFlash2Objective
from dflash_trainer.train.objective import DFlashObjective


def build(variant: str, a):
    cfg = DFlashConfig(
        hidden_size=a.hidden,
        num_layers=a.layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=a.hidden // 4,
        intermediate_size=3 * a.hidden,
        block_size=a.block,
        target_layer_ids=[0, 1, 2],
        num_target_layers=6,
        mask_token_id=a.vocab - 1,
        vocab_size=a.vocab,
        variant=variant,
    )
    torch.manual_seed(0)
    cls = DFlash2Objective if variant == "dflash2" else DFlashObjective
    return DFlashDrafter(cfg), cls(a.block, a.anchors, mask_token_id=a.vocab - 1)


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
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(a.hidden, a.vocab, bias=False).requires_grad_(False)
    embed = torch.randn(a.vocab, a.hidden, generator=g)
    feats = torch.randn(1, a.seq, 3 * a.hidden, generator=g)
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
        f"shape H={a.hidden} V={a.vocab} L={a.layers} block={a.block} anchors={a.anchors} "
        f"seq={a.seq}, {torch.get_num_threads()} threads, {a.steps} steps each (alternating)"
    )
    for v, m in med.items():
        print(f"{v:8s} median step {m * 1000:8.1f} ms")
    print(f"dflash2 / dflash step time: {med['dflash2'] / med['dflash']:.2f}x")


if __name__ == "__main__":
    main()
