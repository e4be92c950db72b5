"""Speculative decoding of one prompt of a bare HF model: `spec_generate` / `ar_generate`.

The loop itself is decode/loop.py (one loop for greedy, sampled and speculative decoding); these
are its one-prompt form, kept for the callers written against them (evaluation over prompts:
eval/evaluation.py). Per-cycle host syncs are inherent in speculative decoding (the accepted
length decides control flow); this module is eval-only and never runs inside a training step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dflash_trainer.decode.draft import Drafter
from dflash_trainer.decode.loop import GenResult, decode
from dflash_trainer.decode.sampler import Sampler
from dflash_trainer.models.target import TargetModel

__all__ = ["Drafter", "GenResult", "ar_generate", "spec_generate"]


def _draw_seed(generator: torch.Generator | None) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


def spec_generate(
    target_model: nn.Module,
    layer_ids: Sequence[int],
    embed_weight: torch.Tensor,
    lm_head: nn.Module,
    drafter: Drafter | None,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    verify: str = "full",
) -> GenResult:
    """decode/loop.decode on one prompt input_ids [1, P] of a bare HF model: draft-verify cycles
    of block_size (1: plain autoregressive decoding, drafter may be None). `embed_weight` and
    `lm_head` are what the drafter embeds and proposes with. `generator` draws the sampling seed
    (temperature > 0 only); equal generator states give equal samples for spec and AR runs."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [1, P] with P >= 1, got {tuple(input_ids.shape)}")
    sampler = Sampler(temperature, top_p)
    seed = _draw_seed(generator) if temperature > 0 else 0
    # AR decoding taps nothing; the TargetModel still needs one valid tap layer
    target = TargetModel.from_hf(target_model, None, list(layer_ids) or [0])
    target.embed_weight, target.lm_head = embed_weight, lm_head
    try:
        return decode(
            target,
            input_ids.tolist(),
            max_new_tokens,
            sampler,
            seeds=[seed],
            stop_ids=stop_ids,
            drafter=drafter,
            block_size=block_size,
            verify=verify,
        )[0]
    finally:
        target.close()  # its hooks off the caller's model


def ar_generate(
    target_model: Any,  # a Hugging Face causal LM (its input and output embeddings)
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> GenResult:
    """Plain autoregressive decoding: `spec_generate` with block_size=1 and no drafter."""
    return spec_generate(
        target_model,
        [],
        target_model.get_input_embeddings().weight,
        target_model.get_output_embeddings(),
        None,
        input_ids,
        max_new_tokens,
        1,
        temperature,
        top_p,
        stop_ids,
        generator,
    )
