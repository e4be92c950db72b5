"""One prompt of a bare Hugging Face model through the product's decode loop (decode/loop.py
`decode` on a TargetModel), in the shape the decoding tests compare: speculative with a drafter,
or plain greedy/sampled (block 1)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dflash_trainer.config import SamplingConfig
from dflash_trainer.decode.loop import GenResult, decode
from dflash_trainer.models.target import TargetModel


def draw_seed(generator: torch.Generator | None) -> int:
    """The sampling seed a generator gives (temperature > 0), as evaluation derives it."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


def spec_generate(
    model: Any,
    layer_ids: Sequence[int],
    embed_weight: torch.Tensor,
    lm_head: Any,
    drafter: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    verify: str = "full",
) -> GenResult:
    """`decode` on one prompt [1, P] of `model`; `embed_weight` / `lm_head` are what the drafter
    embeds and proposes with."""
    target = TargetModel.from_hf(model, None, list(layer_ids) or [0])
    target.embed_weight, target.lm_head = embed_weight, lm_head
    seed = draw_seed(generator) if temperature > 0 else 0
    try:
        return decode(
            target,
            input_ids.tolist(),
            max_new_tokens,
            SamplingConfig(temperature=temperature, top_p=top_p),
            seeds=[seed],
            stop_ids=stop_ids,
            drafter=drafter,
            block_size=block_size,
            verify=verify,
        )[0]
    finally:
        target.close()


def ar_generate(
    model: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> GenResult:
    """Plain decoding of one prompt: block 1, no drafter."""
    return spec_generate(
        model,
        [],
        model.get_input_embeddings().weight,
        model.get_output_embeddings(),
        None,
        input_ids,
        max_new_tokens,
        1,
        temperature,
        top_p,
        stop_ids,
        generator,
    )
