"""`dflash-trainer eval`: speculative decoding with an exported drafter on `eval.datasets`:
acceptance length and speedup, printed and written as JSON."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from dflash_trainer.config import Config
from dflash_trainer.eval.metrics import format_table
from dflash_trainer.eval.specdecode import evaluate_datasets, load_eval_pair

log = logging.getLogger(__name__)


def run(cfg: Config, args) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    drafter_dir = Path(getattr(args, "drafter_path", None) or Path(cfg.run_dir) / "export")
    output = Path(getattr(args, "output", None) or Path(cfg.run_dir) / "eval.json")
    target, drafter, block_size = load_eval_pair(cfg, drafter_dir, device)
    results = evaluate_datasets(cfg, target, drafter, block_size)
    print(format_table(results))
    payload = {
        "drafter": str(drafter_dir),
        "target": getattr(target, "name", cfg.target.model),
        "block_size": block_size,
        "max_new_tokens": cfg.eval.max_new_tokens,
        "temperature": cfg.eval.temperature,
        "top_p": cfg.eval.top_p,
        "seed": cfg.eval.seed,
        "device": str(device),
        "datasets": {k: v.to_dict() for k, v in results.items()},
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(payload, indent=2), encoding="utf-8")
    log.info("eval: wrote %s", output)
    return 0
