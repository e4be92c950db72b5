"""`dflash-trainer eval`: speculative decoding with an exported drafter on `eval.datasets`:
acceptance length and speedup, printed and written as JSON (--output, default RUN_DIR/eval.json).
The same eval/* record as a run's end-of-run evaluation (eval/tau, eval/tau/<dataset>,
eval/speedup, eval/lossless, eval/tau_<engine> of eval.compare) is appended to RUN_DIR's
metrics.jsonl (and TensorBoard / W&B as configured) at the export's step when the export belongs
to a run directory with metrics; otherwise it is only in the results file (`events`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.config import Config
from dflash_trainer.config_io import load_config
from dflash_trainer.eval.engines import EvalRun, eval_command_engines
from dflash_trainer.eval.evaluation import evaluate_datasets, load_eval_pair
from dflash_trainer.eval.metrics import format_table
from dflash_trainer.eval.parity import parity_error, report_compared
from dflash_trainer.layout import RunLayout
from dflash_trainer.models.export import read_training
from dflash_trainer.observe.sinks import append_to_run
from dflash_trainer.precision import dtype_label

log = logging.getLogger(__name__)


def config_for(cfg: Config, args: Any, drafter_dir: Path) -> Config:
    """The export's recorded training config (training.json: target, taps, chat template
    settings, run_dir) as the base, with the command line's preset, --config file and flags on
    top; `cfg` unchanged when the export records none."""
    rec = read_training(drafter_dir) if drafter_dir.is_dir() else None
    if rec is None:
        return cfg
    base = rec["config"]
    target = rec.get("target", {})
    local = target.get("local_dir")
    if local and not Path(str(base.get("target", {}).get("model", ""))).is_dir():
        base = {**base, "target": {**base.get("target", {}), "model": local}}
    out = load_config(
        getattr(args, "preset", None),
        getattr(args, "config_file", None),
        getattr(args, "overrides", []),
        base=base,
    )
    log.info(
        "eval: target %s and settings from %s (step %s)",
        out.target.model,
        drafter_dir / "training.json",
        rec.get("step"),
    )
    return out


def run(cfg: Config, args: Any) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    drafter_dir = Path(getattr(args, "drafter_path", None) or RunLayout.of(cfg.run_dir).export)
    cfg = config_for(cfg, args, drafter_dir)
    output = Path(getattr(args, "output", None) or RunLayout.of(cfg.run_dir).eval_summary)
    target, drafter, block_size = load_eval_pair(cfg, drafter_dir, device)
    run_ = EvalRun.of(evaluate_datasets(cfg, target, drafter, block_size))
    print(format_table(run_.groups))
    run_.compare(
        eval_command_engines(cfg, target, drafter_dir), cfg.eval.max_new_tokens, block_size
    )
    problems = report_compared(run_, target, drafter_dir, cfg.eval.parity_tolerance)
    dtype = dtype_label(target.dtype)
    rec = {**run_.events(), "eval/set": "eval", "eval/dtype": dtype}
    payload: dict[str, Any] = {
        "drafter": str(drafter_dir),
        "target": getattr(target, "name", cfg.target.model),
        "block_size": block_size,
        "max_new_tokens": cfg.eval.max_new_tokens,
        **cfg.eval.sampling.record(),
        "seed": cfg.eval.seed,
        "device": str(device),
        "dtype": dtype,
        "datasets": {k: v.to_dict() for k, v in run_.groups.items()},
        "events": rec,
        "metrics": append_to_run(cfg.metrics, cfg.run_dir, rec, _export_step(drafter_dir)),
    }
    for name, by_group in run_.compared.items():
        for k, s in by_group.items():
            payload["datasets"][k][f"tau_{name}"] = s.tau
            if run_.details[name][k]:
                payload["datasets"][k]["served" if name == "vllm" else name] = run_.details[name][k]
    if "vllm" in run_.compared:
        payload["engine"] = "vllm"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(payload, indent=2), encoding="utf-8")
    log.info("eval: wrote %s", output)
    if problems and cfg.eval.parity != "off":
        raise parity_error(problems)
    return 0


def _export_step(drafter_dir: Path) -> int:
    """The training step the export in `drafter_dir` was written at (0 when it records none)."""
    training = read_training(drafter_dir) if drafter_dir.is_dir() else None
    return int((training or {}).get("step") or 0)
