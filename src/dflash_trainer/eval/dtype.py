"""The dtype evaluation decodes in (`eval.dtype`), separate from the training precision.

auto = float32 on CPU, the target's own dtype on GPU. On CPU fp32 decoding is exact (the batched
verify pass and one-token steps round alike, so spec decoding reproduces plain greedy token for
token) and, on CPUs without native bf16, also faster. Where it differs from the dtype a model
trains in, evaluation works on cast copies: the training drafter is never changed in place.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dflash_trainer.models.precision import DTYPES


def eval_dtype(name: str, device: str | torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """`eval.dtype` resolved: auto = float32 on CPU, `model_dtype` elsewhere."""
    if name != "auto":
        return DTYPES[name]
    return torch.float32 if torch.device(device).type == "cpu" else model_dtype


def dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class EvalTarget:
    """The target pieces evaluation uses (the TargetModel surface of eval/specdecode.py), here
    on a cast copy of the target's model."""

    model: nn.Module
    layer_ids: list[int]
    embed_weight: torch.Tensor
    lm_head: nn.Module
    eos_token_ids: list[int] = field(default_factory=list)
    tokenizer: Any = None
    name: str = ""

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device


def model_dtype(module: Any) -> torch.dtype:
    p = next(iter(module.parameters()), None) if isinstance(module, nn.Module) else None
    return p.dtype if p is not None else torch.float32


def target_in(target: Any, dtype: torch.dtype) -> Any:
    """`target` itself when it already computes in `dtype`, else a cast copy (EvalTarget)."""
    if model_dtype(target.model) == dtype:
        return target
    model = copy.deepcopy(target.model).to(dtype).eval()
    model.requires_grad_(False)
    return EvalTarget(
        model=model,
        layer_ids=list(target.layer_ids),
        embed_weight=model.get_input_embeddings().weight,
        lm_head=model.get_output_embeddings(),
        eos_token_ids=list(getattr(target, "eos_token_ids", []) or []),
        tokenizer=getattr(target, "tokenizer", None),
        name=getattr(target, "name", ""),
    )


def drafter_in(drafter: Any, dtype: torch.dtype) -> Any:
    """The drafter (DDP wrapper removed) when its weights are in `dtype`, else a cast copy: the
    training drafter is never cast in place."""
    drafter = getattr(drafter, "module", drafter)
    if drafter is None or model_dtype(drafter) == dtype:
        return drafter
    out = copy.deepcopy(drafter).to(dtype)
    out.requires_grad_(False)
    return out
