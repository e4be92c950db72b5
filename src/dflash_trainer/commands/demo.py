"""`dflash-trainer demo`: the whole product on the embedded default, on any machine.

0. the run directory: an earlier run there is moved aside (never deleted, never mixed);
1. target: SmolLM2-135M-Instruct from its wheel, converted once to a safetensors cache;
2. data: MT-Bench + HumanEval prompts answered by the target itself (cached, resumable); a
   held-out set stratified by source, split into validation (picks best/) and report prompts;
3. training for the preset's wall-time budget;
4. the export decoded on the held-out MT-Bench prompts (eval.max_new_tokens each), where the
   quality goal is stated: tau, plain greedy decoding (speedup, losslessness), each prompt once
   per loop; tau_sim on every reported prompt, per source (no decoding: on a 2-core CPU decoding
   is most of the demo after training);
5. a run report and a summary of where every artefact is.
(An untrained drafter accepts nothing: its tau is 1.000 by construction, so the demo spends no
time measuring it.)
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.config import Config
from dflash_trainer.config_io import FP32_CPU_TABLE, preset_kind_table
from dflash_trainer.data.prepare import REPORT, prepare_data
from dflash_trainer.layout import RunLayout
from dflash_trainer.models.target import TargetModel
from dflash_trainer.observe.progress import Phases
from dflash_trainer.observe.report import write_report
from dflash_trainer.pipeline.feature_cache import capture_for
from dflash_trainer.precision import cpu_kind, dtype_label
from dflash_trainer.run import TrainResult, rundir, train
from dflash_trainer.run.evaluation import HeldoutPrompt, heldout_examples
from dflash_trainer.run.trainer import setup_run_logging

log = logging.getLogger(__name__)


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def run(cfg: Config, args) -> int:
    # Before the log file opens there: an earlier run is moved aside with its own log.
    claimed = rundir.claim(cfg, "overwrite")
    handler = setup_run_logging(Path(cfg.run_dir))
    try:
        if claimed.message:
            _say(claimed.message)
        return _demo(cfg, time.monotonic(), getattr(args, "preset", None), claimed)
    finally:
        logging.getLogger().removeHandler(handler)


def _demo(cfg: Config, t_all: float, preset: str | None, claimed: rundir.Claim) -> int:
    run_dir = Path(cfg.run_dir)
    torch.set_num_threads(cfg.pipeline.cpu_threads or torch.get_num_threads())
    phases = Phases()
    _say(f"CPU: {cpu_kind()}, {torch.get_num_threads()} threads")
    table, shape = preset_kind_table(preset, cfg)
    if table == FP32_CPU_TABLE:
        _say(
            f"    the drafter trains in float32 here (no native bf16): preset {preset}'s "
            f"[{table}] shape, " + ", ".join(f"{k}={v}" for k, v in shape.items())
        )
    _say(f"1/5 target {cfg.target.model} (dtype {cfg.target.dtype})")
    target = TargetModel.load(cfg.target, cfg.pipeline.target_devices[0])
    _say(
        f"    loaded in {phases.end('target'):.1f} s as {dtype_label(target.dtype)}; "
        f"taps {target.layer_ids}"
    )
    _say("2/5 training data: embedded prompts answered by the target (cached)")
    # the taps the target computes while it writes the answers: the first epoch's features
    captured = capture_for(cfg, target)
    train_set, heldout = prepare_data(cfg, target.tokenizer, target=target, capture=captured)
    _say(f"    ready in {phases.end('data'):.0f} s")
    report = [e for e in heldout_examples(heldout, cfg) if e.role == REPORT]
    _say(
        f"    {len(train_set)} training conversations, {int(train_set.lengths.sum())} "
        f"tokens; {len(heldout)} held out ({len(report)} reported, the rest validation)"
    )
    budget = cfg.optim.time_budget_s
    _say(
        "3/5 training (pipelined: prefetcher -> target -> drafter)"
        + (f" for {budget:.0f} s" if budget else "")
        + ", then the held-out evaluation"
    )
    configure_final_eval(cfg, report)
    result = train(
        cfg, target=target, train_set=train_set, heldout=heldout, captured=captured, claimed=claimed
    )
    phases.end("training")
    _say(f"    {result.steps} steps in {result.train_s:.0f} s ({result.reason})")
    if result.balance:
        _say(f"    {result.balance}")
    if result.reason == "signal":
        _say(
            f"stopped by a signal; checkpoint {result.checkpoint}. Resume training with "
            f"`dflash-trainer train --preset smollm2-cpu --run_dir={run_dir} "
            "--checkpoint.resume=true`."
        )
        return 130
    _say(
        f"4/5 held-out evaluation (the run's own, in metrics.jsonl as eval/*): the "
        f"{', '.join(cfg.eval.at_end_sources) or 'reported'} prompts decoded "
        f"({cfg.eval.max_new_tokens} tokens each; ours and plain greedy), "
        "tau_sim on every reported prompt"
    )
    checks = heldout_checks(result.eval, cfg)
    seconds = phases.carve("evaluation", result.eval.get("eval/seconds", 0.0), "training")
    _say(f"    evaluated in {seconds:.0f} s")
    _say("5/5 report")
    _summarize(run_dir, result, checks, t_all, phases)
    return 0


def configure_final_eval(cfg: Config, report: list[HeldoutPrompt]) -> None:
    """The demo's end-of-run evaluation, run by train() like any run's: the held-out MT-Bench
    prompts decoded (where the quality goal is stated; all reported prompts when there are
    none), by ours and plain greedy (speedup, losslessness), each prompt once per loop; tau_sim on
    every reported prompt, per source (eval/tau_sim.py: the loop replayed on the target's own
    held-out answers, no verify passes), so the other sources cost no decoding time: on a 2-core
    CPU decoding is most of the demo after training. The published reference loop's tau equals
    ours by test (tests/test_reference_tau.py, the vLLM parity test in CI); `dflash-trainer eval
    --eval.compare=reference` decodes it beside ours on any export."""
    cfg.eval.at_end = True
    cfg.eval.at_end_sources = ["mt-bench"] if any(e.source == "mt-bench" for e in report) else []
    cfg.eval.at_end_baseline = True
    cfg.eval.compare = []


def heldout_checks(rec: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """demo_summary.json's `heldout` from the end-of-run evaluation's eval/* record (the same
    numbers metrics.jsonl, TensorBoard and W&B have), and its two printed lines."""
    sims = {
        k.removeprefix("eval/tau_sim/"): v for k, v in rec.items() if k.startswith("eval/tau_sim/")
    }
    sims["all"] = rec.get("eval/tau_sim", float("nan"))
    decoded = [k.removeprefix("eval/tau/") for k in rec if k.startswith("eval/tau/")]
    out = {
        "source": ",".join(decoded),
        "prompts": rec["eval/prompts"],
        "max_new_tokens": cfg.eval.max_new_tokens,
        "tau": rec["eval/tau"],
        "tau_reference_loop": rec.get("eval/tau_reference"),
        "speedup": rec.get("eval/speedup"),
        "lossless": rec.get("eval/lossless_line"),
        "tau_sim": sims,
        "tau_sim_prompts": rec.get("eval/tau_sim_prompts"),
        "cycle_in_plain_steps": cycle_in_plain_steps(rec["eval/tau"], rec.get("eval/speedup")),
    }
    ref, cycle = out["tau_reference_loop"], out["cycle_in_plain_steps"]
    _say(
        f"    held-out {out['source']}: tau {out['tau']:.3f}"
        + ("" if ref is None else f" (reference loop {ref:.3f})")
        + f" on {out['prompts']} prompts x {out['max_new_tokens']} tokens; speedup "
        f"{out['speedup'] or 0:.2f}x; {out['lossless']}"
    )
    if cycle is not None:
        _say(
            f"    a draft-verify cycle cost {cycle:.2f} plain greedy steps here: drafting pays on "
            f"this machine above {cycle:.2f} tokens a cycle"
        )
    _say(
        f"    tau_sim on all {out['tau_sim_prompts']} reported prompts: {sims['all']:.3f} "
        f"({per_source(sims)}), {rec.get('eval/dtype')}"
    )
    return out


def per_source(sims: dict[str, float]) -> str:
    """tau_sim per source, as the demo prints it: 'humaneval 1.739, mt-bench 1.212'."""
    return ", ".join(f"{k} {v:.3f}" for k, v in sims.items() if k != "all")


def cycle_in_plain_steps(tau: float, speedup: float | None) -> float | None:
    """What one draft-verify cycle cost in plain greedy steps, from the decoded prompts: the
    speedup is (tau tokens / a cycle's seconds) / (1 token / a plain step's seconds), so a
    cycle is tau / speedup steps, and drafting beats plain decoding only where a cycle commits
    more tokens than that (on a GPU a cycle costs about one step; on a 2-core CPU 1.5-2.5)."""
    if not speedup or speedup <= 0:
        return None
    return tau / speedup


def _summarize(run_dir: Path, result: TrainResult, checks: dict, t_all: float, phases: Phases):
    report_dir = None
    try:
        report_dir = write_report(run_dir)
    except Exception as e:  # the report is a convenience, never fatal
        log.warning("report failed: %s", e)
    phases.end("report")
    layout = RunLayout(run_dir)
    summary = {
        "cpu": cpu_kind(),
        "phases_s": phases.seconds,
        "heldout": checks,
        "steps": result.steps,
        "train_wall_s": result.wall_s,
        "demo_wall_s": time.monotonic() - t_all,
        "first_loss": _first(result.history, "loss"),
        "last_loss": _last(result.history, "loss"),
        "artefacts": {
            "run_dir": str(run_dir),
            "export": str(result.export_dir),
            "checkpoint": str(result.checkpoint),
            "metrics": str(layout.metrics),
            "tensorboard": str(layout.tensorboard),
            "wandb": str(layout.wandb),
            "report": str(report_dir) if report_dir else None,
            "heldout_prompts": str(layout.heldout),
            "log": str(layout.log()),
        },
    }
    layout.demo_summary.write_text(json.dumps(summary, indent=2))
    _say(f"summary (all of it in {layout.demo_summary})")
    for k, v in summary_lines(summary):
        print(f"    {k:<16} {v}")
    for k, v in summary["artefacts"].items():
        print(f"    {k:<16} {v}")


def summary_lines(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """demo_summary.json's figures as the console's few lines (rounded, named)."""
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in summary["phases_s"].items())
    h = summary["heldout"]
    sims = h["tau_sim"]
    first, last = summary["first_loss"], summary["last_loss"]
    losses = "" if first is None or last is None else f", loss {first:.2f} -> {last:.2f}"
    return [
        ("cpu", summary["cpu"]),
        ("wall", f"{summary['demo_wall_s']:.0f} s ({phases})"),
        ("training", f"{summary['steps']} steps{losses}"),
        (
            "held-out",
            f"{h['source']} tau {h['tau']:.3f} on {h['prompts']} prompts, speedup "
            f"{h['speedup'] or 0:.2f}x, {h['lossless']}",
        ),
        ("tau_sim", f"{sims['all']:.3f} on {h['tau_sim_prompts']} prompts ({per_source(sims)})"),
    ]


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
