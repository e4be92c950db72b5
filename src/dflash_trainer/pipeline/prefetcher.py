"""BatchPrefetcher: the CPU thread that plans epochs and feeds `work_q` with padded batches.

    for epoch in [start_epoch, epochs):
        plan_epoch(lengths, cfg, epoch, rank, world_size)       (pure, deterministic)
        for seq_no in plan (from start_seq_no in the first epoch):
            build Batch (right-padded, pinned if asked) -> work_q.put(WorkItem, stop)
        work_q.put(EpochEnd(epoch, n_batches))
    work_q.put(End("prefetch"))

Consumes: the tokenized dataset (in memory). Waits for: room in `work_q` (bounded; polls `stop`).
Unblocked by: a consumer taking an item, or `stop` being set (then `Stopped` ends the thread
quietly). The `failures` channel (the supervisor's events queue, or a callable) gets exactly one
message when the thread ends: `End(name)` after a normal end or a stop, or
`StageFailure.capture("prefetch", e)` for any other exception (then no End goes to work_q).

Position: the prefetcher runs ahead of training, so its own progress is not the resume point.
The step loop records the seq_nos of the current epoch it has trained (TrainState.consumed, in
checkpoints); `checkpoint.contiguous_prefix` turns them into the `start` (epoch, seq_no) of a
new prefetcher, which then yields exactly the rest of the uninterrupted stream.

Counters (single writer = this thread; the monitor only reads): `counters` (WorkerCounters) and
the batch-composition fields read through `composition()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import numpy as np
import torch

from dflash_trainer.config import BatchingConfig
from dflash_trainer.data.batching import (
    EpochPlan,
    bucket_edges,
    bucket_entropy,
    plan_skipping,
)
from dflash_trainer.pipeline.messages import Batch, End, EpochEnd, WorkItem
from dflash_trainer.pipeline.stage import Stage

log = logging.getLogger(__name__)


def build_batch(dataset, indices, pad_multiple: int, pad_id: int) -> Batch:
    """Right-padded CPU batch of dataset rows `indices` (padded length rounded to pad_multiple)."""
    lens = dataset.lengths[indices]
    s = int(-(-int(lens.max()) // pad_multiple) * pad_multiple)
    b = len(indices)
    ids = np.full((b, s), pad_id, dtype=np.int64)
    mask = np.zeros((b, s), dtype=np.bool_)
    for r, i in enumerate(indices):
        n = int(lens[r])
        ids[r, :n] = dataset.input_ids[i]
        mask[r, :n] = dataset.loss_mask[i]
    return Batch(
        torch.from_numpy(ids),
        torch.from_numpy(mask),
        torch.as_tensor(np.asarray(indices, dtype=np.int64)),
        int(lens.sum()),
        (mask[:, :-1] & mask[:, 1:]).sum(1).astype(np.int64),
    )


class BatchPrefetcher(Stage):
    role = "prefetch"

    def __init__(
        self,
        dataset,
        batching_cfg: BatchingConfig,
        work_q,
        stop: threading.Event,
        failures,
        epochs: int,
        rank: int = 0,
        world_size: int = 1,
        pin_memory: bool = False,
        start: tuple[int, int] = (0, 0),
        history: int = 256,
        name: str = "prefetch",
        skip_samples=None,
        faults=None,
    ):
        # failures: the supervisor's events queue, or a callable (Stage.report)
        super().__init__(name, events=failures, stop=stop, faults=faults)
        self.dataset = dataset
        self.cfg = batching_cfg
        self.work_q = work_q
        self.epochs = int(epochs)
        self.rank, self.world_size = int(rank), int(world_size)
        # Pinning needs a CUDA runtime; on CPU-only machines it is a no-op by design.
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.start_position = (int(start[0]), int(start[1]))
        # Sample ids the first epoch (start[0]) leaves out; start[1] counts batches of that
        # reduced plan (see plan_skipping).
        self.skip_samples = list(skip_samples) if skip_samples else None
        self.pad_id = int(dataset.pad_id)
        # Batch composition (single writer: this thread).
        # Edges depend only on the lengths and the config, so they are fixed for the run.
        self.num_buckets = len(bucket_edges(dataset.lengths, batching_cfg)) + 1
        self.bucket_batches: list[int] = [0] * self.num_buckets
        self.recent: deque = deque(maxlen=history)  # (bucket, rows, real, padded, max_len)
        self.recent_lengths: deque = deque(maxlen=history * 16)
        self.dropped_batches = 0
        self.dropped_samples = 0

    # ---- planning ----
    def plan(self, epoch: int) -> EpochPlan:
        skip = self.skip_samples if epoch == self.start_position[0] else None
        return plan_skipping(
            self.dataset.lengths, self.cfg, epoch, self.rank, self.world_size, skip
        )

    # ---- thread body (Stage.run reports its end or failure) ----
    def loop(self) -> None:
        start_epoch, start_seq = self.start_position
        c = self.counters
        for epoch in range(start_epoch, self.epochs):
            plan = self.plan(epoch)
            self.dropped_batches += plan.dropped_batches
            self.dropped_samples += plan.dropped_samples
            first = start_seq if epoch == start_epoch else 0
            for seq_no in range(first, len(plan.batches)):
                self.check_fault("prefetch", c.steps)
                c.begin_busy(time.perf_counter_ns())
                idx = plan.batches[seq_no]
                batch = build_batch(self.dataset, idx, self.cfg.pad_multiple, self.pad_id)
                if self.pin_memory:
                    batch = batch.pin_memory()
                item = WorkItem(seq_no, epoch, batch)
                t1 = time.perf_counter_ns()
                c.end_busy(t1)
                self.work_q.put(item, self.stop)
                c.wait_out_ns += time.perf_counter_ns() - t1
                self._count(plan.buckets[seq_no], batch, idx)
            self.work_q.put(EpochEnd(epoch, len(plan.batches)), self.stop)
            log.info("epoch %d fully queued (%d batches)", epoch, len(plan.batches))
        self.work_q.put(End("prefetch"), self.stop)

    def _count(self, bucket: int, batch: Batch, idx) -> None:
        c = self.counters
        rows, padded = len(idx), batch.num_padded_tokens
        c.steps += 1
        c.items += rows
        c.tokens += batch.num_real_tokens
        c.padded_tokens += padded
        c.beat()
        if bucket < self.num_buckets:
            self.bucket_batches[bucket] += 1
        lens = self.dataset.lengths[idx]
        self.recent.append((bucket, rows, batch.num_real_tokens, padded, int(lens.max())))
        self.recent_lengths.extend(lens.tolist())

    # ---- monitor side (reads only) ----
    def composition(self) -> dict[str, float]:
        """Batch-composition metrics over the recent window (observability.md §7.5)."""
        recent = list(self.recent)  # one C-level copy; safe against the writer
        lens = np.asarray(list(self.recent_lengths), dtype=np.float64)
        if not recent:
            return {}
        arr = np.asarray(recent, dtype=np.float64)
        buckets = arr[:, 0].astype(np.int64)
        out = {
            "batch/seqs": float(arr[:, 1].mean()),
            "batch/tokens_real": float(arr[:, 2].mean()),
            "batch/tokens_padded": float(arr[:, 3].mean()),
            "batch/padding_eff": float(arr[:, 2].sum() / max(arr[:, 3].sum(), 1.0)),
            "batch/bucket_entropy": bucket_entropy(
                buckets, self.num_buckets, window=min(64, len(buckets))
            ),
        }
        if len(lens):
            out.update(
                {
                    "batch/len_mean": float(lens.mean()),
                    "batch/len_p50": float(np.percentile(lens, 50)),
                    "batch/len_p95": float(np.percentile(lens, 95)),
                    "batch/len_max": float(lens.max()),
                }
            )
        frac = np.bincount(buckets, minlength=self.num_buckets) / len(buckets)
        for k in range(self.num_buckets):
            out[f"batch/bucket/{k}_frac"] = float(frac[k])
        return out
