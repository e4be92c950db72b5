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
    choice = getattr(args, "engine", "hf")
    engine, vllm = _engine(cfg, choice, len(prompts) * args.max_new_tokens)
    how = dict(
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        top_p=args.top_p,
        rendering=rendering,
        seed=cfg.pipeline.seed,
        progress=cfg.metrics.console,
    )
    try:
        stats = generate_responses(target, prompts, out, engine=engine, vllm=vllm, **how)
    except UserError as e:
        if choice != "auto" or engine != "vllm":
            raise
        # auto: a target vLLM cannot serve falls back to the project's loop (vLLM wrote nothing)
        log.warning("generate: vLLM failed, using the project's decode loop instead: %s", e)
        stats = generate_responses(target, prompts, out, **how)
    print_summary(stats)
    return 0


# `--engine auto` picks vLLM where it is installed and the job is large enough to pay for its
# engine start (~20-55 s on 2 cores). Measured on the embedded data set (244 prompts x 192
# tokens, bf16, 2 busy cores): vLLM's CPU build 222.7 tokens/s including the start, the project's
# batched loop (batch 64) 35.9 tokens/s; on 6 prompts x 24 tokens the loop won (6.1 vs 2.7).
# Break-even near 1,200 generated tokens: below this budget (prompts x max_new_tokens) auto
# stays with the loop. In float32 the two ran alike (64 prompts: vLLM 28.5, the loop 30.4
# tokens/s, identical answers), so auto keeps the loop there.
AUTO_VLLM_MIN_BUDGET = 2048


def _engine(cfg: Config, choice: str, budget: int) -> tuple[str, VLLMEngine | None]:
    """("hf" | "vllm", the vLLM engine). auto = vLLM where it is installed, the target is not
    decoded in float32 and `budget` (prompts x max_new_tokens) >= AUTO_VLLM_MIN_BUDGET, else the
    project's loop."""
    dtype = dtype_name(cfg.target.dtype, cfg.pipeline.target_devices[0])
    if choice == "hf" or (
        choice == "auto" and (budget < AUTO_VLLM_MIN_BUDGET or dtype == "float32")
    ):
        return "hf", None
    python = find_vllm_python(cfg.eval.vllm_python)
    why = vllm_unavailable(python)
    if why:
        if choice == "vllm":
            raise UserError(f"generate --engine vllm: {why}")
        log.info("generate: vLLM not available (%s); the project's decode loop", why)
        return "hf", None
    threads = cfg.pipeline.cpu_threads if cfg.pipeline.cpu_threads > 0 else 0
    revision = None if str(cfg.target.model).startswith("embedded:") else cfg.target.revision
    eng = VLLMEngine(python, engine_target(cfg.target), dtype, revision or None, threads=threads)
    log.info("generate: vLLM (%s) serving %s in %s", python, eng.target, dtype)
    return "vllm", eng
