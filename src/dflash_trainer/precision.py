"""Which dtype a device computes fastest in: what `auto` means for target.dtype and
pipeline.precision.

bf16 pays only where the hardware has bf16 matmuls: CUDA GPUs, and CPUs with AVX512-BF16 or AMX
(oneDNN reports them). Elsewhere, e.g. an AVX2-only AMD EPYC, bf16 is emulated: measured there,
a SmolLM2-135M forward ran about 10x slower in bf16 than in fp32 (bench/LOG.md). So auto
picks bf16 on those devices and float32 on the others.
"""

from __future__ import annotations

import copy
import functools
import os
import platform
from pathlib import Path
from typing import Any

import torch

# The one map of dtype names (config values, export config.json) to torch dtypes, its inverse,
# and the short forms messages use.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_label(dtype: torch.dtype) -> str:
    """A torch dtype as results and provenance name it: 'bfloat16', 'float32'."""
    return str(dtype).removeprefix("torch.")


# The one seam over the hardware probe: "1" or "0" answers for the CPU (tests run each
# dtype-dependent case under both answers; a user can force either). Unset: ask oneDNN.
NATIVE_BF16_ENV = "DFLASH_TRAINER_CPU_NATIVE_BF16"


# The CPU flags of bf16 matmul instructions. oneDNN's own answer is not enough: it says yes on any
# AVX512 core (Skylake, Cascade Lake), where it emulates bf16, several times slower than fp32.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def native_bf16_from(onednn_bf16: bool, flags: set[str]) -> bool:
    """oneDNN's bf16 support and the CPU's flags -> bf16 matmuls in hardware? Where the flags are
    unknown (not Linux), oneDNN's answer stands."""
    if not onednn_bf16:
        return False
    return not flags or any(f in flags for f in BF16_FLAGS)


@functools.cache
def _probe_cpu_bf16() -> bool:
    """AVX512-BF16 or AMX: oneDNN has bf16 kernels and the CPU has the instructions (False
    when torch was built without oneDNN)."""
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
    return native_bf16_from(onednn, _cpuinfo()[1])


def cpu_has_native_bf16() -> bool:
    """Does this CPU compute bf16 matmuls natively? `DFLASH_TRAINER_CPU_NATIVE_BF16=0|1`
    overrides the probe."""
    forced = os.environ.get(NATIVE_BF16_ENV, "")
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"{NATIVE_BF16_ENV}={forced!r}: set it to 0 or 1, or unset it")
    return _probe_cpu_bf16()


def _cpuinfo() -> tuple[str, set[str]]:
    """The CPU's model name and feature flags from /proc/cpuinfo (Linux; empty elsewhere)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
            if flags and name:
                break
    except OSError:
        pass
    return name, flags


# The switch that runs this machine as an AVX2-only CPU (`make ... CPU_KIND=avx2`, Makefile):
# torch's kernels, oneDNN and MKL each capped at AVX2, and the bf16 probe answering no. Under it a
# bf16-native machine computes what an AVX2 EPYC computes (fp32 chosen, bf16 emulated), so every
# figure can be measured for both kinds on one machine.
SIMULATED_AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    NATIVE_BF16_ENV: "0",
}


def simulated_avx2() -> bool:
    """Is this process capped to AVX2 by the simulation switch (all four settings as above)?"""
    return all(os.environ.get(k, "").lower() == v.lower() for k, v in SIMULATED_AVX2_ENV.items())


def _widest_isa(flags: set[str]) -> str:
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    if "avx512f" in flags:
        return "AVX512"
    if "avx2" in flags:
        return "AVX2"
    return platform.machine()


def simulated_on() -> str:
    """The wider ISA this CPU has when the AVX2 switch caps it (e.g. 'AVX512-BF16'); '' when the
    switch is off or the CPU is no wider than AVX2 (then nothing is simulated)."""
    isa = _widest_isa(_cpuinfo()[1])
    return isa if simulated_avx2() and isa != "AVX2" else ""


def cpu_kind() -> str:
    """The CPU as results should name it: model, the widest matmul ISA it computes with, and what
    `auto` picks on it (e.g. 'Intel Xeon (AMX; auto = bfloat16)'); a simulated kind says so
    ('AMD EPYC (AVX2, simulated on AVX512-BF16; auto = float32)'). Benchmark ratios and demo
    times depend on all three."""
    name, flags = _cpuinfo()
    auto = dtype_name("auto", "cpu")
    wider = simulated_on()
    if wider:
        return f"{name} (AVX2, simulated on {wider}; auto = {auto})"
    forced = f", forced by {NATIVE_BF16_ENV}" if os.environ.get(NATIVE_BF16_ENV) else ""
    return f"{name} ({_widest_isa(flags)}; auto = {auto}{forced})"


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
    return precision == "bfloat16" or (precision == "auto" and native_bf16(device))


def eval_dtype(name: str, device: str | torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """`eval.dtype` resolved: auto = float32 on CPU (exact: the batched verify pass and one-token
    steps round alike, so speculative decoding reproduces plain greedy token for token; and on
    CPUs without native bf16 also faster), `model_dtype` elsewhere."""
    if name != "auto":
        return DTYPES[name]
    return torch.float32 if torch.device(device).type == "cpu" else model_dtype


def frozen_in(module: Any, dtype: torch.dtype) -> Any:
    """`module` (a DDP wrapper removed) where its weights are in `dtype`, else a cast copy
    without gradients: what evaluation decodes with; the training drafter is never cast in
    place."""
    module = getattr(module, "module", module)
    if module is None or module_dtype(module) == dtype:
        return module
    out = copy.deepcopy(module).to(dtype)
    out.requires_grad_(False)
    return out


def module_dtype(module: object, default: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype of a module's first parameter (`default` for a parameterless module or a
    callable that is not a module)."""
    p = next(iter(module.parameters()), None) if isinstance(module, torch.nn.Module) else None
    return p.dtype if p is not None else default
