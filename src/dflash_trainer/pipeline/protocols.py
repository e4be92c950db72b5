"""The seams of the training pipeline, typed: what a stage calls, and what it is handed.

`TargetStepFn` and `DrafterStepFn` are the two step functions every schedule shares
(pipeline/steps.py implements them); `Objective` is the drafter's loss (train/objective.py
DFlashObjective); `Target` is the surface of the frozen target that the pipeline and the run
use (models/target.py TargetModel, or a test double with the same attributes). Static types
only: nothing here runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from dflash_trainer.observe.profile import StepMeter, StepTimer
from dflash_trainer.pipeline.messages import HiddenBatch, WorkItem
from dflash_trainer.train.objective import StepOutput


class Target(Protocol):
    """A frozen HF causal LM with hooks on its tapped decoder layers."""

    model: Any  # the transformers PreTrainedModel
    tokenizer: Any
    layer_ids: list[int]  # the tapped decoder layers, 0-based
    hidden_size: int  # of its decoder layers (a tap's width)
    device: torch.device
    dtype: torch.dtype
    embed_weight: torch.Tensor  # shared with the drafter, frozen
    lm_head: Any  # nn.Module: shared with the drafter, frozen

    @property
    def layers(self) -> nn.ModuleList: ...

    @property
    def takes_4d_mask(self) -> bool: ...

    def features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        final: bool = False,
    ) -> Any:
        """[B,S,n*H] tapped features; with `final`, (features, [B,S,H] final hidden states)."""
        ...

    def check_taps(
        self,
        features_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        seq_len: int = 32,
        seed: int = 0,
        attention_mask: torch.Tensor | None = None,
    ) -> float: ...


class TargetStepFn(Protocol):
    """One batch through the target: H2D, tapped forward, hand-off to the drafter device."""

    target: Target
    timer: StepTimer  # its GPU time (CUDA), read by the monitor through the worker's counters

    def __call__(self, item: WorkItem, meter: StepMeter | None = None) -> HiddenBatch: ...


class DrafterStepFn(Protocol):
    """One micro-batch of drafter training; True when it completed an optimizer step."""

    timer: StepTimer  # its GPU time (CUDA), read by the monitor through the worker's counters

    def __call__(self, hb: HiddenBatch, step: int, meter: StepMeter | None = None) -> bool: ...

    def query_tokens(self, hb: HiddenBatch) -> int:
        """Block tokens of `hb` that hold an anchor: what the drafter's FLOPs count."""
        ...


class Objective(Protocol):
    """The drafter's loss on one batch of target features (train/objective.py)."""

    @property
    def metric_names(self) -> Sequence[str]:
        """The order of StepOutput.metrics."""
        ...

    @property
    def needs_target_hidden(self) -> bool: ...

    def step_anchors(self, anchor_counts: np.ndarray | None) -> int:
        """Blocks per row for a batch whose rows have `anchor_counts` anchor positions."""
        ...

    def query_tokens(self, anchor_counts: np.ndarray | None, rows: int) -> int:
        """Block tokens of such a batch that hold an anchor (the rest are padding)."""
        ...

    def __call__(
        self,
        drafter: nn.Module,
        embed_weight: torch.Tensor,
        lm_head: nn.Module,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        generator: torch.Generator | None = None,
        target_hidden: torch.Tensor | None = None,
        num_anchors: int | None = None,
        preferred: torch.Tensor | None = None,
        preferred_count: int = 0,
        want_next_starts: bool = False,
    ) -> StepOutput: ...


class StepHooks(Protocol):
    """What the drafter's step loop runs between optimizer steps (run/hooks.py RunHooks)."""

    votes: bool  # torchrun: stop_vote is a collective every rank runs after every step

    def on_step_end(self, step: int) -> None:
        """After optimizer step `step`: periodic checkpoint and evaluation."""
        ...

    def stop_vote(self) -> bool:
        """True = every rank stops after this step (called only where `votes`)."""
        ...
