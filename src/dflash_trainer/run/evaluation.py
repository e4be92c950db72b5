"""Periodic evaluation during training: acceptance length on held-out prompts."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from dflash_trainer.config import Config
from dflash_trainer.eval.specdecode import quick_acceptance
from dflash_trainer.models.export import export_drafter

log = logging.getLogger(__name__)


class PeriodicEval:
    """Acceptance length on held-out prompts during training (drafter thread, between steps).

    It borrows the target under `lock` (the target worker takes the same lock per batch), so the
    pipeline stalls for no longer than the evaluation itself. The best drafter by tau is exported
    to `{run_dir}/best`.
    """

    def __init__(self, cfg: Config, target, drafter, heldout, run_dir: Path, lock):
        self.cfg, self.target, self.drafter = cfg, target, drafter
        self.run_dir, self.lock = run_dir, lock
        self.prompts = heldout_prompts(heldout, cfg.eval.num_prompts)
        self.best = float("-inf")

    def run(self, step: int) -> dict | None:
        if not self.prompts:
            return None
        block = self.cfg.eval.block_size or self.cfg.drafter.block_size
        t0 = time.perf_counter()
        with self.lock:
            res = quick_acceptance(
                self.target, self.drafter, self.prompts, self.cfg.eval.max_new_tokens, block
            )
        rec = {
            "eval/tau": float(res["tau"]),
            "eval/seconds": time.perf_counter() - t0,
            "eval/step": step,
        }
        log.info(
            "eval at step %d: tau %.3f on %d held-out prompts (%.1f s)",
            step,
            res["tau"],
            len(self.prompts),
            rec["eval/seconds"],
        )
        if res["tau"] > self.best:
            self.best = res["tau"]
            tmp = self.run_dir / "best.tmp"
            export_drafter(self.drafter, tmp)
            (tmp / "eval.json").write_text(json.dumps({"step": step, "tau": res["tau"]}))
            if (self.run_dir / "best").exists():
                shutil.rmtree(self.run_dir / "best")
            os.replace(tmp, self.run_dir / "best")
            rec["eval/best_tau"] = self.best
        return rec


def heldout_prompts(heldout, limit: int) -> list[list[int]]:
    """Prompt token ids of held-out examples: everything before the first supervised token."""
    out = []
    if heldout is None:
        return out
    for ids, mask in zip(heldout.input_ids, heldout.loss_mask):
        first = int(mask.argmax()) if mask.any() else 0
        if first > 0:
            out.append([int(t) for t in ids[:first]])
        if len(out) >= limit:
            break
    return out
