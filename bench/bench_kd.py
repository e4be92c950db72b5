"""What logit distillation (objective.kd_weight > 0) costs, on the embedded target, this CPU.

  target stage   TargetStep with and without the final hidden states (KD runs the target's
                 layers after the last tap and its final norm, and hands over [B,S,H] more)
  drafter step   the objective's forward + backward with and without the KD term (one more
                 LM-head matmul per drafted slot, chunked; a log-softmax over the target logits)

Repeats of the same batch (median time); tokens/s of each and the with/without ratios, measured in
one run.

Run: .venv/bin/python bench/bench_kd.py [--repeats 3] [--rows 2] [--seq 512] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dflash_trainer import bench_harness
from dflash_trainer.config_io import load_config
from dflash_trainer.models.target import TargetModel
from dflash_trainer.pipeline.messages import Batch, WorkItem
from dflash_trainer.pipeline.steps import TargetStep
from dflash_trainer.precision import cpu_kind
from dflash_trainer.run.build import build_drafter, build_objective, drafter_heads


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    cfg = load_config(preset="smollm2-cpu", overrides=["--target.dtype=float32"])
    target = TargetModel.load(cfg.target, "cpu")
    dev = torch.device("cpu")
    B, S = args.rows, args.seq
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (B, S), generator=g)
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[:, S // 4 :] = True  # a prompt, then the response
    item = WorkItem(0, 0, Batch(ids, mask, torch.arange(B), B * S))
    steps = {kd: TargetStep(target, dev, torch.float32, final_hidden=kd) for kd in (False, True)}
    t_target = {kd: _median_time(lambda s=s: s(item), args.repeats) for kd, s in steps.items()}
    hb = steps[True](item)
    drafter = build_drafter(cfg, target, dev)
    emb, head = drafter_heads(target, drafter, dev, False)
    t_drafter = {}
    for kd in (False, True):
        cfg.objective.kd_weight = 0.5 if kd else 0.0
        obj = build_objective(cfg, drafter)

        def step(obj=obj):
            drafter.zero_grad(set_to_none=True)
            out = obj(
                drafter,
                emb,
                head,
                hb.features,
                hb.input_ids,
                hb.loss_mask,
                torch.Generator().manual_seed(1),
                hb.target_hidden,
            )
            out.loss.backward()

        t_drafter[kd] = _median_time(step, args.repeats)
    tok = B * S
    out = {
        "cpu": cpu_kind(),
        "rows": B,
        "seq": S,
        "anchors": cfg.objective.num_anchors,
        "target_tok_s": {
            "ce": round(tok / t_target[False], 1),
            "kd": round(tok / t_target[True], 1),
        },
        "drafter_tok_s": {
            "ce": round(tok / t_drafter[False], 1),
            "kd": round(tok / t_drafter[True], 1),
        },
        "target_kd_vs_ce": round(t_target[False] / t_target[True], 3),
        "drafter_kd_vs_ce": round(t_drafter[False] / t_drafter[True], 3),
    }
    print(
        f"KD cost, {B} x {S} tokens, {out['anchors']} anchors/row: target stage "
        f"{out['target_tok_s']['kd']} vs {out['target_tok_s']['ce']} tok/s (KD/CE "
        f"{out['target_kd_vs_ce']}), drafter step {out['drafter_tok_s']['kd']} vs "
        f"{out['drafter_tok_s']['ce']} tok/s (KD/CE {out['drafter_kd_vs_ce']})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


# `dflash-trainer bench` (src/dflash_trainer/bench_harness.py) runs this script with these
# arguments (full run, --bench.quick) and turns its summary into rows with bench_rows.
BENCH_ARGS = {"full": [], "quick": ["--repeats", "1", "--seq", "256"]}


def bench_rows(s: dict) -> list[dict]:
    """This script's JSON summary as rows of the `dflash-trainer bench` table."""
    shape = f"{s['rows']} x {s['seq']}, {s['anchors']} anchors/row"
    return [
        bench_harness.row(
            f"target stage, logit distillation ({shape})",
            "KD",
            "CE",
            s["target_kd_vs_ce"],
            note=f"{s['target_tok_s']['kd']} vs {s['target_tok_s']['ce']} tok/s",
        ),
        bench_harness.row(
            f"drafter step, logit distillation ({shape})",
            "KD",
            "CE",
            s["drafter_kd_vs_ce"],
            note=f"{s['drafter_tok_s']['kd']} vs {s['drafter_tok_s']['ce']} tok/s",
        ),
    ]


if __name__ == "__main__":
    main()
