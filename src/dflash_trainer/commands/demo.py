"""`dflash-trainer demo`: the whole product on the embedded default, on any machine.

0. the run directory: an earlier run there is moved aside (never deleted, never mixed);
1. target: SmolLM2-135M-Instruct from its wheel, converted once to a safetensors cache;
2. data: MT-Bench + HumanEval prompts answered by the target itself (cached, resumable); a
   held-out set stratified by source, split into validation (picks best/) and report prompts;
3. the floor: tau_sim of the drafter before training, on the report prompts (cheap: it replays
   the draft-verify loop on the target's own answers, no verify passes);
4. training for the preset's wall-time budget; at its end every report prompt is decoded:
   tau per source and overall, with tau_sim beside it (run/evaluation.py);
5. speedup and losslessness against plain greedy decoding on the held-out MT-Bench prompts,
   and tau of the published reference loop (`dflash_generate`) on the export, same prompts;
6. a run report and a summary of where every artefact is.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from dflash_trainer.config import Config
from dflash_trainer.data.prepare import REPORT, prepare_data
from dflash_trainer.eval.dtype import drafter_in, dtype_label, eval_dtype, target_in
from dflash_trainer.eval.metrics import format_table
from dflash_trainer.eval.reference import reference_tau
from dflash_trainer.eval.specdecode import evaluate
from dflash_trainer.eval.tau_sim import TauSim
from dflash_trainer.models.export import load_drafter
from dflash_trainer.models.target import TargetModel
from dflash_trainer.observe.report import write_report
from dflash_trainer.run import TrainResult, rundir, train
from dflash_trainer.run.build import build_drafter
from dflash_trainer.run.evaluation import heldout_examples
from dflash_trainer.run.trainer import setup_run_logging

log = logging.getLogger(__name__)


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def run(cfg: Config, args) -> int:
    # Before the log file opens there: an earlier run is moved aside with its own log.
    moved = rundir.prepare(Path(cfg.run_dir), "overwrite")
    handler = setup_run_logging(Path(cfg.run_dir))
    try:
        if moved:
            _say(moved)
        return _demo(cfg, time.monotonic())
    finally:
        logging.getLogger().removeHandler(handler)


def _demo(cfg: Config, t_all: float) -> int:
    run_dir = Path(cfg.run_dir)
    torch.set_num_threads(cfg.pipeline.cpu_threads or torch.get_num_threads())
    _say(f"1/6 target {cfg.target.model} (dtype {cfg.target.dtype})")
    t = time.monotonic()
    target = TargetModel.load(cfg.target, cfg.pipeline.target_devices[0])
    _say(
        f"    loaded in {time.monotonic() - t:.1f} s as {dtype_label(target.dtype)}; "
        f"taps {target.layer_ids}"
    )
    _say("2/6 training data: embedded prompts answered by the target (cached)")
    train_set, heldout = prepare_data(cfg, target.tokenizer, target=target)
    report = [e for e in heldout_examples(heldout, cfg) if e.role == REPORT]
    _say(
        f"    {len(train_set)} training conversations, {int(train_set.lengths.sum())} "
        f"tokens; {len(heldout)} held out ({len(report)} reported, the rest validation)"
    )
    dtype = eval_dtype(cfg.eval.dtype, target.device, target.dtype)
    eval_target = target_in(target, dtype)
    block = cfg.eval.block_size or cfg.drafter.block_size
    _say(f"3/6 the floor: tau_sim of the drafter before training, {len(report)} prompts")
    untrained = build_drafter(cfg, target, cfg.pipeline.drafter_device)
    sim = TauSim(eval_target, [(e.id, e.ids, len(e.prompt)) for e in report])
    floor = sim.run(drafter_in(untrained, dtype), cfg.eval.max_new_tokens, block).tau
    _say(f"    tau_sim {floor:.3f}")
    del untrained, sim

    budget = cfg.optim.time_budget_s
    _say(
        "4/6 training (pipelined: prefetcher -> target -> drafter)"
        + (f" for {budget:.0f} s" if budget else "")
    )
    result = train(cfg, target=target, train_set=train_set, heldout=heldout)
    _say(f"    {result.steps} steps in {result.wall_s:.0f} s ({result.reason})")
    if result.balance:
        _say(f"    {result.balance}")
    if result.reason == "signal":
        _say(
            f"stopped by a signal; checkpoint {result.checkpoint}. Resume training with "
            f"`dflash-trainer train --preset smollm2-cpu --run_dir={run_dir} "
            "--checkpoint.resume=true`."
        )
        return 130
    for line in _heldout_lines(result.eval):
        _say(line)
    _say("5/6 speedup, losslessness and the reference loop on the held-out MT-Bench prompts")
    checks = _serving_checks(cfg, eval_target, result.export_dir, report, dtype, block)
    _say("6/6 report")
    _summarize(run_dir, result, floor, checks, t_all)
    return 0


def _heldout_lines(ev: dict) -> list[str]:
    if not ev:
        return ["    no end-of-run evaluation (eval.at_end=false or no held-out prompts)"]
    per = ", ".join(
        f"{k.split('/')[-1]} {v:.3f}" for k, v in sorted(ev.items()) if k.startswith("eval/tau/")
    )
    line = f"    held-out tau {ev['eval/tau']:.3f} on {ev.get('eval/prompts')} prompts ({per})"
    if "eval/tau_sim" in ev:
        line += f"; tau_sim {ev['eval/tau_sim']:.3f}"
    return [line]


def _serving_checks(cfg: Config, eval_target, export_dir, report, dtype, block) -> dict:
    """Spec decoding vs plain greedy (speedup, lossless) and the reference loop's tau."""
    chosen = [e for e in report if e.source == "mt-bench"] or report
    prompts = [e.prompt for e in chosen]
    drafter = drafter_in(load_drafter(export_dir, cfg.pipeline.drafter_device), dtype)
    n = cfg.eval.max_new_tokens
    s = evaluate(eval_target, drafter, prompts, n, block, baseline=True)
    ref = reference_tau(export_dir, eval_target.model, prompts, n, block, eval_target.eos_token_ids)
    print(format_table({"trained": s}), flush=True)
    out = {
        "prompts": len(prompts),
        "source": chosen[0].source if chosen else None,
        "tau": s.tau,
        "tau_reference_loop": ref["tau"],
        "speedup": s.speedup,
        "lossless": s.lossless_line(),
    }
    _say(
        f"    tau {s.tau:.3f} (reference loop {ref['tau']:.3f}) on {len(prompts)} "
        f"{out['source']} prompts; speedup {s.speedup:.2f}x; {out['lossless']}"
    )
    return out


def _summarize(run_dir: Path, result: TrainResult, floor: float, checks: dict, t_all: float):
    report_dir = None
    try:
        report_dir = write_report(run_dir)
    except Exception as e:  # the report is a convenience, never fatal
        log.warning("report failed: %s", e)
    summary = {
        "tau_sim_untrained": floor,
        "heldout": {k: v for k, v in result.eval.items() if k.startswith("eval/tau")},
        "serving": checks,
        "steps": result.steps,
        "train_wall_s": result.wall_s,
        "demo_wall_s": time.monotonic() - t_all,
        "first_loss": _first(result.history, "loss"),
        "last_loss": _last(result.history, "loss"),
        "artefacts": {
            "run_dir": str(run_dir),
            "export": str(result.export_dir),
            "checkpoint": str(result.checkpoint),
            "metrics": str(run_dir / "metrics.jsonl"),
            "tensorboard": str(run_dir / "tb"),
            "wandb": str(run_dir / "wandb"),
            "report": str(report_dir) if report_dir else None,
            "heldout_prompts": str(run_dir / "heldout.jsonl"),
            "log": str(run_dir / "train.log"),
        },
    }
    (run_dir / "demo_summary.json").write_text(json.dumps(summary, indent=2))
    _say("summary")
    for k, v in summary.items():
        if k != "artefacts":
            print(f"    {k:<16} {v}")
    for k, v in summary["artefacts"].items():
        print(f"    {k:<16} {v}")


def _first(history, name):
    for _, m in history:
        if name in m:
            return m[name]
    return None


def _last(history, name):
    for _, m in reversed(history):
        if name in m:
            return m[name]
    return None
