"""CPU inference: linear layers through oneDNN's prepacked GEMM while decoding.

PyTorch's default CPU fp32 linear (MKL sgemm) repacks the weight on every call. For the few rows a
decode step has, that pass over the weights is the cost: on a 2-core AVX2 EPYC a SmolLM2-135M
verify pass of 16 positions took 134-150 ms against 62-77 ms for one position, and with weights
packed once it takes 102-105 ms (4 positions: 118-137 -> 68-77 ms; 1 position: unchanged). A
draft-verify cycle is one such pass, so this is where CPU speculative decoding gains or loses.
Not for training-sized inputs: at 512-2400 rows MKL's own path was 5-16% faster on one thread
(the repacking is amortised there), so the target's training forward keeps the default kernel.
The exception is the target's LM head inside the drafter's loss (`FrozenMatmuls`): 49,152 x 576,
frozen, a few hundred rows a chunk, both products packed once: the demo's fp32 drafter step
961 ms against 1,130 on the default kernel (1.18x) on a 2-core AVX2 EPYC (Zen 3).

Batched answer generation (`generate`, prompt synthesis) uses it too, since the loop prefills one
prompt at a time and then steps up to 64 rows: the demo's 244 answers (batch 64, <= 192 tokens,
fp32, AVX2 simulated on a Zen 4 EPYC) ran at 222.7 tok/s packed against 182.3 with the default
kernel (1.22x, packing included, identical answers; bench/LOG.md). One thread at batch 64: the
LM head 1.71x, the k/v projections 2.6x, the others 1.16-1.25x; one row: the LM head 1.41x.
tau_sim's replay (eval/tau_sim.py) runs inside it as well, so its drafts are measured
decoding's: the demo's 18-prompt replay took 40 s instead of 75-87 s on a real AVX2 EPYC.

`packed_linears(*modules)` packs the weights of every float32 CPU `nn.Linear` inside the given
modules once on entry (a second copy of those weights while inside) and routes their forwards
through `torch.ops.mkldnn._linear_pointwise`; on exit every module is as it was. Training paths
never enter it: a layer whose weight needs a gradient falls back to the default kernel whenever
grad mode is on. A module whose `forward` was already replaced per instance (accelerate's hooks,
an enclosing `packed_linears`) is left alone. Where oneDNN is unavailable nothing changes.

Numerics: another fp32 GEMM, so logits differ from the default kernel's in the last bits; greedy
tokens can differ only at near-ties, as between any two fp32 kernels (eval reports such gaps:
`tie_gaps`). `target.packed_linear=false` restores PyTorch's default kernels.
"""

from __future__ import annotations

import functools
import logging
import threading
from contextlib import contextmanager
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

log = logging.getLogger(__name__)


@functools.cache
def available() -> bool:
    """oneDNN's prepacked linear ops exist and work in this torch build."""
    try:
        w = torch.randn(8, 4)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        x = torch.randn(3, 4)
        y = _gemm(x, packed)
        return bool(torch.allclose(y, F.linear(x, w), atol=1e-5, rtol=1e-5))
    except Exception as e:  # no oneDNN (some builds, non-x86 without it)
        log.debug("oneDNN packed linear unavailable: %s", e)
        return False


def _gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None):
    """x [rows, in] through a weight packed by `_reorder_linear_weight` (+ bias)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed_forward(module: nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w = module.weight
    if (torch.is_grad_enabled() and w.requires_grad) or x.dtype != torch.float32:
        return F.linear(x, w, module.bias)
    rows = x.reshape(-1, x.shape[-1])
    y = _gemm(rows, packed, module.bias)
    return y.view(*x.shape[:-1], y.shape[-1])


def _eligible(m: nn.Module) -> TypeGuard[nn.Linear]:
    w = getattr(m, "weight", None)
    return (
        isinstance(m, nn.Linear)
        and "forward" not in m.__dict__
        and w is not None
        and w.device.type == "cpu"
        and w.dtype == torch.float32
    )


@contextmanager
def packed_linears(*modules: nn.Module | None, enabled: bool = True):
    """Inside: the float32 CPU nn.Linear layers of `modules` run oneDNN's prepacked GEMM."""
    patched: list[nn.Linear] = []
    try:
        if enabled and available():
            seen: set[int] = set()
            for root in modules:
                if not isinstance(root, nn.Module):
                    continue
                for m in root.modules():
                    if id(m) in seen or not _eligible(m):
                        continue
                    seen.add(id(m))
                    with torch.no_grad():
                        packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), None)
                    m.forward = functools.partial(_packed_forward, m, packed)  # type: ignore[method-assign]
                    patched.append(m)
        yield len(patched)
    finally:
        for m in patched:
            del m.forward


class FrozenMatmuls:
    """The two products training takes through a frozen float32 CPU weight W [out, in] (the
    target's LM head inside the drafter's loss): `linear(x)` = x W^T and `back(g)` = g W, the
    gradient to x. Both run oneDNN's prepacked GEMM on copies packed once per weight (and
    again if it is changed in place): unlike the drafter's own layers, this weight does not
    change between steps, so packing it is paid once, and at a training step's few hundred
    rows the packed GEMM beats the default one (bench/LOG.md). Elsewhere (another dtype or
    device, autocast, no oneDNN) the default kernels, with the same results to fp32 rounding."""

    MAX_BYTES = 1 << 29  # two packed copies of a larger head cost more memory than they save

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._fwd: torch.Tensor | None = None
        self._bwd: torch.Tensor | None = None

    @classmethod
    def packs(cls, dtype: torch.dtype, device: torch.device, nbytes: int, autocast: bool) -> bool:
        """Are a weight's products packed (a float32 CPU weight of at most MAX_BYTES, outside
        autocast, where oneDNN is available)?"""
        return (
            dtype == torch.float32
            and device.type == "cpu"
            and not autocast
            and nbytes <= cls.MAX_BYTES
            and available()
        )

    @classmethod
    def copies_bytes(
        cls, shape: tuple[int, int], dtype: torch.dtype, device: torch.device, autocast: bool
    ) -> int:
        """The memory the two packed copies of a weight of `shape` hold while training runs
        (0 where its products keep the default kernels): what run/memory_plan.py counts beside
        the frozen head itself."""
        nbytes = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
        return 2 * nbytes if cls.packs(dtype, device, nbytes, autocast) else 0

    def _packed(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if (
            x.dtype != torch.float32
            or is_fake(x)  # traced (run/memory_plan.py): oneDNN's ops have no fake kernel
            or is_fake(w)
            or not self.packs(
                w.dtype, w.device, w.numel() * w.element_size(), torch.is_autocast_enabled("cpu")
            )
        ):
            return None
        key = (w.data_ptr(), w._version, tuple(w.shape))
        with self._lock:
            if key != self._key or self._fwd is None or self._bwd is None:
                with torch.no_grad():
                    w = w.detach()
                    self._fwd = torch.ops.mkldnn._reorder_linear_weight(w, None)
                    self._bwd = torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), None)
                self._key = key
            return self._fwd, self._bwd

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> x W^T [rows, out]."""
        packed = self._packed(x, w)
        if packed is None:
            return F.linear(x, w)
        return _gemm(x, packed[0])

    def back(self, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """g [rows, out] -> g W [rows, in]."""
        packed = self._packed(g, w)
        if packed is None:
            return torch.matmul(g, w)
        return _gemm(g, packed[1])
