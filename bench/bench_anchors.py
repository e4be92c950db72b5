"""Useful work only: the drafter step with per-batch anchors against every row at num_anchors.

A realistic length mix, scaled to a CPU: conversation lengths lognormal around 3 x num_anchors
tokens (the GPU recipe's ~1.5K tokens around 512 anchors), sigma 0.8 (short chats and some
several times the median, cut at 4K), the answer the last 65% of each, length-bucketed into
token-budget batches as the prefetcher builds them. The same batches, the same seeds, one drafter
step (objective forward + backward) each way: every row computing num_anchors blocks, rows
without that many anchor positions padding the rest (the fixed shape), and per-batch anchors
(objective.step_anchors: the blocks the batch's rows can fill, rounded up to num_anchors / 8).
Prints drafter tokens/s both ways, the ratio, and the share of computed blocks that were padding;
the losses are checked equal batch by batch (tests/test_objective.py proves it in general).

Run: .venv/bin/python bench/bench_anchors.py [--batches 24] [--anchors 128] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from dflash_trainer import bench_harness
from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter
from dflash_trainer.pipeline.prefetcher import build_batch
from dflash_trainer.precision import cpu_kind
from dflash_trainer.train.objective import DFlashObjective

H, V, BS, TAPS = 256, 8192, 16, 3


class _Rows:
    """Token rows with loss masks, as the prefetcher's build_batch reads a dataset."""

    def __init__(self, lengths: np.ndarray, seed: int):
        rng = np.random.default_rng(seed)
        self.lengths = lengths
        self.input_ids = [rng.integers(0, V - 1, n) for n in lengths]
        self.loss_mask = []
        for n in lengths:
            m = np.zeros(n, dtype=np.bool_)
            m[int(0.35 * n) :] = True  # the answer: the last 65%
            self.loss_mask.append(m)


def batches(n_batches: int, anchors: int, budget: int, seed: int) -> list:
    """Token-budget batches of similar lengths (sorted, then cut by the budget)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(3 * anchors), 0.8, 40 * n_batches), 32, 4096)
    rows = _Rows(lengths.astype(np.int64), seed)
    order = np.argsort(lengths)
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * int(lengths[i]) > budget:
            out.append(build_batch(rows, np.array(cur), 16, 0))
            cur = []
        cur.append(int(i))
    picked = rng.choice(len(out), size=min(n_batches, len(out)), replace=False)
    return [out[j] for j in sorted(picked)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=24)
    ap.add_argument("--anchors", type=int, default=128)
    ap.add_argument("--budget", type=int, default=4096, help="tokens per batch")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = DFlashConfig(
        hidden_size=H,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=4 * H,
        block_size=BS,
        target_layer_ids=list(range(TAPS)),
        num_target_layers=8,
        mask_token_id=V - 1,
        vocab_size=V,
        attention="split",
    )
    drafter = DFlashDrafter(cfg)
    embed = torch.randn(V, H)
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    obj = DFlashObjective(BS, args.anchors, mask_token_id=V - 1, loss_slots=4)
    work = batches(args.batches, args.anchors, args.budget, 0)
    secs = {"fixed": 0.0, "per_batch": 0.0}
    tokens = computed = useful = 0
    worst = 0.0
    for i, b in enumerate(work):
        feats = torch.randn(*b.input_ids.shape, TAPS * H)
        losses = {}
        for way in ("fixed", "per_batch"):
            n = obj.step_anchors(b.anchor_counts) if way == "per_batch" else None
            t0 = time.perf_counter()
            out = obj(drafter, embed, head, feats, b.input_ids, b.loss_mask,
                      torch.Generator().manual_seed(i), num_anchors=n)  # fmt: skip
            out.loss.backward()
            secs[way] += time.perf_counter() - t0
            drafter.zero_grad(set_to_none=True)
            losses[way] = float(out.loss)
        worst = max(worst, abs(losses["fixed"] - losses["per_batch"]))
        rows = b.input_ids.shape[0]
        tokens += b.num_real_tokens
        computed += rows * args.anchors
        useful += obj.query_tokens(b.anchor_counts, rows) // BS
    res = {
        "bench": "anchors",
        "cpu": cpu_kind(),
        "batches": len(work),
        "anchors": args.anchors,
        "fixed_tok_s": tokens / secs["fixed"],
        "per_batch_tok_s": tokens / secs["per_batch"],
        "padding_share_fixed": 1 - useful / computed,
        "max_loss_diff": worst,
    }
    res["speedup"] = res["per_batch_tok_s"] / res["fixed_tok_s"]
    print(
        f"{len(work)} batches, {tokens} tokens, {args.anchors} anchors: drafter "
        f"{res['fixed_tok_s']:.0f} tok/s with every row at {args.anchors} blocks "
        f"({res['padding_share_fixed']:.0%} of them padding) vs {res['per_batch_tok_s']:.0f} "
        f"with per-batch anchors: {res['speedup']:.2f}x; largest loss difference {worst:.2e}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
    print(json.dumps(res))


# `dflash-trainer bench` (src/dflash_trainer/bench_harness.py) runs this script with these
# arguments (full run, --bench.quick) and turns its summary into rows with bench_rows.
BENCH_ARGS = {"full": [], "quick": ["--batches", "8"]}


def bench_rows(s: dict) -> list[dict]:
    """This script's JSON summary as rows of the `dflash-trainer bench` table."""
    return [
        bench_harness.row(
            "drafter step on a realistic length mix (lognormal, 65% answers)",
            "per-batch anchors",
            f"every row at {s['anchors']}",
            s["speedup"],
            note=f"{s['per_batch_tok_s']:.0f} vs {s['fixed_tok_s']:.0f} tok/s; "
            f"{s['padding_share_fixed']:.0%} of the fixed blocks were padding; losses equal "
            f"(max difference {s['max_loss_diff']:.1e})",
        )
    ]


if __name__ == "__main__":
    main()
