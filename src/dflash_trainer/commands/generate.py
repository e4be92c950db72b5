"""`dflash-trainer generate`: regenerate assistant responses for --prompts with the target into
--output (JSONL, appended, resumable)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash_trainer.config import Config
from dflash_trainer.data.chat import Rendering
from dflash_trainer.data.generate import generate_responses, load_prompts, print_summary
from dflash_trainer.errors import UserError
from dflash_trainer.models.precision import dtype_name
from dflash_trainer.models.target import TargetModel
from dflash_trainer.models.vllm_engine import (
    VLLMEngine,
    engine_target,
    find_vllm_python,
    vllm_unavailable,
)

log = logging.getLogger(__name__)


def run(cfg: Config, args) -> int:
    rendering = Rendering.from_config(cfg)  # a bad data.chat_template stops before the load
    prompts = load_prompts(args.prompts, cfg)
    if args.limit and args.limit > 0:
        prompts = prompts[: args.limit]
    out = Path(args.output) if args.output else Path(cfg.run_dir) / "generated.jsonl"
    if cfg.pipeline.cpu_threads > 0:
        torch.set_num_threads(cfg.pipeline.cpu_threads)
    target = TargetModel.load(cfg.target, cfg.pipeline.target_devices[0])
    engine, vllm = _engine(cfg, getattr(args, "engine", "hf"), target)
    stats = generate_responses(
        target,
        prompts,
        out,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        top_p=args.top_p,
        rendering=rendering,
        seed=cfg.pipeline.seed,
        progress=cfg.metrics.console,
        engine=engine,
        vllm=vllm,
    )
    print_summary(stats)
    return 0


def _engine(cfg: Config, choice: str, target) -> tuple[str, VLLMEngine | None]:
    """("hf" | "vllm", the vLLM engine). auto = vLLM where it is installed (faster on the embedded
    data set, docs/serving.md of this repo's docs), else the project's loop."""
    if choice == "hf":
        return "hf", None
    python = find_vllm_python(cfg.eval.vllm_python)
    why = vllm_unavailable(python)
    if why:
        if choice == "vllm":
            raise UserError(f"generate --engine vllm: {why}")
        log.info("generate: vLLM not available (%s); the project's decode loop", why)
        return "hf", None
    dtype = dtype_name(cfg.target.dtype, cfg.pipeline.target_devices[0])
    threads = cfg.pipeline.cpu_threads if cfg.pipeline.cpu_threads > 0 else 0
    revision = None if str(cfg.target.model).startswith("embedded:") else cfg.target.revision
    eng = VLLMEngine(python, engine_target(cfg.target), dtype, revision or None, threads=threads)
    log.info("generate: vLLM (%s) serving %s in %s", python, eng.target, dtype)
    return "vllm", eng
