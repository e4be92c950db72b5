"""`make quality`: a drafter from an empty cache within 60 minutes on 2 cores (issue 32).

Phases (preset smollm2-quality; the time plan is in the preset's header):
  1. target        load (the embedded SmolLM2 converted once to a safetensors cache)
  2. embedded      MT-Bench + HumanEval prompts answered greedily by the target (cached)
  3. synthesis     synth.prompts user turns written by the target (the `synth` data source,
                   data/synthesize.py; cached)
  4. answers       the synthesised prompts answered by the target ([generate]'s length and
                   engine: vLLM where installed): greedy, or sampled
                   (synth.answer_sampling); cached; provenance per record
  5. training      optim.time_budget_s, periodic evaluation on the validation prompts every
                   eval.every_steps (eval/tau and eval/tau_sim against wall minutes: the curve)
  6. evaluation    the export on the reported held-out prompts of each embedded source (never
                   trained on; synthesised prompts are never near them): tau of the project's
                   loop with the published reference loop and vLLM (where installed) beside
                   it, plain greedy (speedup),
                   adaptive verify on the code prompts (speedup), tau_sim per source
  7. report        run report (plots) and quality_summary.json: phases, tau per source, curve

Variants (the data sources of the issue's table; one machine, one table):
  embedded       the embedded prompts, greedy answers (the demo's data)
  synth-greedy   + synthesised prompts, greedy answers
  synth-sampled  + synthesised prompts, answers sampled at T=0.8, top-p 0.95 (the peers'
                 temperatures; --set synth.answer_sampling.temperature=... for another)
  raw-kd         + a conversation file the target did not write (--raw FILE), every label the
                 target's own distribution at that position (objective.kd_weight=1: one prefill)

Run: python bench/quality_run.py [--variant synth-greedy] [--set KEY=VALUE ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from dflash_trainer.config_io import load_config, set_value
from dflash_trainer.data.generate import ensure_embedded_responses
from dflash_trainer.data.prepare import prepare_data
from dflash_trainer.data.synthesize import (
    ensure_synth_responses,
    synth_cache_paths,
    synthesized_prompts,
)
from dflash_trainer.models.target import TargetModel
from dflash_trainer.models.vllm_engine import find_vllm_python, vllm_unavailable
from dflash_trainer.observe.progress import Phases
from dflash_trainer.observe.report import write_report
from dflash_trainer.precision import cpu_kind
from dflash_trainer.run import rundir, train

log = logging.getLogger("quality")
VARIANTS = ("embedded", "synth-greedy", "synth-sampled", "raw-kd")
# adaptive verify (speedup) is measured on the sources the speedup goals are stated on
ADAPTIVE = ["mt-bench", "humaneval"]


def say(msg: str) -> None:
    print(f"[quality] {msg}", flush=True)


def synth_phases(cfg, target, phases: Phases) -> None:
    """Phases 3-4 of the `synth` data source (data/synthesize.ensure_synth_responses, cached by
    every setting that made them), timed apart: the prompts, then their answers."""
    prompts_file, _ = synth_cache_paths(cfg)
    synthesized_prompts(cfg, target, prompts_file, cfg.generate.engine)
    say(f"3/7 synthesis in {phases.end('synthesis'):.0f} s")
    res = ensure_synth_responses(cfg, target)
    t = cfg.synth.answer_sampling.temperature
    say(f"4/7 answers in {phases.end('answers'):.0f} s (T={t}): {res}")


def configure_final_eval(cfg, compare: str = "auto") -> None:
    """Phase 6 is the run's own end-of-run evaluation (run/evaluation.py, in metrics.jsonl as
    eval/*): the reported prompts (data.report_sources; the preset names MT-Bench and HumanEval,
    where the goals are stated; [] = every held-out source) decoded by ours, plain greedy
    (speedup), the reference loop and, where vLLM is installed (`make quality` installs it),
    vLLM serving the export; adaptive verify on chat and code (ADAPTIVE: the speedup goals are
    stated on them); tau_sim on every reported prompt. `compare`: the engines beside ours,
    comma-separated, or auto (the reference loop, and vLLM where installed)."""
    e = cfg.eval
    e.at_end, e.at_end_sources, e.at_end_baseline = True, list(cfg.data.report_sources), True
    if compare == "auto":
        served = vllm_unavailable(find_vllm_python(e.vllm_python)) is None
        e.compare = ["reference"] + (["vllm"] if served else [])
    else:
        e.compare = [c for c in compare.split(",") if c]
    e.at_end_adaptive = list(ADAPTIVE)


def heldout_checks(rec: dict) -> dict:
    """quality_summary.json's `heldout` from the end-of-run evaluation's eval/* record, per
    decoded source (those with eval/prompts/<source>): tau (ours, the reference loop, vLLM),
    speedup over plain greedy with full and adaptive verify; tau_sim on every reported
    prompt."""
    out: dict = {}
    decoded = sorted(k.removeprefix("eval/prompts/") for k in rec if k.startswith("eval/prompts/"))
    for src in decoded:
        row = {"prompts": rec[f"eval/prompts/{src}"], "tau": rec[f"eval/tau/{src}"]}
        row["tau_reference_loop"] = rec.get(f"eval/tau_reference/{src}")
        row["tau_vllm"] = rec.get(f"eval/tau_vllm/{src}")  # None where vLLM is not installed
        row.update(speedup=rec.get(f"eval/speedup/{src}"))
        row.update(lossless=rec.get(f"eval/lossless_line/{src}"))
        row["speedup_adaptive"] = rec.get(f"eval/speedup_adaptive/{src}")
        out[src] = row
        say(f"    {src}: {json.dumps(row)}")
    sims = {
        k.removeprefix("eval/tau_sim/"): v for k, v in rec.items() if k.startswith("eval/tau_sim/")
    }
    out["tau_sim"] = {"all": rec.get("eval/tau_sim", float("nan")), **dict(sorted(sims.items()))}
    return out


def tau_curve(run_dir: Path) -> list[dict]:
    """The periodic evaluations of the run: minutes since its first metrics record, step,
    eval/tau (overall and per source) and eval/tau_sim on the validation prompts."""
    path, rows, t0 = run_dir / "metrics.jsonl", [], None
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line) if line.strip() else {}
        t0 = rec.get("wall", t0) if t0 is None else t0
        periodic = rec.get("eval/set", "validation") == "validation"  # not the end's heldout
        if "eval/tau" in rec and periodic and rec.get("wall") is not None and t0 is not None:
            rows.append(
                {
                    "minutes": round((rec["wall"] - t0) / 60, 2),
                    "step": rec.get("step"),
                    "tau": rec["eval/tau"],
                    "tau_sim": rec.get("eval/tau_sim"),
                    **{k[len("eval/") :]: v for k, v in rec.items() if k.startswith("eval/tau/")},
                }
            )
    return rows


def build_config(args):
    cfg = load_config(preset=args.preset)
    if args.variant == "raw-kd":
        if not args.raw:
            raise SystemExit("raw-kd trains on a file the target did not write: pass --raw FILE")
        set_value(cfg, "objective.kd_weight", "1")
    if args.variant.startswith("synth"):
        cfg.data.sources = [*cfg.data.sources, "synth"]
    if args.variant == "synth-sampled":  # the peers' temperatures
        cfg.synth.answer_sampling.temperature, cfg.synth.answer_sampling.top_p = 0.8, 0.95
    for kv in args.set:
        k, _, v = kv.partition("=")
        set_value(cfg, k, v)
    if args.run_dir:
        cfg.run_dir = args.run_dir
    configure_final_eval(cfg, args.compare)
    return cfg


def run(args) -> dict:
    cfg, t_all, phases = build_config(args), time.monotonic(), Phases()
    run_dir = Path(cfg.run_dir)
    rundir.prepare(run_dir, "overwrite")
    torch.set_num_threads(cfg.pipeline.cpu_threads or torch.get_num_threads())
    say(f"variant {args.variant}; CPU {cpu_kind()}, {torch.get_num_threads()} threads")
    target = TargetModel.load(cfg.target, cfg.pipeline.target_devices[0])
    say(f"1/7 target loaded in {phases.end('target'):.0f} s ({target.dtype})")
    ensure_embedded_responses(cfg, target=target)
    say(f"2/7 embedded answers in {phases.end('embedded'):.0f} s")
    if args.variant.startswith("synth"):
        synth_phases(cfg, target, phases)
    if args.variant == "raw-kd":
        cfg.data.sources = [*cfg.data.sources, args.raw]
    train_set, heldout = prepare_data(cfg, target.tokenizer, target=target)
    phases.end("data")
    say(f"5/7 training on {len(train_set)} conversations ({int(train_set.lengths.sum())} tokens)")
    result = train(cfg, target=target, train_set=train_set, heldout=heldout)
    phases.end("training")
    # train() ran the end-of-run evaluation after training: its seconds are their own phase
    seconds = phases.carve("evaluation", result.eval.get("eval/seconds", 0.0), "training")
    say(f"    {result.steps} steps in {phases.seconds['training']:.0f} s ({result.reason})")
    checks = heldout_checks(result.eval)
    say(f"6/7 evaluated in {seconds:.0f} s")
    try:
        write_report(run_dir)
    except Exception as e:  # the plots are a convenience, never fatal
        log.warning("report failed: %s", e)
    phases.end("report")
    summary = {
        "variant": args.variant,
        "cpu": cpu_kind(),
        "phases_s": phases.seconds,
        "total_min": round((time.monotonic() - t_all) / 60, 1),
        "steps": result.steps,
        "train_conversations": len(train_set),
        "train_tokens": int(train_set.lengths.sum()),
        "heldout": checks,
        "curve": tau_curve(run_dir),
    }
    (run_dir / "quality_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variant", default="synth-greedy", choices=VARIANTS)
    ap.add_argument("--preset", default="smollm2-quality")
    ap.add_argument("--run-dir", default="", help="default: the preset's run_dir")
    ap.add_argument("--raw", default="", help="raw-kd: conversations the target did not write")
    ap.add_argument(
        "--compare",
        default="auto",
        help="engines decoding the held-out prompts beside ours: reference,vllm (comma-separated) "
        "or auto (the reference loop, and vLLM where installed)",
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", default="", help="also write the summary here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    summary = run(args)
    text = json.dumps(summary, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
