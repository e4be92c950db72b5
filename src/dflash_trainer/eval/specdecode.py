"""Speculative decoding with a DFlash drafter: the draft-verify loop, its AR baseline, and `eval`.

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
(run/evaluation.py) calls `evaluate` between steps.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trainer.data import embedded  # module: tests patch embedded_prompts
from dflash_trainer.data.chat import Rendering
from dflash_trainer.data.prepare import prompt_hash
from dflash_trainer.data.sources import BadRecord, parse_record
from dflash_trainer.errors import UserError
from dflash_trainer.eval.dtype import drafter_in, dtype_label, model_dtype, target_in
from dflash_trainer.eval.metrics import EvalSummary, summarize
from dflash_trainer.models.export import load_drafter
from dflash_trainer.models.kv_cache import cache_kwarg, new_kv_cache
from dflash_trainer.models.packed_linear import packed_linears
from dflash_trainer.models.target import TargetModel, tap_outputs
from dflash_trainer.observe.progress import showing_progress

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


# --------------------------------------------------------------------------------------------
# Evaluation over prompt sets
# --------------------------------------------------------------------------------------------


def _as_prompt(ids: Any, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long, device=device)
    return t.view(1, -1)


def _target_device(target: Any) -> torch.device:
    return next(target.model.parameters()).device


@contextmanager
def _eval_mode(*modules: Any):
    """Put modules in eval mode, then restore their modes (the trainer's drafter is training)."""
    mods = [m for m in modules if isinstance(m, nn.Module)]
    was = [m.training for m in mods]
    try:
        for m in mods:
            m.eval()
        yield
    finally:
        for m, w in zip(mods, was):
            m.train(w)


def _unwrap(drafter: Any) -> Any:
    return getattr(drafter, "module", drafter)  # DDP / FSDP wrappers keep the model in .module


def evaluate(
    target: Any,
    drafter: Drafter | None,
    prompts: Sequence[Any],
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] | None = None,
    seed: int = 0,
    baseline: bool = True,
    warmup: bool = True,
    generate_fn: Callable[..., GenResult] = spec_generate,
    progress: bool = True,
    verify: str = "full",
    packed: bool = True,
) -> EvalSummary:
    """Run spec decoding (and the AR baseline) over prompts (token id lists or [1,P] tensors).

    `target` is a TargetModel or TargetSide. The spec and AR run of a prompt share a seed, so in
    sampling mode they also produce comparable (identical, when lossless) outputs.
    `progress`: a bar over prompts (observe/progress.py; drawn only when stderr is a terminal).
    `verify`: the drafter runs' verify policy (spec_generate; "full" = the published loop).
    `packed`: float32 CPU linear layers of target and drafter run oneDNN's prepacked GEMM
    (models/packed_linear.py; target.packed_linear), for the spec and the AR runs alike.
    """
    drafter = _unwrap(drafter)
    how = {} if verify == "full" else {"verify": verify}  # custom generate_fns need not know it
    device = _target_device(target)
    stop = list(target.eos_token_ids if stop_ids is None else stop_ids)
    args = (target.model, target.layer_ids, target.embed_weight, target.lm_head)
    spec, ar = [], []
    with (
        _eval_mode(target.model, drafter),
        packed_linears(target.model, target.lm_head, drafter, enabled=packed),
        showing_progress(len(prompts), desc="eval", unit="prompt", enabled=progress) as bar,
    ):
        if warmup and prompts:  # first calls pay one-off costs (allocator, kernels); keep them out
            w = _as_prompt(prompts[0], device)
            generate_fn(
                *args,
                drafter,
                w,
                min(8, max_new_tokens),
                block_size,
                temperature,
                top_p,
                stop,
                torch.Generator().manual_seed(seed),
                **how,
            )
            if baseline:
                generate_fn(
                    *args,
                    None,
                    w,
                    min(8, max_new_tokens),
                    1,
                    temperature,
                    top_p,
                    stop,
                    torch.Generator().manual_seed(seed),
                )
        for i, p in enumerate(prompts):
            ids = _as_prompt(p, device)
            spec.append(
                generate_fn(
                    *args,
                    drafter,
                    ids,
                    max_new_tokens,
                    block_size,
                    temperature,
                    top_p,
                    stop,
                    torch.Generator().manual_seed(seed + i),
                    **how,
                )
            )
            if baseline:
                ar.append(
                    generate_fn(
                        *args,
                        None,
                        ids,
                        max_new_tokens,
                        1,
                        temperature,
                        top_p,
                        stop,
                        torch.Generator().manual_seed(seed + i),
                    )
                )
            bar.update(1)
        s = summarize(spec, ar or None, block_size)
        s.decode_dtype = dtype_label(model_dtype(target.model))
        for p, a, b in zip(prompts, spec, ar):
            if a.tokens != b.tokens:
                s.tie_gaps.append(divergence_gap(target.model, _as_prompt(p, device), a, b))
    return s


@torch.no_grad()
def divergence_gap(model: nn.Module, prompt: torch.Tensor, a: GenResult, b: GenResult) -> float:
    """|logit(a's token) - logit(b's token)| at the first position where the two generations of
    `prompt` differ, from one plain forward over the common prefix: small for a near-tie that
    reduced-precision rounding flipped, large for a real divergence."""
    j = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
    if j is None:  # one is a prefix of the other: it stopped where the other went on
        j = min(len(a.tokens), len(b.tokens))
        if j >= max(len(a.tokens), len(b.tokens)):
            return 0.0
    ids = torch.cat(
        [prompt, torch.tensor([a.tokens[:j]], dtype=torch.long, device=prompt.device)], 1
    )
    logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
    x = a.tokens[j] if j < len(a.tokens) else None
    y = b.tokens[j] if j < len(b.tokens) else None
    if x is None or y is None:  # one ended on the token limit: no second choice to compare
        return 0.0
    return float((logits[x] - logits[y]).abs())


# --------------------------------------------------------------------------------------------
# Prompt sets and the `eval` command
# --------------------------------------------------------------------------------------------


def load_prompt_file(path: str | Path, data_format: str = "chat") -> list[tuple[str, list[dict]]]:
    """A JSONL file of prompts, one record per line in any shape data/sources.py reads for
    `data_format` (chat: OpenAI `messages`, content-part lists included, or ShareGPT
    `conversations`; text: `prompt`, the raw text a base model continues)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"eval prompt file '{p}' does not exist; eval.datasets takes "
            "'mt-bench', 'humaneval', 'heldout' or a JSONL path."
        )
    if data_format == "text":
        expected = 'expected {"id": ..., "prompt": "..."} (data.format=text)'
        no_prompt = "the record has no 'prompt' to continue"
    else:
        expected = (
            'expected {"id": ..., "messages": [{"role": "user", "content": "..."}]} with roles '
            "system/user/assistant"
        )
        no_prompt = "the conversation has no user turn to answer"
    out = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{p}:{n}: invalid JSON ({e.msg}); one object per line.") from None
        try:
            rid, msgs = parse_record(rec, data_format)
        except BadRecord as e:
            raise UserError(f"{p}:{n}: {expected} ({e.field}: {e.problem}).") from None
        if not msgs:
            raise UserError(f"{p}:{n}: {expected} (the conversation is empty).")
        if not any(m["role"] == "user" for m in msgs):
            raise UserError(f"{p}:{n}: {no_prompt}.")
        out.append((str(rid) if rid is not None else f"{p.name}:{n}", msgs))
    return out


def heldout_file(cfg: Any) -> Path:
    return Path(cfg.eval.heldout_path or Path(cfg.run_dir) / "heldout.jsonl")


def load_prompt_set(name: str, cfg: Any) -> list[tuple[str, list[dict]]]:
    """(id, messages) pairs for one entry of eval.datasets."""
    if name in ("mt-bench", "humaneval"):
        prefix = {"mt-bench": "mtbench-", "humaneval": "humaneval-"}[name]
        convs = [c for c in embedded.embedded_prompts() if c.id.startswith(prefix)]
        if not convs:
            raise UserError(f"no embedded prompts found for eval dataset '{name}'.")
        return [(c.id, c.messages) for c in convs]
    if name == "heldout":
        path = heldout_file(cfg)
        if not path.is_file():
            raise UserError(
                f"eval.datasets=heldout: no held-out prompts at '{path}'. Training writes them "
                "(RUN_DIR/heldout.jsonl, the prompts it never trained on): pass the run's "
                "--run_dir, or set --eval.heldout_path to a JSONL of {id, messages}. "
                "mt-bench/humaneval are not held out from the embedded training data."
            )
        return load_prompt_file(path, cfg.data.format)
    return load_prompt_file(name, cfg.data.format)


def training_ids(cfg: Any) -> tuple[set, set] | None:
    """(ids, prompt hashes) of the run's training conversations (train_ids.json beside the
    held-out file), or None when the run wrote none."""
    path = heldout_file(cfg).parent / "train_ids.json"
    if not path.is_file():
        return None
    d = json.loads(path.read_text(encoding="utf-8"))
    return set(d.get("ids", [])), set(d.get("prompt_hashes", []))


def split_by_training(convs, trained: tuple[set, set]) -> tuple[list, list]:
    """(prompts the run trained on, the rest), by conversation id or prompt hash."""
    ids, hashes = trained
    seen, rest = [], []
    for cid, msgs in convs:
        (seen if cid in ids or prompt_hash(msgs) in hashes else rest).append((cid, msgs))
    return seen, rest


def run_conversations(
    target: Any,
    drafter: Drafter,
    convs: Sequence[tuple[str, list[dict]]],
    max_new_tokens: int,
    block_size: int,
    temperature: float,
    top_p: float,
    rendering: Rendering,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    desc: str = "eval",
    verify: str = "full",
    packed: bool = True,
) -> EvalSummary:
    """Answer every user turn of each conversation in order (multi-turn, like the z-lab benchmark):
    each turn is one response; the history carries the spec-decoded answers, not the file's own.
    Prompts are rendered as in training (`rendering`: Rendering.from_config(cfg)); a raw-text
    prompt (data.format=text) is one user turn, continued once.

    dtype: decode in this dtype (eval.dtype resolved, eval/dtype.py: eval_dtype), on cast copies
    of target and drafter where they differ; None = as given. `progress`: a bar named `desc`
    over conversations (drawn only when stderr is a terminal)."""
    if dtype is not None:
        target, drafter = target_in(target, dtype), drafter_in(drafter, dtype)
    tok = target.tokenizer
    spec, ar, gaps, prompts = [], [], [], []
    with (
        # packed once for all turns: the per-prompt evaluate calls inside find them packed
        packed_linears(target.model, target.lm_head, _unwrap(drafter), enabled=packed),
        showing_progress(len(convs), desc=desc, unit="conversation", enabled=progress) as bar,
    ):
        for ci, (_cid, msgs) in enumerate(convs):
            history: list[dict] = []
            for m in msgs:
                if m["role"] == "assistant":
                    continue  # regenerated below
                history.append(m)
                if m["role"] != "user":
                    continue
                ids = rendering.prompt_ids(tok, history)
                prompts.append(list(ids))
                s = evaluate(
                    target,
                    drafter,
                    [ids],
                    max_new_tokens,
                    block_size,
                    temperature,
                    top_p,
                    seed=seed + 1000 * ci + len(history),
                    warmup=not spec,
                    progress=False,  # one prompt per call: the bar counts conversations
                    verify=verify,
                    packed=packed,
                )
                spec += s.spec_results
                ar += s.ar_results
                gaps += s.tie_gaps
                text = tok.decode(s.spec_results[0].tokens, skip_special_tokens=True)
                history.append({"role": "assistant", "content": text})
            bar.update(1)
    out = summarize(spec, ar, block_size)
    out.decode_dtype = dtype_label(model_dtype(target.model))
    out.tie_gaps = gaps
    out.prompts = prompts
    return out


def load_eval_pair(cfg: Any, drafter_dir: Path, device: torch.device) -> tuple[Any, Any, int]:
    """(target, drafter, block size) for evaluating the exported drafter in `drafter_dir`,
    checked to belong together (taps, hidden size, block size)."""
    if not drafter_dir.is_dir():
        raise UserError(
            f"no exported drafter at '{drafter_dir}'; train first or pass --drafter DIR."
        )
    target = TargetModel.load(cfg.target, device)
    if cfg.target.check_taps:  # wrong features would show only as a low tau
        # through the hooks the decode loop taps with (not only the training capture)
        target.check_taps(lambda ids: decode_features(target.model, target.layer_ids, ids))
    drafter = load_drafter(drafter_dir, device)
    dc = drafter.config
    if list(dc.target_layer_ids) != list(target.layer_ids) or dc.hidden_size != target.hidden_size:
        raise UserError(
            f"drafter '{drafter_dir}' was trained on target layers "
            f"{list(dc.target_layer_ids)} (hidden {dc.hidden_size}), but "
            f"target.model={cfg.target.model} taps {list(target.layer_ids)} (hidden "
            f"{target.hidden_size}); use the drafter's target, or set --target.taps."
        )
    block_size = cfg.eval.block_size or dc.block_size
    if block_size > dc.block_size:
        raise UserError(
            f"eval.block_size={block_size} exceeds the drafter's trained block size "
            f"{dc.block_size}; use a value <= {dc.block_size} (0 = trained size)."
        )
    return target, drafter, block_size


def evaluate_datasets(cfg: Any, target: Any, drafter: Any, block_size: int) -> dict:
    """Speculative decoding on every `eval.datasets` entry: name -> EvalSummary.

    'heldout' is decoded whole. A named set (mt-bench, humaneval, a file) is cut to
    eval.dataset_prompts; where it overlaps the run's training data (train_ids.json), a warning
    gives the overlap and tau is reported separately: `NAME:trained` and `NAME:unseen`."""
    trained = training_ids(cfg)
    rendering = Rendering.from_config(cfg)
    results = {}
    for name in cfg.eval.datasets:
        convs = load_prompt_set(name, cfg)
        parts = {name: convs}
        if name != "heldout":
            convs = convs[: cfg.eval.dataset_prompts]
            parts = {name: convs}
            if trained is not None:
                seen, rest = split_by_training(convs, trained)
                if seen:
                    log.warning(
                        "eval: %d of %d prompts of '%s' were in this run's training data; "
                        "their tau is reported apart (%s:trained, %s:unseen)",
                        len(seen),
                        len(convs),
                        name,
                        name,
                        name,
                    )
                    parts = {f"{name}:trained": seen, f"{name}:unseen": rest}
        for key, part in parts.items():
            if not part:
                continue
            log.info("eval: %s, %d conversations, block %d", key, len(part), block_size)
            results[key] = run_conversations(
                target,
                drafter,
                part,
                cfg.eval.max_new_tokens,
                block_size,
                cfg.eval.temperature,
                cfg.eval.top_p,
                rendering,
                seed=cfg.eval.seed,
                progress=cfg.metrics.console,
                desc=f"eval {key}",
                verify=cfg.eval.verify,
                packed=cfg.target.packed_linear,
            )
    return results
