"""`dflash-trainer generate`: regenerate assistant responses for --prompts with the target into
--output (JSONL, appended, resumable)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash_trainer.config import Config
from dflash_trainer.data.chat import Rendering
from dflash_trainer.data.generate import generate_with, load_prompts, print_summary
from dflash_trainer.data.synthesize import synthesized_prompts
from dflash_trainer.models.target import TargetModel

log = logging.getLogger(__name__)


def run(cfg: Config, args) -> int:
    rendering = Rendering.from_config(cfg)  # a bad data.chat_template stops before the load
    # synth.prompts > 0: the target writes the prompts (data/synthesize.py), after its load
    prompts = [] if cfg.synth.prompts else load_prompts(args.prompts, cfg)
    if args.limit and args.limit > 0:
        prompts = prompts[: args.limit]
    out = Path(args.output) if args.output else Path(cfg.run_dir) / "generated.jsonl"
    if cfg.pipeline.cpu_threads > 0:
        torch.set_num_threads(cfg.pipeline.cpu_threads)
    target = TargetModel.load(cfg.target, cfg.pipeline.target_devices[0])
    if cfg.synth.prompts:
        prompts = synthesized_prompts(cfg, target, out, getattr(args, "engine", "auto"))
        prompts = prompts[: args.limit] if args.limit and args.limit > 0 else prompts
    how = dict(
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        top_p=args.top_p,
        rendering=rendering,
        seed=cfg.pipeline.seed,
        progress=cfg.metrics.console,
    )
    stats = generate_with(getattr(args, "engine", "hf"), cfg, target, prompts, out, **how)
    print_summary(stats)
    return 0
