"""The dtype evaluation decodes in (`eval.dtype`), separate from the training precision.

auto = float32 on CPU, the target's own dtype on GPU. On CPU fp32 decoding is exact (the batched
verify pass and one-token steps round alike, so spec decoding reproduces plain greedy token for
token) and, on CPUs without native bf16, also faster. Where it differs from the dtype a model
trains in, evaluation works on cast copies: the training drafter is never changed in place.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from dflash_trainer.models.target import TargetModel
from dflash_trainer.precision import DTYPES, module_dtype


def eval_dtype(name: str, device: str | torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """`eval.dtype` resolved: auto = float32 on CPU, `model_dtype` elsewhere."""
    if name != "auto":
        return DTYPES[name]
    return torch.float32 if torch.device(device).type == "cpu" else model_dtype


def target_in(target: TargetModel, dtype: torch.dtype) -> TargetModel:
    """`target` computing in `dtype` (TargetModel.cast: itself, or a cast copy)."""
    return target.cast(dtype)


def drafter_in(drafter: Any, dtype: torch.dtype) -> Any:
    """The drafter (DDP wrapper removed) when its weights are in `dtype`, else a cast copy: the
    training drafter is never cast in place."""
    drafter = getattr(drafter, "module", drafter)
    if drafter is None or module_dtype(drafter) == dtype:
        return drafter
    out = copy.deepcopy(drafter).to(dtype)
    out.requires_grad_(False)
    return out
