"""CPU inference: linear layers through oneDNN's prepacked GEMM while decoding.

PyTorch's default CPU fp32 linear (MKL sgemm) repacks the weight on every call. For the few rows a
decode step has, that pass over the weights is the cost: on a 2-core AVX2 EPYC a SmolLM2-135M
verify pass of 16 positions took 134-150 ms against 62-77 ms for one position, and with weights
packed once it takes 102-105 ms (4 positions: 118-137 -> 68-77 ms; 1 position: unchanged). A
draft-verify cycle is one such pass, so this is where CPU speculative decoding gains or loses.
Not for training-sized inputs: at 512-2400 rows MKL's own path was 5-16% faster on one thread
(the repacking is amortised there), so the target's training forward keeps the default kernel.

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
from contextlib import contextmanager
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


@functools.cache
def available() -> bool:
    """oneDNN's prepacked linear ops exist and work in this torch build."""
    try:
        w = torch.randn(8, 4)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        x = torch.randn(3, 4)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y, F.linear(x, w), atol=1e-5, rtol=1e-5))
    except Exception as e:  # no oneDNN (some builds, non-x86 without it)
        log.debug("oneDNN packed linear unavailable: %s", e)
        return False


def _packed_forward(module: nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w = module.weight
    if (torch.is_grad_enabled() and w.requires_grad) or x.dtype != torch.float32:
        return F.linear(x, w, module.bias)
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(rows, packed, module.bias, "none", [], "")
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
