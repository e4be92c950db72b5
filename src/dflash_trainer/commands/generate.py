"""`dflash-trainer generate`: regenerate assistant responses for generate.prompts with the target
into generate.out (JSONL, appended, resumable), with the [generate] section's settings."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash_trainer.config import Config, shard_of
from dflash_trainer.data.chat import Rendering
from dflash_trainer.data.generate import generate_with, in_shard, load_prompts, print_summary
from dflash_trainer.data.synthesize import SOURCE as SYNTH
from dflash_trainer.data.synthesize import prompts_path, synthesized_prompts
from dflash_trainer.layout import RunLayout
from dflash_trainer.models.target import TargetModel

log = logging.getLogger(__name__)


def run(cfg: Config, args) -> int:
    g = cfg.generate
    Rendering.from_config(cfg)  # a bad data.chat_template stops before the load
    # synth: the target writes the prompts (data/synthesize.py), after its load
    synth = g.prompts == SYNTH
    if cfg.synth.prompts and not synth:  # how synthesis was asked for before it had a name
        log.warning(
            "generate: synth.prompts=%d is not used here (the prompts are %s); "
            "--generate.prompts=synth answers prompts the target writes itself",
            cfg.synth.prompts,
            g.prompts,
        )
    prompts = [] if synth else load_prompts(g.prompts, cfg)
    out = Path(g.out) if g.out else RunLayout.of(cfg.run_dir).generated
    if cfg.pipeline.cpu_threads > 0:
        torch.set_num_threads(cfg.pipeline.cpu_threads)
    target = TargetModel.load(cfg.target, cfg.pipeline.target_devices[0])
    if synth:
        prompts = synthesized_prompts(cfg, target, prompts_path(out), g.engine)
    if g.limit > 0:
        prompts = prompts[: g.limit]
    shard, shards = shard_of(g.shard)
    if shards > 1:
        prompts = [p for p in prompts if in_shard(p.id, shard, shards)]
        log.info("generate: shard %d of %d: %d prompts", shard, shards, len(prompts))
    print_summary(generate_with(cfg, target, prompts, out))
    return 0
