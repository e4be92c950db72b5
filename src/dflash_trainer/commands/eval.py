"""`dflash-trainer eval`: speculative decoding with an exported drafter on `eval.datasets`:
acceptance length and speedup, printed and written as JSON."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from dflash_trainer.config import Config
from dflash_trainer.config_io import load_config
from dflash_trainer.errors import UserError
from dflash_trainer.eval.dtype import drafter_in, dtype_label, eval_dtype, target_in
from dflash_trainer.eval.evaluation import evaluate_datasets, load_eval_pair
from dflash_trainer.eval.metrics import format_table
from dflash_trainer.eval.served import compare_served, find_vllm_python
from dflash_trainer.models.export import read_training

log = logging.getLogger(__name__)


def config_for(cfg: Config, args, drafter_dir: Path) -> Config:
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


def run(cfg: Config, args) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    drafter_dir = Path(getattr(args, "drafter_path", None) or Path(cfg.run_dir) / "export")
    cfg = config_for(cfg, args, drafter_dir)
    output = Path(getattr(args, "output", None) or Path(cfg.run_dir) / "eval.json")
    target, drafter, block_size = load_eval_pair(cfg, drafter_dir, device)
    dtype = eval_dtype(cfg.eval.dtype, device, target.dtype)  # cast copies where it differs
    served_check = cfg.eval.engine == "vllm" or cfg.eval.parity != "off"
    if served_check and target.dtype != dtype:
        log.warning(
            "eval: the target decodes in %s from weights loaded in %s (target.dtype=%s); vLLM "
            "loads the model directory in %s, so outputs can differ for that reason alone: pass "
            "--target.dtype=%s for a token-exact served comparison",
            dtype_label(dtype),
            dtype_label(target.dtype),
            cfg.target.dtype,
            dtype_label(dtype),
            dtype_label(dtype),
        )
    target, drafter = target_in(target, dtype), drafter_in(drafter, dtype)
    results = evaluate_datasets(cfg, target, drafter, block_size)
    print(format_table(results))
    served = None
    if served_check:
        if (
            cfg.eval.engine == "vllm"
            or cfg.eval.parity == "on"
            or find_vllm_python(cfg.eval.vllm_python)
        ):
            served = compare_served(
                cfg, target, drafter_dir, results, block_size, dtype_label(dtype)
            )
    payload = {
        "drafter": str(drafter_dir),
        "target": getattr(target, "name", cfg.target.model),
        "block_size": block_size,
        "max_new_tokens": cfg.eval.max_new_tokens,
        "temperature": cfg.eval.temperature,
        "top_p": cfg.eval.top_p,
        "seed": cfg.eval.seed,
        "device": str(device),
        "dtype": dtype_label(dtype),
        "datasets": {k: v.to_dict() for k, v in results.items()},
    }
    if served is not None:
        payload["engine"] = "vllm"
        for k, v in served.items():
            payload["datasets"][k]["served"] = v
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(payload, indent=2), encoding="utf-8")
    log.info("eval: wrote %s", output)
    problems = [f"{k}: {p}" for k, v in (served or {}).items() for p in v["parity_problems"]]
    if problems and cfg.eval.parity != "off":
        raise UserError(
            "train/serve parity failed (vLLM serving the export disagrees with the project's "
            "loop on the same prompts):\n  - " + "\n  - ".join(problems)
        )
    return 0
