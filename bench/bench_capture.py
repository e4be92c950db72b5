"""Regenerate and capture in one pass (pipeline.capture_features) against recomputing the taps in
the first epoch, on the embedded target and the demo's preset, this CPU.

  generation   the same prompts answered twice by the project's loop, with and without keeping
               the taps it computes (the capture's cost; the answers must be identical)
  first epoch  one epoch of training on those answers, the features either adopted from the
               capture or computed by the target worker as usual: tokens/s of the epoch and the
               per-step losses of both (equal up to fp32 rounding: the taps of a KV-cached decode
               against one prefill)

Both arms train from the same seed on the same batches; the difference is where the first epoch's
features come from. Prints tokens/s, the ratio and the largest loss difference.

Run: .venv/bin/python bench/bench_capture.py [--prompts 32] [--max-new-tokens 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from dflash_trainer import bench_harness
from dflash_trainer.config_io import load_config
from dflash_trainer.data import embedded
from dflash_trainer.data.chat import Rendering, build_dataset
from dflash_trainer.data.generate import generate_responses
from dflash_trainer.data.sources import load_sources
from dflash_trainer.models.target import TargetModel
from dflash_trainer.pipeline.feature_cache import capture_for
from dflash_trainer.precision import cpu_kind
from dflash_trainer.run import train


def _config(run_dir: Path):
    return load_config(
        "smollm2-cpu",
        None,
        [
            f"--run_dir={run_dir}",
            "--optim.epochs=1",
            "--optim.time_budget_s=0",
            "--eval.every_steps=0",
            "--eval.at_end=false",
            "--metrics.wandb=off",
            "--metrics.tensorboard=false",
            "--metrics.console=false",
            "--pipeline.capture_features=true",
        ],
    )


def _epoch(cfg, target, ds, captured) -> tuple[float, list[float]]:
    """(seconds the stages ran, per-step losses) of one epoch: start-up, the final checkpoint
    and the export are left out (TrainResult.train_s)."""
    res = train(cfg, target=target, train_set=ds, captured=captured)
    return res.train_s, [m["loss"] for _, m in res.history if "loss" in m]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    cfg = _config(tmp / "capture")
    torch.set_num_threads(cfg.pipeline.cpu_threads or torch.get_num_threads())
    target = TargetModel.load(cfg.target, "cpu")
    prompts = embedded.embedded_prompts()
    random.Random(0).shuffle(prompts)
    prompts = prompts[: args.prompts]
    gen = dict(max_new_tokens=args.max_new_tokens, batch_size=64, progress=False)
    captured = capture_for(cfg, target)
    assert captured is not None, "the preset keeps no feature cache on this device"
    t0 = time.perf_counter()
    generate_responses(target, prompts, tmp / "captured.jsonl", capture=captured, **gen)
    gen_capture = time.perf_counter() - t0
    t0 = time.perf_counter()
    generate_responses(target, prompts, tmp / "plain.jsonl", **gen)
    gen_plain = time.perf_counter() - t0
    answers = [
        [json.loads(x)["messages"][-1]["content"] for x in (tmp / f).read_text().splitlines()]
        for f in ("captured.jsonl", "plain.jsonl")
    ]
    convs, _ = load_sources([str(tmp / "captured.jsonl")])
    ds = build_dataset(
        cfg.data, target.tokenizer, convs, tmp / "tok", Rendering.from_config(cfg), False
    )
    tokens = int(ds.lengths.sum())
    s_cap, loss_cap = _epoch(cfg, target, ds, captured)
    s_plain, loss_plain = _epoch(_config(tmp / "plain"), target, ds, None)
    diff = max((abs(a - b) for a, b in zip(loss_cap, loss_plain)), default=float("nan"))
    out = {
        "cpu": cpu_kind(),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "generation_s": {"capture": round(gen_capture, 1), "plain": round(gen_plain, 1)},
        "identical_answers": answers[0] == answers[1],
        "rows_captured": len(captured),
        "epoch_tokens": tokens,
        "epoch_tok_s": {
            "capture": round(tokens / s_cap, 1),
            "recompute": round(tokens / s_plain, 1),
        },
        "epoch_capture_vs_recompute": round(s_plain / s_cap, 3),
        "steps": [len(loss_cap), len(loss_plain)],
        "max_loss_diff": diff,
        "first_losses": [round(x, 4) for x in loss_cap[:3]],
    }
    print(
        f"capture: generation {gen_capture:.1f} s vs {gen_plain:.1f} s plain (identical answers "
        f"{out['identical_answers']}); first epoch {out['epoch_tok_s']['capture']} vs "
        f"{out['epoch_tok_s']['recompute']} tok/s ({out['epoch_capture_vs_recompute']}x), "
        f"{out['steps'][0]} steps, largest loss difference {diff:.2e}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


# `dflash-trainer bench` (src/dflash_trainer/bench_harness.py) runs this script with these
# arguments (full run, --bench.quick) and turns its summary into rows with bench_rows.
BENCH_ARGS = {
    "full": ["--prompts", "32", "--max-new-tokens", "64"],
    "quick": ["--prompts", "16", "--max-new-tokens", "32"],
}


def bench_rows(s: dict) -> list[dict]:
    """This script's JSON summary as rows of the `dflash-trainer bench` table."""
    return [
        bench_harness.row(
            "first training epoch (tokens/s)",
            "features captured while generating",
            "recomputed by the target",
            s["epoch_capture_vs_recompute"],
            note=f"{s['epoch_tok_s']['capture']} vs {s['epoch_tok_s']['recompute']} tok/s; "
            f"largest loss difference {s['max_loss_diff']:.1e} over {s['steps'][0]} steps",
        ),
        bench_harness.row(
            "answer generation, keeping the taps",
            "capture",
            "plain",
            s["generation_s"]["plain"] / s["generation_s"]["capture"],
            note=f"identical answers {s['identical_answers']}",
        ),
    ]


if __name__ == "__main__":
    main()
