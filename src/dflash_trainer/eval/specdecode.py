"""Speculative decoding with a DFlash drafter: the draft-verify loop and its AR baseline.
(Evaluation over prompts, which runs them: eval/evaluation.py.)

One cycle (batch 1, method doc §3):
  block = [last committed token, MASK, ..., MASK] at positions start..start+Q-1
  drafter: ONE forward_infer over the block, given the context features the drafter has not seen
           yet; drafts = argmax(lm_head(hidden[:, 1:]))   (drafts are always greedy)
  target:  ONE forward over the block (KV cache), tapping the drafter's layers
  accept:  a = longest prefix with draft[i] == posterior[i-1]; commit posterior[0..a]
           (= the a accepted drafts + the bonus token posterior[a])
  then crop the target cache to the committed length; the taps of the a+1 verified committed
  positions become the drafter's next new context.

The plain autoregressive baseline is the same loop with Q=1 and no drafter, so the speedup compares
like with like. Sampling (temperature > 0) uses the exact-match rule: a draft is accepted only if it
equals the target's own sample at that position, so every emitted token is a target sample.
The target's sample at absolute position t uses Gumbel noise keyed by (seed, t, token) (see
`_position_noise`): sampling is then a pure function of the logits at t, which makes a spec run
and an AR run with the same seed emit the same tokens: losslessness is tested exactly, not
statistically.

Per-cycle host syncs (`.tolist()`) are inherent here: the accepted length decides control flow. This
module is eval-only; it never runs inside a training step: periodic evaluation
(run/evaluation.py) calls eval/evaluation.py `evaluate` between steps.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trainer.models.kv_cache import cache_kwarg, new_kv_cache
from dflash_trainer.models.target import tap_outputs

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Interfaces the loop is written against (DFlashDrafter and TargetModel satisfy them)
# --------------------------------------------------------------------------------------------


class Drafter(Protocol):
    """What the loop needs from a drafter (models/drafter.py: DFlashDrafter)."""

    config: Any  # .block_size, .mask_token_id, .target_layer_ids

    def new_cache(self) -> Any: ...  # object with .length (context positions cached)

    def forward_infer(
        self, block_embeds: torch.Tensor, new_features: torch.Tensor, cache: Any, start: int
    ) -> torch.Tensor: ...


@dataclass
class TargetSide:
    """The target pieces the loop uses. `TargetModel` (models/target.py) has the same attributes."""

    model: nn.Module  # HF causal LM
    layer_ids: list[int]  # 0-based decoder layers whose outputs are the features
    embed_weight: torch.Tensor  # [V, H]
    lm_head: nn.Module  # hidden -> logits
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, model: nn.Module, layer_ids: Sequence[int]) -> TargetSide:
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model,
            list(layer_ids),
            model.get_input_embeddings().weight,
            model.get_output_embeddings(),
            eos,
        )


# --------------------------------------------------------------------------------------------
# Result of one generation
# --------------------------------------------------------------------------------------------


@dataclass
class GenResult:
    tokens: list[int]  # new tokens only (the prefill token included), stop id kept
    acceptance_lengths: list[int]  # per cycle: committed (accepted drafts + bonus), clipped
    accepted_drafts: list[int]  # per cycle: a, the accepted draft count before any clipping
    block_sizes: list[int]  # per cycle: Q, tokens verified (slot 0 + Q-1 drafts)
    prefill_time: float = 0.0  # seconds
    draft_time: float = 0.0  # seconds, drafter passes + draft argmax
    verify_time: float = 0.0  # seconds, target passes + acceptance
    decode_time: float = 0.0  # seconds, wall time after prefill
    stopped: bool = False  # ended on a stop id (else on the token limit)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tau(self) -> float:
        """Mean tokens per cycle, bonus included (1.0 when no cycle ran)."""
        n = len(self.acceptance_lengths)
        return sum(self.acceptance_lengths) / n if n else 1.0

    @property
    def tpot(self) -> float:
        """Decode seconds per output token (prefill excluded; same convention as the reference)."""
        return self.decode_time / max(1, self.num_tokens)


# --------------------------------------------------------------------------------------------
# Position-keyed sampling
# --------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in int64 without overflow (signed overflow is UB)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # "lowbias32" integer finaliser (full avalanche); public-domain constants by C. Wellons.
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _hash32_int(x: int) -> int:
    """`_hash32` on a Python int (per-position keys; no tensor round trip)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _position_noise(
    seed: int, positions: Sequence[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """Gumbel noise [len(positions), vocab], a pure function of (seed, position, token id)."""
    keys = []
    for p in positions:
        k1 = _hash32_int(seed ^ _hash32_int(2 * p + 1))
        keys.append((k1, _hash32_int(k1 ^ 0x9E3779B9)))
    key = torch.tensor(keys, dtype=torch.int64, device=device)  # [Q, 2]
    v = torch.arange(vocab, dtype=torch.int64, device=device)
    x = _hash32(v[None] ^ key[:, :1])
    x = _hash32((x + key[:, 1:]) & _M32)
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    return -torch.log(-torch.log(u))


def _top_p_logits(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """-inf outside the smallest prefix of tokens (by probability) whose mass reaches top_p."""
    if top_p >= 1.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p  # the top token is always kept
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))


def choose_tokens(
    logits: torch.Tensor, positions: Sequence[int], temperature: float, top_p: float, seed: int
) -> torch.Tensor:
    """The target's token per position: argmax (T=0) or a position-keyed sample. logits [Q, V]."""
    if temperature <= 0:
        return logits.argmax(-1)
    scaled = _top_p_logits(logits.float() / temperature, top_p)
    noise = _position_noise(seed, positions, logits.shape[-1], logits.device)
    return (scaled + noise).argmax(-1)  # Gumbel-max: an exact sample from softmax(scaled)


# --------------------------------------------------------------------------------------------
# Target forward with taps
# --------------------------------------------------------------------------------------------


def decode_features(model: nn.Module, layer_ids: Sequence[int], ids: torch.Tensor):
    """[B, S, n*H]: the tapped layer outputs as the decode loop captures them (tap_outputs)."""
    with torch.no_grad(), tap_outputs(model, layer_ids) as caps:
        model(input_ids=ids, use_cache=False)
    return torch.cat([caps[i] for i in layer_ids], dim=-1)


def _target_forward(
    target: TargetSide,
    ids: torch.Tensor,
    start: int,
    cache: Any,
    want_taps: bool,
    last_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [Q or 1, V] and taps [1, Q, n*H] (or None) for `ids` [1, Q] at positions start.."""
    q = ids.shape[1]
    pos = torch.arange(start, start + q, device=ids.device)[None]
    with tap_outputs(target.model, target.layer_ids if want_taps else ()) as caps:
        out = target.model(
            input_ids=ids,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            **{cache_kwarg(target.model): cache},
        )
    feats = torch.cat([caps[i] for i in target.layer_ids], dim=-1) if want_taps else None
    return out.logits[0], feats


def _crop(cache: Any, length: int) -> None:
    remove = cache.get_seq_length() - length
    if remove < 0:
        raise RuntimeError(f"target cache holds {cache.get_seq_length()} positions, need {length}")
    cache.crop(-remove)


class _Clock:
    """perf_counter, synchronising CUDA first so GPU work is charged to the right phase."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _dtype_of(module: nn.Module, default: torch.dtype) -> torch.dtype:
    p = next(iter(module.parameters()), None) if isinstance(module, nn.Module) else None
    return p.dtype if p is not None else default


def _draw_seed(generator: torch.Generator | None) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


@torch.inference_mode()
def _check_drafter(drafter, block_size: int, layer_ids: list[int]) -> None:
    if drafter is None:
        raise ValueError("block_size > 1 needs a drafter")
    dcfg = drafter.config
    if block_size > dcfg.block_size:
        raise ValueError(
            f"block_size {block_size} exceeds the drafter's trained block size {dcfg.block_size}"
        )
    tl = getattr(dcfg, "target_layer_ids", None)
    if tl is not None and list(tl) != layer_ids:
        raise ValueError(
            f"drafter was trained on target layers {list(tl)}, but the target taps {layer_ids}"
        )


def _draft_block(drafter, target: TargetSide, last, start: int, ctx, dcache, q: int, k: int):
    """[1, k+1]: the committed token `last` at `start`, then the first k of the q-1 drafts (the
    drafter always sees its whole q-slot block, as in training; only the verified slots go
    through the LM head)."""
    embed_weight = target.embed_weight
    d_dtype = _dtype_of(drafter, embed_weight.dtype)
    h_dtype = _dtype_of(target.lm_head, embed_weight.dtype)
    mask_id = int(drafter.config.mask_token_id)
    block = torch.full((1, q), mask_id, dtype=torch.long, device=last.device)
    block[0, 0] = last[0]
    cached = getattr(dcache, "length", start - ctx.shape[1])
    if cached + ctx.shape[1] != start:
        raise RuntimeError(
            f"drafter cache holds {cached} context positions + "
            f"{ctx.shape[1]} new != block start {start}"
        )
    hidden = drafter.forward_infer(
        F.embedding(block, embed_weight).to(d_dtype), ctx.to(d_dtype), dcache, start
    )
    # 2-D rows: a sliced 3-D input would make the head's matmul a batched one over an expanded
    # copy of the [V, H] weight (measured on CPU: 26 ms for 4 rows against 10 ms as 2-D).
    block[0, 1 : k + 1] = target.lm_head(hidden[0, 1 : k + 1].to(h_dtype)).argmax(-1)
    return block[:, : k + 1]


class AdaptiveVerify:
    """How many drafts the next cycle verifies (`eval.verify=adaptive`).

    On a CPU the target's verify pass costs with the number of positions it scores (measured on
    2 cores: 1 position 60 ms, 2-8 positions ~110 ms, 16 positions ~150 ms), so verifying 15
    drafts when the drafter gets 2 right pays for 13 positions that are thrown away. Verifying
    fewer is lossless (every emitted token is still the target's choice); it only caps a
    cycle's tokens. The cap follows the drafter: the most drafts accepted over the last
    `window` cycles plus `margin`, doubled whenever a cycle accepts every verified draft (the
    drafter may reach further). It starts at the whole block. On GPUs a verify pass costs the
    same for 16 positions as for 2, so `full` is right there.
    """

    def __init__(self, max_drafts: int, window: int = 8, margin: int = 2):
        self.max_drafts, self.margin = max_drafts, margin
        self.k = max_drafts
        self.recent: deque[int] = deque(maxlen=window)

    def update(self, accepted: int, verified: int) -> None:
        self.recent.append(accepted)
        if accepted >= verified:
            self.k = min(self.max_drafts, 2 * verified)
        else:
            self.k = min(self.max_drafts, max(self.recent) + self.margin)


def _accept(host: list[int], q: int, remaining: int, stop: set) -> tuple[list, int, int, bool]:
    """(committed tokens, how many, accepted drafts, stopped) from the block and the target's
    choices (`host`: block ids then posterior ids)."""
    drafts, post = host[1:q], host[q:]
    a = 0
    while a < q - 1 and drafts[a] == post[a]:
        a += 1
    new = post[: a + 1]  # accepted drafts + bonus, by position
    produced, stopped = min(a + 1, remaining), False
    for i, tok in enumerate(new[:produced]):
        if tok in stop:
            produced, stopped = i + 1, True
            break
    return new[:produced], produced, a, stopped


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
    """Generate up to max_new_tokens after input_ids [1, P] with draft-verify cycles of block_size.

    block_size=1 (drafter may be None) is plain autoregressive decoding with the same code.
    `generator` draws the sampling seed (temperature > 0 only); equal generator states give equal
    samples for spec and AR runs. `verify`: "full" verifies every draft of the block (the
    published loop: tau is the drafter's acceptance length); "adaptive" verifies as many as the
    drafter has recently reached (AdaptiveVerify: faster on CPUs, same tokens).
    """
    if verify not in ("full", "adaptive"):
        raise ValueError(f"verify must be 'full' or 'adaptive', got {verify!r}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [1, P] with P >= 1, got {tuple(input_ids.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not 0.0 < top_p <= 1.0 or temperature < 0:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    target = TargetSide(target_model, list(layer_ids), embed_weight, lm_head)
    use_drafter = block_size > 1
    if use_drafter:
        _check_drafter(drafter, block_size, target.layer_ids)
    clock = _Clock(input_ids.device)
    seed = _draw_seed(generator) if temperature > 0 else 0
    stop = set(int(s) for s in stop_ids)
    res = GenResult(tokens=[], acceptance_lengths=[], accepted_drafts=[], block_sizes=[])
    if max_new_tokens <= 0:
        return res

    # Prefill: the whole prompt; its taps are the drafter's first context.
    p_len = input_ids.shape[1]
    t0 = clock()
    cache = new_kv_cache(target_model)
    logits, ctx = _target_forward(target, input_ids, 0, cache, use_drafter, last_only=True)
    first = choose_tokens(logits[-1:], [p_len], temperature, top_p, seed)  # token at position P
    res.tokens.append(int(first[0]))
    t1 = clock()
    res.prefill_time = t1 - t0
    dcache = drafter.new_cache() if use_drafter else None

    last = first  # [1] device tensor: committed, not yet seen by the target
    start = p_len  # its position
    window = AdaptiveVerify(block_size - 1) if verify == "adaptive" else None
    res.stopped = res.tokens[0] in stop
    while not res.stopped and len(res.tokens) < max_new_tokens:
        remaining = max_new_tokens - len(res.tokens)
        # One slot more than the tokens still allowed, like the reference loop: the block's bonus
        # covers the last allowed token; whatever overshoots is clipped below.
        q = min(block_size, remaining + 1)
        k = q - 1 if window is None else min(q - 1, window.k)  # drafts verified
        ta = clock()
        if use_drafter and q > 1:
            block = _draft_block(drafter, target, last, start, ctx, dcache, q, k)
        else:
            block = last.view(1, 1)
        q = k + 1  # positions the target verifies
        tb = clock()
        logits, taps = _target_forward(target, block, start, cache, use_drafter)
        posterior = choose_tokens(logits, range(start + 1, start + 1 + q), temperature, top_p, seed)
        host = torch.cat([block[0], posterior]).tolist()  # the one sync per cycle
        new, produced, a, res.stopped = _accept(host, q, remaining, stop)
        res.tokens.extend(new)
        res.acceptance_lengths.append(produced)
        res.accepted_drafts.append(a)
        res.block_sizes.append(q)
        if window is not None:
            window.update(a, k)
        # Committed positions start..start+produced-1 now hold verified K/V; the bonus (position
        # start+produced) has none yet and is slot 0 of the next block.
        _crop(cache, start + produced)
        if use_drafter:
            ctx = taps[:, :produced]
        last = posterior[produced - 1 : produced]
        start += produced
        tc = clock()
        res.draft_time += tb - ta
        res.verify_time += tc - tb
    res.decode_time = clock() - t1
    return res


def ar_generate(
    target_model: nn.Module,
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
