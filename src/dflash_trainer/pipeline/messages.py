"""What travels on the pipeline's queues.

    prefetcher --WorkItem--> work_q --> target worker --HiddenBatch--> hs_q --> drafter worker

Control messages share the queues with data: `EpochEnd` (the prefetcher has queued a whole
epoch), `End` (a producer finished normally; a stage that ends without one has failed) and
`StageFailure` (an exception, carried as a value to the supervisor).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Batch:
    """A right-padded batch of tokenized conversations (CPU, pinned when CUDA is in use)."""

    input_ids: torch.Tensor  # [B, S] long
    loss_mask: torch.Tensor  # [B, S] bool: assistant tokens
    sample_ids: torch.Tensor  # [B] long: index into the dataset (sample ledger)
    num_real_tokens: int  # unpadded tokens, computed on CPU before any H2D
    # [B] int64 (numpy, host): positions that can anchor a block in each row (a supervised token
    # whose successor is supervised too), counted while the batch is built, so the drafter step
    # computes only the blocks a batch can fill (train/objective.py step_anchors) reading no
    # tensor on the host
    anchor_counts: np.ndarray | None = None

    @property
    def num_padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def pin_memory(self) -> Batch:
        return Batch(
            self.input_ids.pin_memory(),
            self.loss_mask.pin_memory(),
            self.sample_ids,
            self.num_real_tokens,
            self.anchor_counts,
        )


@dataclass
class WorkItem:
    seq_no: int  # position in the epoch's batch stream (for exact resume)
    epoch: int
    batch: Batch
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)


@dataclass
class HiddenBatch:
    """Target output handed to the drafter device.

    `ready_event` is recorded on the producer's stream after the last write to `features`; the
    consumer's stream waits on it before reading. The producer holds nothing afterwards: this
    object owns the memory until the drafter step that consumes it has been enqueued, and the
    consumer calls `record_stream` for its own stream (pipeline/steps.py DrafterStep), so the
    allocator cannot reuse it early. On CPU `ready_event` is None and the same code path runs.
    """

    seq_no: int
    epoch: int
    input_ids: torch.Tensor  # [B, S] on the drafter device
    loss_mask: torch.Tensor  # [B, S] bool on the drafter device
    features: torch.Tensor  # [B, S, n*H] on the drafter device
    sample_ids: torch.Tensor  # [B] CPU
    num_real_tokens: int
    ready_event: torch.cuda.Event | None = None
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    # [B, S, H] the target's final normed hidden states, only for logit distillation
    target_hidden: torch.Tensor | None = None
    # assembled from the feature cache (pipeline/feature_cache.py): the target did not run
    from_cache: bool = False
    anchor_counts: np.ndarray | None = None  # [B] host: Batch.anchor_counts

    @classmethod
    def of(
        cls,
        item: WorkItem,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        features: torch.Tensor,
        target_hidden: torch.Tensor | None,
        ready_event: torch.cuda.Event | None,
    ) -> HiddenBatch:
        """The hand-off of `item`'s batch: its tensors as they are on the drafter device, its
        host-side facts (sample ids, token and anchor counts) as the batch holds them."""
        b = item.batch
        return cls(
            seq_no=item.seq_no,
            epoch=item.epoch,
            input_ids=input_ids,
            loss_mask=loss_mask,
            features=features,
            sample_ids=b.sample_ids,
            num_real_tokens=b.num_real_tokens,
            ready_event=ready_event,
            target_hidden=target_hidden,
            anchor_counts=b.anchor_counts,
        )


@dataclass
class EpochEnd:
    epoch: int
    num_batches: int


@dataclass
class End:
    producer: str


@dataclass
class StageFailure:
    stage: str
    exc: BaseException
    tb: str

    @classmethod
    def capture(cls, stage: str, exc: BaseException) -> StageFailure:
        return cls(stage, exc, "".join(traceback.format_exception(exc)))
