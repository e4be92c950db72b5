"""Drafter quality against training time: held-out tau after fixed training wall times.

For each recipe and each budget, train on the embedded default (the target's own answers to
MT-Bench + HumanEval, cached by `make demo` or the first run here) with `optim.time_budget_s`,
then take the run's own end-of-run evaluation: acceptance length on every reported held-out
prompt (greedy, block 16, eval.dtype: fp32 on CPU), per source, with `eval/tau_sim` beside it.

Recipes: the default (preset smollm2-cpu as shipped), the default without each lever:
  random-init   drafter.init=random instead of target
  bf16          target.dtype=bfloat16 + pipeline.precision=bfloat16 (auto picks fp32 where bf16
                matmuls are emulated, bf16 where they are native)
  one-epoch     the recipe before the time budget: one pass over the data, no budget
  all-slots     objective.loss_slots=0: the LM head on every block slot
  no-cache      pipeline.feature_cache_gb=0: the target runs in every epoch
  big-batches   the earlier batching: 2048-token batches, 20 anchors
and the objectives and starts of issue 18, each on top of the default:
  kd            objective.kd_weight=0.5 (logit distillation)
  dpace         objective.weighting=dpace (D-PACE position weights)
  noise         objective.feature_noise=0.05
  hidden        objective.hidden_weight=1 (hidden-state regression)
  warm-start    drafter.init_from = the default recipe's export at the same budget, trained
                for that budget again (list it after `default`)

Run: .venv/bin/python bench/bench_quality.py [--budgets 120,300,600,900] [--recipes a,b]
     [--max-new-tokens 128] [--json OUT]
Each (recipe, budget) cell costs its budget plus about five minutes of evaluation on 2 cores
(every reported prompt decoded): all recipes at the default budgets take several hours
(`make bench-quality`); pick recipes and one budget, e.g. --budgets 240 --recipes
default,kd,dpace,noise,warm-start (about 50 minutes); --quick runs one short budget.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from dflash_trainer.config_io import load_config, set_value
from dflash_trainer.data.prepare import prepare_data
from dflash_trainer.models.target import TargetModel
from dflash_trainer.precision import cpu_kind
from dflash_trainer.run import train

RECIPES = {
    "default": {},
    "random-init": {"drafter.init": "random"},
    "bf16": {"target.dtype": "bfloat16", "pipeline.precision": "bfloat16"},
    "one-epoch": {"optim.time_budget_s": "0", "optim.epochs": "1"},
    "all-slots": {"objective.loss_slots": "0"},
    "no-cache": {"pipeline.feature_cache_gb": "0"},
    "big-batches": {"batching.max_tokens": "2048", "objective.num_anchors": "20"},
    "kd": {"objective.kd_weight": "0.5"},
    "dpace": {"objective.weighting": "dpace"},
    "noise": {"objective.feature_noise": "0.05"},
    "hidden": {"objective.hidden_weight": "1"},
    "warm-start": {},  # drafter.init_from is set per budget (run_cell)
}


def run_cell(recipe: str, budget: float, args, root: Path) -> dict:
    """Train one recipe for `budget` seconds; its end-of-run evaluation decodes every reported
    held-out prompt (tau per source, tau_sim beside it; run/evaluation.py)."""
    cfg = load_config(preset="smollm2-cpu")
    cfg.run_dir = str(root / f"{recipe}-{int(budget)}")
    set_value(cfg, "optim.time_budget_s", str(budget))
    set_value(cfg, "eval.max_new_tokens", str(args.max_new_tokens))
    for k, v in RECIPES[recipe].items():
        set_value(cfg, k, v)
    if recipe == "warm-start":
        start = root / f"default-{int(budget)}" / "export"
        if not start.is_dir():
            raise SystemExit("warm-start continues the default recipe's export: list default first")
        set_value(cfg, "drafter.init_from", str(start))
    cfg.metrics.wandb, cfg.metrics.tensorboard, cfg.metrics.console = "off", False, False
    target = TargetModel.load(cfg.target, "cpu")
    train_set, heldout = prepare_data(cfg, target.tokenizer, target=target)
    t0 = time.monotonic()
    res = train(cfg, target=target, train_set=train_set, heldout=heldout)
    ev = res.eval
    cell = {
        "recipe": recipe,
        "budget_s": budget,
        "steps": res.steps,
        "train_s": round(res.wall_s, 1),
        "tokens": res.tokens,
        "tau": round(ev.get("eval/tau", float("nan")), 4),
        "tau_sim": round(ev.get("eval/tau_sim", float("nan")), 4),
        "prompts": ev.get("eval/prompts", 0),
        "per_source": {
            k.split("/")[-1]: round(v, 4) for k, v in ev.items() if k.startswith("eval/tau/")
        },
        "total_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(cell), file=sys.stderr, flush=True)
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--budgets", default="120,300,600,900", help="training wall times, seconds")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per prompt")
    ap.add_argument("--quick", action="store_true", help="one 60 s budget, default + random-init")
    ap.add_argument("--json", default="", help="also write the cells to this file")
    args = ap.parse_args()
    budgets = [60.0] if args.quick else [float(b) for b in args.budgets.split(",")]
    recipes = ["default", "random-init"] if args.quick else args.recipes.split(",")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        ap.error(f"unknown recipe(s) {unknown}; choose from {sorted(RECIPES)}")
    cells = []
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        for budget in budgets:
            for recipe in recipes:
                cells.append(run_cell(recipe, budget, args, Path(tmp)))
    print(
        f"| recipe | budget s | steps | tau (held-out, {args.max_new_tokens} tokens) | per source "
        "| tau_sim |"
    )
    print("|---|---|---|---|---|---|")
    for c in cells:
        per = ", ".join(f"{k} {v:.3f}" for k, v in sorted(c["per_source"].items()))
        print(
            f"| {c['recipe']} | {c['budget_s']:.0f} | {c['steps']} | {c['tau']:.3f} | {per} "
            f"| {c['tau_sim']:.3f} |"
        )
    summary = {"machine": cpu_kind(), "cells": cells}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
