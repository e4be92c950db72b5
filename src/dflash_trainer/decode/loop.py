"""The one decode loop: greedy, sampled and speculative decoding for 1 or N rows.

One cycle, for every row still running (method doc §3):
  block  = [last committed token] + (speculative: the drafter's proposals, decode/draft.py)
  target = ONE forward over the block (KV cache; taps when the drafter or the caller needs them)
  choose = the sampler's token at every block position (decode/sampler.py)
  accept = the leading drafts that equal the target's choice; commit them + the bonus choice,
           at most the tokens left, cut after a stop id
then the cache keeps the committed positions only and the committed taps become the drafter's
next context. Plain decoding is the same cycle with a block of 1 (no drafter, all accepted).

N rows are left padded into one prefill; a row leaves the batch when it ends (its KV cache rows are
dropped), so long answers do not keep short ones' compute busy. Speculative decoding runs one
row (rows would accept different lengths; the caller loops over prompts).

One host read per cycle (`.tolist()`): the accepted length and the stop decide control flow.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_trainer.config import SamplingConfig
from dflash_trainer.decode.draft import (
    AdaptiveVerify,
    Drafter,
    accepted,
    check_drafter,
    commit,
    draft_block,
)
from dflash_trainer.decode.sampler import choose
from dflash_trainer.models.kv_cache import all_growing, left_padded, new_kv_cache
from dflash_trainer.models.target import TargetModel


@dataclass
class GenResult:
    tokens: list[int]  # new tokens only (the prefill token included), stop id kept
    acceptance_lengths: list[int]  # per cycle: committed (accepted drafts + bonus), clipped
    accepted_drafts: list[int]  # per cycle: a, the accepted draft count before any clipping
    block_sizes: list[int]  # per cycle: Q, tokens verified (slot 0 + Q-1 drafts)
    prefill_time: float = 0.0  # seconds
    draft_time: float = 0.0  # seconds, drafter passes + draft proposals
    verify_time: float = 0.0  # seconds, target passes + acceptance
    decode_time: float = 0.0  # seconds, wall time after prefill
    stopped: bool = False  # ended on a stop id (else on the token limit)
    # keep_features: the target's taps [P + len(tokens), n*H] of the prompt and every committed
    # token (what a drafter trains on), else None
    features: torch.Tensor | None = None

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


class _Clock:
    """perf_counter, synchronising CUDA first so GPU work is charged to the right phase."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


@dataclass
class _Rows:
    """The rows still in the batch: their original index, last committed token (not yet seen by
    the target) and its position, sampling seed, padding mask (None: no row is padded), and
    whether a row has ended and stays one more cycle only to tap its last token."""

    index: list[int]
    last: torch.Tensor  # [R] token ids
    pos: torch.Tensor  # [R] positions of `last`
    seeds: torch.Tensor  # [R]
    mask: torch.Tensor | None  # [R, cached]
    ending: list[bool]

    def keep(self, keep: list[int], cache: Any) -> None:
        """Keep rows `keep` (batch indices), and their KV cache rows."""
        if len(keep) == len(self.index) or not keep:
            self.index = self.index if keep else []
            return
        sel = torch.tensor(keep, device=self.last.device)
        cache.batch_select_indices(sel)
        self.index = [self.index[i] for i in keep]
        self.ending = [self.ending[i] for i in keep]
        self.last, self.pos, self.seeds = self.last[sel], self.pos[sel], self.seeds[sel]
        self.mask = None if self.mask is None else self.mask[sel]


def _left_pad(rows: list[list[int]], pad_id: int, device: torch.device):
    """(ids [R, W], padding mask [R, W] or None when no row is shorter, positions [R, W])."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    if all(len(r) == width for r in rows):
        pos = torch.arange(width, device=device).expand(len(rows), width)
        return ids.to(device), None, pos
    mask = mask.to(device)
    return ids.to(device), mask, (mask.cumsum(-1) - 1).clamp_min(0)


def decode(
    target: TargetModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    *,
    seeds: Sequence[int] | None = None,
    stop_ids: Sequence[int] | None = None,
    drafter: Drafter | None = None,
    block_size: int = 1,
    verify: str = "full",
    keep_features: bool = False,
    pad_id: int = 0,
) -> list[GenResult]:
    """Up to `max_new_tokens` new tokens after each prompt (token id lists): one GenResult per
    prompt, in order. `seeds`: one sampling seed per prompt (temperature > 0; default 0).
    `stop_ids`: default the target's eos ids. `block_size` > 1: speculative decoding with
    `drafter` (one prompt); `verify`: "full" verifies every draft of the block (the published
    loop: tau is the drafter's acceptance length), "adaptive" as many as the drafter recently
    reached, and none while drafting does not pay for its time (AdaptiveVerify: faster on
    CPUs, same tokens). `keep_features`: each result's `features` are the target's taps of its
    prompt and committed tokens (no second prefill)."""
    rows = [[int(t) for t in p] for p in prompts]
    if not rows or any(not r for r in rows):
        raise ValueError("decode needs at least one prompt, each of at least one token")
    if verify not in ("full", "adaptive"):
        raise ValueError(f"verify must be 'full' or 'adaptive', got {verify!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if block_size > 1:
        if len(rows) > 1:
            raise ValueError(
                f"speculative decoding (block_size {block_size}) decodes one prompt at a time, "
                f"got {len(rows)}: call decode once per prompt, or use block_size=1 for a batch"
            )
        drafter = check_drafter(drafter, block_size, target.layer_ids)
    results = [GenResult([], [], [], []) for _ in rows]
    if max_new_tokens <= 0:
        return results
    stop = set(int(s) for s in (target.eos_token_ids if stop_ids is None else stop_ids))
    seeds = [0] * len(rows) if seeds is None else [int(s) for s in seeds]
    if len(seeds) != len(rows):
        raise ValueError(f"{len(seeds)} seeds for {len(rows)} prompts")
    loop = _Loop(target, sampling, stop, drafter, block_size, verify, keep_features, results)
    loop.run(rows, seeds, max_new_tokens, pad_id)
    return results


class _Loop:
    """One decode call's state: the target's KV cache, the drafter's cache and unseen context
    (speculative), the results being filled."""

    def __init__(
        self,
        target: TargetModel,
        sampling: SamplingConfig | None,
        stop: set[int],
        drafter: Drafter | None,
        block_size: int,
        verify: str,
        keep_features: bool,
        results: list[GenResult],
    ):
        self.target, self.sampling, self.stop, self.results = target, sampling, stop, results
        self.drafter, self.block_size = drafter, block_size
        self.spec = drafter is not None and block_size > 1
        self.keep_features = keep_features
        self.taps = self.spec or keep_features
        self.window = AdaptiveVerify(block_size - 1) if self.spec and verify == "adaptive" else None
        self.clock = _Clock(target.device)
        self.cache = new_kv_cache(target.model)  # type: ignore[arg-type]  # an HF causal LM
        self.dcache = drafter.new_cache() if self.spec and drafter is not None else None
        self.ctx: torch.Tensor | None = None  # speculative: taps the drafter has not seen yet
        self.start = 0  # speculative: position of the row's last committed token
        self.feats: list[list[torch.Tensor]] = [[] for _ in results]

    def run(self, rows: list[list[int]], seeds: list[int], max_new: int, pad_id: int) -> None:
        t0 = self.clock()
        live = self._prefill(rows, seeds, max_new, pad_id)
        t1 = self.clock()
        while live.index:
            self._cycle(live, max_new)
        t2 = self.clock()
        for res, feats in zip(self.results, self.feats):
            res.prefill_time, res.decode_time = t1 - t0, t2 - t1
            if self.keep_features:
                res.features = torch.cat(feats, 0)

    def _prefill(self, rows: list[list[int]], seeds: list[int], max_new: int, pad_id: int):
        """The prompts' forward (one left-padded batch, or one row at a time: _prefill_rows);
        each row's first token."""
        device = self.target.device
        ids, mask, pos = _left_pad(rows, pad_id, device)
        got = self._prefill_rows(rows) if mask is not None else None
        if got is None:
            logits, feats = self.target.forward(
                ids, pos, self.cache, taps=self.taps, attention_mask=mask, logits_to_keep=1
            )
            row_feats = [] if feats is None else [feats[i, -len(r) :] for i, r in enumerate(rows)]
            self.ctx = feats if self.spec else None
        else:
            logits, row_feats = got
        seed_t = torch.tensor(seeds, dtype=torch.int64, device=device)
        first = choose(self.sampling, logits[:, -1], pos[:, -1] + 1, seed_t)  # tokens at P
        for i, f in enumerate(row_feats):
            self.feats[i].append(f)
        live = _Rows(list(range(len(rows))), first, pos[:, -1] + 1, seed_t, mask, [])
        self.start = len(rows[0])
        keep = []
        for i, tok in enumerate(first.tolist()):  # the one host read of the prefill
            res = self.results[i]
            res.tokens.append(tok)
            res.stopped = tok in self.stop
            done = res.stopped or len(res.tokens) >= max_new
            live.ending.append(done)
            if not done or self.keep_features:
                keep.append(i)
        live.keep(keep, self.cache)
        return live

    def _prefill_rows(self, rows: list[list[int]]) -> tuple[torch.Tensor, list] | None:
        """Rows of different lengths prefilled one at a time, each without padding, into one
        left-padded batch cache (models/kv_cache.left_padded): (last-position logits [R, 1, V],
        each row's taps [len, n*H] when tapping). A padded batch computes every pad position
        and attends over a full mask (the embedded set in batches of 64: 51.4k prefill positions
        for 37.6k prompt tokens; generation 1.33x faster this way, bench/LOG.md). None where
        the cache cannot be laid out so (sliding-window or linear-attention layers: the padded
        batch then)."""
        if not all_growing(self.cache):
            return None
        t, device = self.target, self.target.device
        caches, logits, feats = [], [], []
        for r in rows:
            cache = new_kv_cache(t.model)  # type: ignore[arg-type]  # an HF causal LM
            ids = torch.tensor([r], dtype=torch.long, device=device)
            pos = torch.arange(len(r), device=device)[None]
            lg, f = t.forward(ids, pos, cache, taps=self.taps, logits_to_keep=1)
            caches.append(cache)
            logits.append(lg)
            if f is not None:
                feats.append(f[0])
        self.cache = left_padded(caches, max(len(r) for r in rows))
        return torch.cat(logits, 0), feats

    def _block(self, live: _Rows, max_new: int) -> tuple[torch.Tensor, int]:
        """The tokens this cycle feeds the target, and the drafts among them (k)."""
        if not self.spec or live.ending[0]:
            return live.last[:, None], 0
        assert self.drafter is not None and self.ctx is not None
        remaining = max_new - len(self.results[live.index[0]].tokens)
        # One slot more than the tokens still allowed, like the reference loop: the block's bonus
        # covers the last allowed token; whatever overshoots is clipped.
        q = min(self.block_size, remaining + 1)
        k = q - 1 if self.window is None else min(q - 1, self.window.drafts())
        if k == 0:  # a plain step (adaptive verify's gate): the drafter's context waits
            return live.last[:, None], 0
        t = self.target
        block = draft_block(
            self.drafter, t.embed_weight, t.lm_head, live.last, self.start, self.ctx,
            self.dcache, q, k,
        )  # fmt: skip
        return block, k

    def _cycle(self, live: _Rows, max_new: int) -> None:
        """Draft (speculative), verify or step, accept, commit; rows that ended leave."""
        ta = self.clock() if self.spec else 0.0
        block, k = self._block(live, max_new)
        tb = self.clock() if self.spec else 0.0
        q = k + 1
        if self.spec:
            pos = torch.arange(self.start, self.start + q, device=block.device)[None]
        else:
            pos = live.pos[:, None]
        if live.mask is not None:
            live.mask = torch.cat([live.mask, live.mask.new_ones(len(live.index), q)], 1)
        logits, taps = self.target.forward(
            block, pos, self.cache, taps=self.taps, attention_mask=live.mask
        )
        choices = choose(self.sampling, logits, pos + 1, live.seeds[:, None])  # [R, q]
        host = torch.cat([block, choices], 1).tolist()  # the one host read per cycle
        keep, n, a = [], 1, 0
        for i, r in enumerate(live.index):
            if live.ending[i]:  # it ended last cycle; this cycle only tapped its last token
                if taps is not None:
                    self.feats[r].append(taps[i, :1])
                continue
            res = self.results[r]
            a = accepted(host[i][1:q], host[i][q:])
            new, res.stopped = commit(host[i][q : q + a + 1], max_new - len(res.tokens), self.stop)
            n = len(new)
            res.tokens += new
            res.acceptance_lengths.append(n)
            res.accepted_drafts.append(a)
            res.block_sizes.append(q)
            if self.keep_features and taps is not None:
                self.feats[r].append(taps[i, :n])
            live.ending[i] = res.stopped or len(res.tokens) >= max_new
            if not live.ending[i] or self.keep_features:
                keep.append(i)
        if self.spec and keep:
            self._advance_spec(live, choices, taps, n, a, k)
        else:
            live.last, live.pos = choices[:, 0], live.pos + 1
        live.keep(keep, self.cache)
        if self.spec:
            tc = self.clock()
            res = self.results[0]
            res.draft_time += tb - ta
            res.verify_time += tc - tb
            if self.window is not None and keep:
                self.window.update(a, k, tc - ta)

    def _advance_spec(self, live, choices, taps, n: int, a: int, k: int) -> None:
        """The speculative row after committing n tokens: the cache keeps the committed
        positions (the bonus token has no K/V yet: it is slot 0 of the next block)."""
        remove = self.cache.get_seq_length() - (self.start + n)
        if remove < 0:
            raise RuntimeError(f"target cache holds {self.cache.get_seq_length()} positions")
        if remove:
            self.cache.crop(-remove)
        # the taps of the committed tokens, after those no drafter pass has read yet (a cycle
        # with no drafts ran none)
        self.ctx = taps[:, :n] if k or self.ctx is None else torch.cat([self.ctx, taps[:, :n]], 1)
        live.last = choices[0, n - 1 : n]
        live.pos = live.pos + n
        self.start += n
