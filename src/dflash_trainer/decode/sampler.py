"""The one sampler of every decode path: greedy, or a temperature / top-p sample keyed by position.

The target's token at absolute position t is argmax(logits / T + g), top-p support only, where g
is Gumbel noise that is a pure function of (seed, t, token id) (`position_noise`). Sampling is then
a function of the logits at t alone: a speculative run and a plain run with one seed emit the same
tokens (losslessness is tested exactly, not statistically), and a row of a batch samples what it
would sample alone. Keys are hashed on the device, so a batched step needs no host round trip.
"""

from __future__ import annotations

import torch

from dflash_trainer.config import SamplingConfig

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in int64 without overflow (signed overflow is UB)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """ "lowbias32" integer finaliser (full avalanche); public-domain constants by C. Wellons."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash32_int(x: int) -> int:
    """`hash32` on a Python int (seeds derived on the host)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def position_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [*positions.shape, vocab], a pure function of (seed, position, token id).
    `seeds` broadcasts against `positions` (one seed per row, or one for all)."""
    pos = positions.to(torch.int64)
    k1 = hash32((seeds.to(pos.device) & _M32) ^ hash32((2 * pos + 1) & _M32))[..., None]
    k2 = hash32(k1 ^ 0x9E3779B9)
    v = torch.arange(vocab, dtype=torch.int64, device=pos.device)
    x = hash32(v ^ k1)
    x = hash32((x + k2) & _M32)
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    return -torch.log(-torch.log(u))


def top_k_logits(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """-inf outside the `top_k` most likely tokens (0 = keep all); ties at the k-th value kept."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_logits(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """-inf outside the smallest prefix of tokens (by probability) whose mass reaches top_p."""
    if top_p >= 1.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p  # the top token is always kept
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))


def sampled_logits(sampling: SamplingConfig, logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> the logits a temperature > 0 sample is drawn from, in float32: divided
    by the temperature, -inf outside the top-k, then outside the top-p tokens. Their softmax is
    the target's sampled distribution (what an engine's rejection rule accepts drafts by)."""
    scaled = top_k_logits(logits.float() / sampling.temperature, sampling.top_k)
    return top_p_logits(scaled, sampling.top_p)


def choose(
    sampling: SamplingConfig | None,
    logits: torch.Tensor,
    positions: torch.Tensor,
    seeds: torch.Tensor | int = 0,
) -> torch.Tensor:
    """The token at each position: logits [..., V] -> [...], greedy where `sampling` is None or
    greedy. `positions` [...] are the absolute positions of the tokens being chosen; `seeds` one
    per row or one for all."""
    if sampling is None or sampling.greedy:
        return logits.argmax(-1)
    scaled = sampled_logits(sampling, logits)
    seeds = torch.as_tensor(seeds, dtype=torch.int64, device=logits.device)
    noise = position_noise(seeds, positions.to(logits.device), logits.shape[-1])
    return (scaled + noise).argmax(-1)  # Gumbel-max: an exact sample from softmax(scaled)
