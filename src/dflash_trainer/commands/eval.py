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
from dflash_trainer.eval.dtype import drafter_in, eval_dtype, target_in
from dflash_trainer.eval.engines import EvalRun, compared_engines, comparison_engine
from dflash_trainer.eval.evaluation import evaluate_datasets, load_eval_pair
from dflash_trainer.eval.metrics import format_table, summarize
from dflash_trainer.eval.parity import parity_error, served_problems
from dflash_trainer.layout import RunLayout
from dflash_trainer.models.export import read_training
from dflash_trainer.models.vllm_engine import find_vllm_python
from dflash_trainer.observe.sinks import build_sinks
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
    dtype = eval_dtype(cfg.eval.dtype, device, target.dtype)  # cast copies where it differs
    names = engines_to_compare(cfg)
    if "vllm" in names and target.dtype != dtype:
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
    spec = [r for s in results.values() for r in s.spec_results]
    ar = [r for s in results.values() for r in s.ar_results]
    overall = summarize(spec, ar or None, block_size)
    overall.prompts = [p for s in results.values() for p in s.prompts]  # tau per context bucket
    run_ = EvalRun(groups=results, overall=overall)
    engines = [comparison_engine(n, cfg, target, drafter_dir, dtype_label(dtype)) for n in names]
    run_.compare(engines, cfg.eval.max_new_tokens, block_size)
    problems = _report_compared(run_, cfg, target, drafter_dir)
    rec = {**run_.events(), "eval/set": "eval", "eval/dtype": dtype_label(dtype)}
    payload: dict[str, Any] = {
        "drafter": str(drafter_dir),
        "target": getattr(target, "name", cfg.target.model),
        "block_size": block_size,
        "max_new_tokens": cfg.eval.max_new_tokens,
        **cfg.eval.sampling.record(),
        "seed": cfg.eval.seed,
        "device": str(device),
        "dtype": dtype_label(dtype),
        "datasets": {k: v.to_dict() for k, v in results.items()},
        "events": rec,
        "metrics": _log_events(cfg, drafter_dir, rec),
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


def engines_to_compare(cfg: Config) -> list[str]:
    """eval.compare and eval.engine=vllm's engines; vLLM too where the parity gate asks for it
    (eval.parity=on, or auto with vLLM installed)."""
    names = compared_engines(cfg)
    p = cfg.eval.parity
    if "vllm" not in names and (
        p == "on" or (p == "auto" and find_vllm_python(cfg.eval.vllm_python))
    ):
        names.append("vllm")
    return names


def _report_compared(run_: EvalRun, cfg: Config, target: Any, drafter_dir: Path) -> list[str]:
    """One line per dataset and compared engine; the parity problems of vLLM's decoding
    (eval/parity.py: the check on the comparison this evaluation made)."""
    problems = served_problems(
        run_, target, drafter_dir, cfg.target.model, cfg.eval.parity_tolerance
    )
    for name, by_group in run_.compared.items():
        for k, s in by_group.items():
            line = f"{k}: tau ours {run_.groups[k].tau:.3f}, {name} {s.tau:.3f}"
            if name == "vllm":  # the served engine decodes tokens: compared with ours
                d = run_.details[name][k]
                found = d["parity_problems"]
                line += f"; identical to ours on {d['identical_to_ours']} of {s.num_responses}, "
                line += s.lossless_line() + ("; PARITY: " + " | ".join(found) if found else "")
            print(line, flush=True)
    return problems


def _log_events(cfg: Config, drafter_dir: Path, rec: dict[str, Any]) -> str:
    """The eval/* record into the run's sinks (metrics.jsonl, TensorBoard, W&B as configured)
    when the export belongs to a run directory with metrics; else only into the results file.
    Returns where it went."""
    run_dir = Path(cfg.run_dir)
    if not RunLayout(run_dir).metrics.is_file():
        return "eval.json only (no RUN_DIR/metrics.jsonl)"
    training = read_training(drafter_dir) if drafter_dir.is_dir() else None
    step = int((training or {}).get("step") or 0)
    cfg.metrics.console = False  # printed above already
    sinks = build_sinks(cfg.metrics, run_dir)
    try:
        sinks.event(rec, step)
    finally:
        sinks.close()
    return str(RunLayout(run_dir).metrics)
