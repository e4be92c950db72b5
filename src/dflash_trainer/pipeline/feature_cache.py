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

Captured while generating (`CapturedFeatures`, `pipeline.capture_features`): when the project's
decode loop writes the training answers (data/generate.py, engine project), the target computes the
taps of prompt + answer anyway (`decode(..., keep_features=True)`); they are kept, keyed by the
exact token ids they were computed on, and `FeatureCache.adopt` gives them to the training
samples whose ids match, so the first epoch runs the target only for the others. A sample
matches only when its ids up to and including its last supervised token are exactly the
captured ids (decode -> text -> chat template -> ids can differ: a skipped special token, a
merge across the answer's first character); what follows that token (ChatML's "\n" after
`<|im_end|>`) has no captured features and is left zero like batch padding: the objective never
reads it (context is kv < anchor, anchors and valid labels need a supervised successor, and a
teacher state with a valid label sits before the last supervised token).
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from dflash_trainer.config import Config
from dflash_trainer.pipeline.messages import Batch
from dflash_trainer.train.objective import needs_final_hidden

log = logging.getLogger(__name__)


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
        # adopt(): samples given the features captured while generating / left to the target
        self.captured: int | None = None
        self.capture_misses = 0
        self._store: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._store)

    def summary(self) -> str:
        total = self.hits + self.misses
        return (
            f"feature cache: {len(self)} samples, {self.used_bytes / 2**30:.2f} of "
            f"{self.budget_bytes / 2**30:.2f} GiB; {self.hits} of {total} batches served from "
            "it"
            + (
                f"; {self.captured} samples captured while generating, {self.capture_misses} "
                "prefilled"
                if self.captured is not None
                else ""
            )
            + (" (budget reached: raise pipeline.feature_cache_gb)" if self.full else "")
        )

    def adopt(self, dataset, captured: CapturedFeatures, target, final: bool, dtype) -> None:
        """Give each sample of `dataset` (the training set this cache is indexed by) the
        features `captured` holds for its exact ids through its last supervised token (module
        docstring), cast to `dtype` as TargetStep casts the target's output (elementwise: the
        same values). Used only when they are what training's `target` would compute: its
        dtype and taps, and no final hidden states needed (`final`: KD, hidden regression,
        label_source=target; generation does not keep them). Empties `captured`."""
        why = captured.unusable(target, final)
        if why:
            log.info("feature capture: not used (%s); the first epoch runs the target", why)
            captured.clear()
            return
        self.captured = 0
        for i, (ids, mask) in enumerate(zip(dataset.input_ids, dataset.loss_mask)):
            sup = np.flatnonzero(mask)
            feats = captured.get(ids[: int(sup[-1]) + 1]) if len(sup) else None
            if feats is None:
                self.capture_misses += 1
                continue
            feats = feats.to(dtype)
            size = feats.numel() * feats.element_size()
            with self._lock:
                if self.used_bytes + size > self.budget_bytes:
                    self.full = True
                    self.capture_misses += 1
                    continue
                self.used_bytes += size
                self._store[i] = (feats, None)
            self.captured += 1
        log.info(
            "feature capture: %d of %d training samples take the features computed while "
            "generating; %d run the target in the first epoch (their ids differ from the "
            "generated ones, or they were not generated here)",
            self.captured,
            len(dataset),
            self.capture_misses,
        )
        captured.clear()

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


class CapturedFeatures:
    """Taps the target computed while writing answers (data/generate.py, engine project): exact
    token ids (prompt + answer, stop id included) -> features [len(ids), n*H], in the dtype and taps
    of the target that wrote them, up to `budget_bytes` (pipeline.feature_cache_gb). Handed to
    the training run's FeatureCache by `FeatureCache.adopt`, which empties it."""

    def __init__(self, budget_bytes: int, dtype: torch.dtype, layer_ids):
        self.budget_bytes = int(budget_bytes)
        self.dtype = dtype
        self.layer_ids = list(layer_ids)
        self.used_bytes = 0
        self.full = False  # an answer did not fit: training prefills it
        self._store: dict[bytes, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._store)

    @staticmethod
    def _key(ids) -> bytes:
        return np.asarray(ids, dtype=np.int64).tobytes()  # exact: dict keys compare every byte

    def add(self, ids, features: torch.Tensor) -> None:
        """Keep the taps `features` [len(ids), D] of `ids`, while they fit."""
        if features.shape[0] != len(ids) or features.dtype != self.dtype:
            raise ValueError(
                f"captured features {tuple(features.shape)} {features.dtype} do not belong to "
                f"{len(ids)} ids in {self.dtype}"
            )
        size = features.numel() * features.element_size()
        if self.used_bytes + size > self.budget_bytes:
            self.full = True
            return
        self.used_bytes += size
        self._store[self._key(ids)] = features.detach()

    def get(self, ids) -> torch.Tensor | None:
        return self._store.get(self._key(ids))

    def clear(self) -> None:
        self._store.clear()
        self.used_bytes = 0

    def unusable(self, target, final: bool) -> str:
        """Why training's `target` cannot take these features ('' = it can)."""
        if final:
            return (
                "the objective also needs the target's final hidden states (KD, hidden "
                "regression or label_source=target), which generation does not keep"
            )
        if target.dtype != self.dtype:
            return f"generated in {self.dtype}, training's target computes in {target.dtype}"
        if list(target.layer_ids) != self.layer_ids:
            return f"generated with taps {self.layer_ids}, training taps {target.layer_ids}"
        return ""


def capture_for(cfg: Config, target) -> CapturedFeatures | None:
    """Where the run's data is written by its own target: the store that keeps the taps
    computed while generating (pipeline.capture_features), or None where they would not be
    used: capture off, no feature cache, not a CPU run, or an objective that also needs the
    target's final hidden states."""
    p, d = cfg.pipeline, cfg.objective
    devices = [torch.device(x) for x in (*p.target_devices, p.drafter_device)]
    if not p.capture_features or p.feature_cache_gb <= 0 or any(x.type != "cpu" for x in devices):
        return None
    if needs_final_hidden(d.kd_weight, d.hidden_weight, d.label_source):
        return None
    return CapturedFeatures(int(p.feature_cache_gb * 2**30), target.dtype, target.layer_ids)


def _pad(rows: list[torch.Tensor], B: int, S: int) -> torch.Tensor:
    out = rows[0].new_zeros(B, S, rows[0].shape[-1])
    for r, x in enumerate(rows):
        out[r, : x.shape[0]] = x
    return out
