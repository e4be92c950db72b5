"""Epoch planning (pure numpy): length buckets -> token-budget batches -> interleaved buckets.

    lengths --bucket_edges--> buckets (equal expected batch count each, fixed for the run)
      per epoch, rng = (seed, epoch):
        per bucket: shuffle -> cut into windows of `sort_window` samples -> sort each window by
                    length -> greedy token-budget batches (rows x padded length <= max_tokens,
                    rows <= max_batch_size, padded length = max_len rounded up to pad_multiple)
        interleave: batch j of a bucket with n batches gets the key (j + U(0,1)) / n; all batches
                    sorted by key. Every bucket is spread evenly over the epoch (stratified), so the
                    stream never sweeps short -> long and a window of 64 batches sees every bucket.
        shard:      rank r takes batches r, r + W, r + 2W, ... of the global plan (W = world size);
                    the last (n mod W) batches are dropped so every rank runs the same number of
                    steps (DDP needs it); they are counted in `EpochPlan.dropped_*` and, since the
                    order is re-drawn each epoch, different samples fall in the tail every epoch.

Why buckets of equal *batch count* rather than equal sample count: a token budget packs many short
sequences into one batch and few long ones, so equal-count quantile buckets give the long buckets
most of the batches and the bucket mix (`bucket_entropy`) is skewed no matter how batches are
ordered. Each sample is weighted by the share of a batch it occupies,
max(padded_len / max_tokens, 1 / max_batch_size), and the edges are the quantiles of that
cumulative weight over the sorted lengths.

Why sort windows: batches of randomly drawn lengths waste most of their tokens on padding inside a
wide bucket; sorting a window of `sort_window` shuffled samples keeps batch contents random from
epoch to epoch while rows in a batch have similar lengths. 0 = sort the whole bucket.

The plan depends only on (lengths, config, epoch), never on the rank, so all ranks agree on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_trainer.config import BatchingConfig
from dflash_trainer.errors import UserError


@dataclass
class EpochPlan:
    batches: list[list[int]]  # this rank's batches, in order (dataset indices)
    buckets: list[int]  # bucket id of each batch
    num_buckets: int
    dropped_batches: int = 0  # global tail batches dropped so all ranks get the same count
    dropped_samples: int = 0


def _round_up(x, m: int):
    return -(-x // m) * m


def bucket_edges(lengths, cfg: BatchingConfig) -> np.ndarray:
    """Upper-exclusive bucket boundaries: bucket(l) = searchsorted(edges, l, side='right')."""
    lengths = np.asarray(lengths, dtype=np.int64)
    k = int(cfg.num_buckets)
    if k <= 1 or len(lengths) == 0:
        return np.zeros(0, dtype=np.int64)
    srt = np.sort(lengths)
    cost = np.maximum(_round_up(srt, cfg.pad_multiple) / cfg.max_tokens, 1.0 / cfg.max_batch_size)
    cum = np.cumsum(cost)
    targets = cum[-1] * np.arange(1, k) / k
    edges = srt[np.minimum(np.searchsorted(cum, targets, side="left"), len(srt) - 1)]
    # A boundary at the maximum would leave the top bucket empty; duplicates collapse buckets.
    return np.unique(edges[edges < srt[-1]])


def assign_buckets(lengths, edges) -> np.ndarray:
    return np.searchsorted(edges, np.asarray(lengths, dtype=np.int64), side="right")


def _cut(order: np.ndarray, lengths: np.ndarray, cfg: BatchingConfig) -> list[list[int]]:
    """Greedy token-budget batches over `order` (already arranged; ascending within windows)."""
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order.tolist():
        l = int(lengths[i])
        m = max(cur_max, l)
        if cur and (
            (len(cur) + 1) * _round_up(m, cfg.pad_multiple) > cfg.max_tokens
            or len(cur) >= cfg.max_batch_size
            or l < cur_max
        ):
            batches.append(cur)
            cur, m = [], l
        cur.append(i)
        cur_max = m
    if cur:
        batches.append(cur)
    return batches


def plan_epoch_detailed(
    lengths, cfg: BatchingConfig, epoch: int, rank: int = 0, world_size: int = 1
) -> EpochPlan:
    lengths = np.asarray(lengths, dtype=np.int64)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if len(lengths) == 0:
        return EpochPlan([], [], max(1, cfg.num_buckets))
    longest = int(_round_up(lengths.max(), cfg.pad_multiple))
    if longest > cfg.max_tokens:
        raise UserError(
            f"batching.max_tokens ({cfg.max_tokens}) is smaller than the longest "
            f"sequence ({longest} tokens after padding to batching.pad_multiple); "
            "raise batching.max_tokens or lower data.max_length."
        )
    edges = bucket_edges(lengths, cfg)
    num_buckets = len(edges) + 1
    bucket_of = assign_buckets(lengths, edges)
    rng = np.random.default_rng([int(cfg.seed), int(epoch)])
    window = int(getattr(cfg, "sort_window", 0) or 0)

    per_bucket: list[list[list[int]]] = []
    for b in range(num_buckets):
        members = np.flatnonzero(bucket_of == b)
        members = members[rng.permutation(len(members))]
        w = window if window > 0 else max(len(members), 1)
        parts = [members[s : s + w] for s in range(0, len(members), w)]
        # Stable sort after the shuffle: equal lengths keep their random order.
        order = (
            np.concatenate([p[np.argsort(lengths[p], kind="stable")] for p in parts])
            if parts
            else members
        )
        bb = _cut(order, lengths, cfg)
        # Shuffle batch order inside the bucket so it does not climb short -> long either.
        per_bucket.append([bb[j] for j in rng.permutation(len(bb)).tolist()])

    keys, flat, flat_bucket = [], [], []
    for b, bb in enumerate(per_bucket):
        n = len(bb)
        if n:
            keys.append((np.arange(n) + rng.random(n)) / n)
            flat.extend(bb)
            flat_bucket.extend([b] * n)
    order = np.argsort(np.concatenate(keys), kind="stable").tolist()
    batches = [flat[i] for i in order]
    buckets = [flat_bucket[i] for i in order]

    usable = len(batches) - len(batches) % world_size
    dropped = batches[usable:]
    return EpochPlan(
        batches[rank:usable:world_size],
        buckets[rank:usable:world_size],
        num_buckets,
        dropped_batches=len(dropped),
        dropped_samples=sum(len(b) for b in dropped),
    )


def plan_epoch(
    lengths, cfg: BatchingConfig, epoch: int, rank: int = 0, world_size: int = 1
) -> list[list[int]]:
    """This rank's batches (lists of dataset indices) for `epoch`; see the module docstring."""
    return plan_epoch_detailed(lengths, cfg, epoch, rank, world_size).batches


# --------------------------------------------------------------------------------------------
# Measures (bench, tests, monitor)
# --------------------------------------------------------------------------------------------


def padding_efficiency(batches, lengths, pad_multiple: int) -> float:
    """Σ real tokens / Σ rows x padded length."""
    lengths = np.asarray(lengths, dtype=np.int64)
    real = padded = 0
    for b in batches:
        ls = lengths[np.asarray(b, dtype=np.int64)]
        real += int(ls.sum())
        padded += len(b) * int(_round_up(int(ls.max()), pad_multiple))
    return real / padded if padded else 1.0


def bucket_entropy(bucket_ids_of_batches, num_buckets: int, window: int = 64) -> float:
    """Mean over sliding windows (stride 1) of H(p) / ln K, p = share of batches per bucket.

    1 = every window mixes all buckets evenly; 0 = every window holds one bucket. With fewer
    batches than `window`, the single window of all batches is used.
    """
    ids = np.asarray(bucket_ids_of_batches, dtype=np.int64)
    k = int(num_buckets)
    if k <= 1 or len(ids) == 0:
        return 1.0
    w = min(window, len(ids))
    onehot = np.zeros((len(ids) + 1, k), dtype=np.int64)
    onehot[np.arange(1, len(ids) + 1), ids] = 1
    csum = np.cumsum(onehot, axis=0)
    counts = csum[w:] - csum[:-w]  # [num_windows, K]
    p = counts / w
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
    return float(h.mean() / np.log(k))


def plan_skipping(
    lengths,
    batching_cfg: BatchingConfig,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    skip_samples=None,
) -> EpochPlan:
    """`plan_epoch_detailed` over the samples not in `skip_samples` (dataset indices).

    Used for the first epoch of a run resumed on another world size: the rest of the epoch is
    planned over the samples no rank has trained yet, so none is lost and none is doubled."""
    if not skip_samples:
        return plan_epoch_detailed(lengths, batching_cfg, epoch, rank, world_size)
    lengths = np.asarray(lengths, dtype=np.int64)
    keep = np.setdiff1d(np.arange(len(lengths)), np.asarray(list(skip_samples), dtype=np.int64))
    sub = plan_epoch_detailed(lengths[keep], batching_cfg, epoch, rank, world_size)
    sub.batches = [keep[np.asarray(b, dtype=np.int64)].tolist() for b in sub.batches]
    return sub
