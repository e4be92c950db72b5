"""Which dtype a device computes fastest in: what `auto` means for target.dtype and
pipeline.precision.

bf16 pays only where the hardware has bf16 matmuls: CUDA GPUs, and CPUs with AVX512-BF16 or AMX
(oneDNN reports them). Elsewhere, e.g. an AVX2-only AMD EPYC, bf16 is emulated: measured there,
a SmolLM2-135M forward ran about 10x slower in bf16 than in fp32 (bench/RESULTS.md). So auto
picks bf16 on those devices and float32 on the others.
"""

from __future__ import annotations

import functools

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX, as oneDNN sees it (False when torch was built without it)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def native_bf16(device: str | torch.device) -> bool:
    dev = torch.device(device)
    if dev.type == "cuda":
        return True
    return dev.type == "cpu" and cpu_has_native_bf16()


def dtype_name(name: str, device: str | torch.device) -> str:
    """The dtype `name` stands for on `device` ('auto' resolved)."""
    if name != "auto":
        return name
    return "bfloat16" if native_bf16(device) else "float32"


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    return DTYPES[dtype_name(name, device)]


def use_autocast(precision: str, device: str | torch.device) -> bool:
    """pipeline.precision: bf16 autocast for the drafter? auto = where bf16 is native."""
    return precision == "bf16" or (precision == "auto" and native_bf16(device))
