"""Tapped target features kept in host memory per sample, so later epochs skip the target.

The target is frozen: a sample's tapped features are the same in every epoch. On a CPU the
target forward costs as much as the drafter step (SmolLM2-135M on one core: ~330 tokens/s), so
a small data set trained for many epochs spends half its compute recomputing what it already
had. With `pipeline.feature_cache_gb` > 0 the target worker keeps each sample's features (and
the final hidden states when the objective needs them) after its first forward, up to the byte
budget, and a batch whose samples are all cached is assembled from host memory instead: the
first epoch runs the target, later ones only the drafter. Nothing touches disk.

Batches are re-formed every epoch (bucketed shuffles), so entries are per sample, unpadded
([length, D]), and a cached batch is padded again (zeros: padded positions are never anchors
nor visible context, see TargetStep). CPU only: on a GPU the features of a real target do not
fit in host memory for real data, and copying them back would cost more than recomputing.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from dflash_trainer.pipeline.messages import Batch


class FeatureCache:
    """sample id -> (features [L, D], final hidden [L, H] or None), up to `budget_bytes`.

    Shared by every target worker of a process (lookups and stores under one lock)."""

    def __init__(self, lengths, budget_bytes: int):
        self.lengths = np.asarray(lengths)
        self.budget_bytes = int(budget_bytes)
        self.used_bytes = 0
        self.full = False  # a sample did not fit: some batches will always run the target
        self.hits = 0  # batches served from the cache
        self.misses = 0  # batches that ran the target
        self._store: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._store)

    def summary(self) -> str:
        total = self.hits + self.misses
        return (
            f"feature cache: {len(self)} samples, {self.used_bytes / 2**30:.2f} of "
            f"{self.budget_bytes / 2**30:.2f} GiB; {self.hits} of {total} batches served from "
            "it" + (" (budget reached: raise pipeline.feature_cache_gb)" if self.full else "")
        )

    def lookup(self, batch: Batch, final: bool):
        """(features [B, S, D], final [B, S, H] or None) when every sample of `batch` is
        cached (with final hidden states if `final`), else None."""
        ids = batch.sample_ids.tolist()  # a CPU tensor: no device read
        with self._lock:
            entries = [self._store.get(i) for i in ids]
            hit = all(e is not None and (e[1] is not None or not final) for e in entries)
            self.hits += hit
            self.misses += not hit
        if not hit:
            return None
        B, S = batch.input_ids.shape
        got = [e for e in entries if e is not None]  # all of them (a hit)
        feats = _pad([e[0] for e in got], B, S)
        return feats, (_pad([e[1] for e in got if e[1] is not None], B, S) if final else None)

    def store(self, batch: Batch, feats: torch.Tensor, final: torch.Tensor | None) -> None:
        """Keep each new sample's rows [:length] of `feats` (and `final`), while they fit."""
        per_token = feats.shape[-1] * feats.element_size()
        if final is not None:
            per_token += final.shape[-1] * final.element_size()
        for row, i in enumerate(batch.sample_ids.tolist()):
            n = int(self.lengths[i])
            with self._lock:
                if i in self._store:
                    continue
                if self.used_bytes + n * per_token > self.budget_bytes:
                    self.full = True
                    continue
                self.used_bytes += n * per_token
                entry = (
                    feats[row, :n].clone(),
                    final[row, :n].clone() if final is not None else None,
                )
                self._store[i] = entry


def _pad(rows: list[torch.Tensor], B: int, S: int) -> torch.Tensor:
    out = rows[0].new_zeros(B, S, rows[0].shape[-1])
    for r, x in enumerate(rows):
        out[r, : x.shape[0]] = x
    return out
