"""What the drafter's device will hold, known before the first step: the memory plan.

Exact where it can be counted (parameters, AdamW state, features in flight, a target on the same
device), measured where it cannot: the step's peak of gradients, activations and temporaries
comes from running one drafter step's objective forward and backward in torch's FakeTensorMode,
counting the bytes of the storages it makes while they live (LiveBytes). Fake tensors carry
shapes and dtypes and no storage: the step costs no memory at any shape, a Qwen3-8B drafter's
included, and the figure is what the allocator sees of the same step run for real
(tests/test_memory_plan.py: equal to the CPU allocator's measured peak).

The largest batch: batching.max_batch_size rows of batching.max_tokens / rows tokens (at most
data.max_length), every row with objective.num_anchors valid blocks: activations grow with rows x
anchors (the blocks) and rows x tokens (the context), and this shape maximises both under the
token budget. It is measured on one and two rows (and on one row at half the anchors: what one
row x anchor block costs) and extended to the rows.

The training attention is planned as `split` (models/attention.py): flash-style like `flex` on
CUDA (output and log-sum-exp kept for backward, chunked temporaries), and it runs in fake mode
where flex would compile.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dflash_trainer.config import Config
from dflash_trainer.errors import UserError
from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter
from dflash_trainer.models.packed_linear import FrozenMatmuls
from dflash_trainer.train.objective import DFlashObjective, chunk_blocks_for

log = logging.getLogger(__name__)

GiB = 1 << 30
# A plan above this share of the device is refused: the caching allocator's fragmentation and
# the CUDA context need the rest.
HEADROOM = 0.92
# The fake step runs the split attention in chunks this many times larger (fewer ops to replay);
# the plan counts the larger chunk temporaries (tens of MiB more than the run holds).
PLAN_CHUNK_SCALE = 16


@dataclass
class MemoryPlan:
    """Bytes the drafter's device holds at the peak of a training step, by owner."""

    device: str
    rows: int  # the planned batch: rows x tokens, num_anchors blocks per row
    tokens: int
    anchors: int
    parameters: int  # the drafter's trainable parameters
    frozen: int  # the target's embedding and LM head as the drafter uses them (+ packed copies)
    optimizer: int  # AdamW's two moments (+ step counters)
    step_peak: int  # gradients + activations + temporaries at the step's peak (measured)
    per_block: int  # activation bytes of one row x anchor block (measured)
    features: int  # hand-off batches resident: the queue's, the one in use, the one arriving
    target: int  # target workers on this device: weights, tapped features, causal mask
    feature_cache: int  # host memory the feature cache may take (CPU drafters)
    capacity: int  # the device's memory (0 = unknown)

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.frozen
            + self.optimizer
            + self.step_peak
            + self.features
            + self.target
            + self.feature_cache
        )

    def lines(self) -> list[str]:
        def gib(n: int) -> str:
            return f"{n / GiB:.2f} GiB"

        cap = (
            f" of {gib(self.capacity)} ({self.total / self.capacity:.0%})" if self.capacity else ""
        )
        out = [
            f"memory plan on {self.device}: {gib(self.total)}{cap} at the largest batch "
            f"({self.rows} rows x {self.tokens} tokens, {self.anchors} anchors per row)",
            f"  drafter parameters {gib(self.parameters)}, frozen embedding + LM head "
            f"{gib(self.frozen)}, AdamW state {gib(self.optimizer)}",
            f"  step peak (gradients, activations, temporaries; measured) {gib(self.step_peak)}: "
            f"{self.per_block / (1 << 20):.2f} MiB per row x anchor block",
            f"  features in flight {gib(self.features)}"
            + (f", target on this device {gib(self.target)}" if self.target else "")
            + (f", feature cache (host) {gib(self.feature_cache)}" if self.feature_cache else ""),
        ]
        return out

    def record(self) -> dict[str, float]:
        """The plan as one metrics event (mem/plan_*; docs/design/observability.md §7.6)."""
        return {
            "mem/plan_gib": self.total / GiB,
            "mem/plan_step_peak_gib": self.step_peak / GiB,
            "mem/plan_block_mib": self.per_block / (1 << 20),
            "mem/capacity_gib": self.capacity / GiB,
        }

    def check(self, mode: str) -> None:
        """Refuse (mode "refuse") or warn ("warn") where the plan exceeds HEADROOM of the
        device, naming the knobs of its largest parts."""
        if mode == "off" or not self.capacity or self.total <= HEADROOM * self.capacity:
            return
        knobs = [
            (
                self.step_peak,
                f"the step peak ({self.step_peak / GiB:.1f} GiB): objective.num_anchors "
                f"(now {self.anchors}; {self.per_block / (1 << 20):.1f} MiB per row x anchor) or "
                f"batching.max_batch_size (now {self.rows} rows)",
            ),
            (
                self.features,
                f"features in flight ({self.features / GiB:.1f} GiB): pipeline.hs_queue_size or "
                "batching.max_tokens",
            ),
            (
                self.target,
                f"the target on this device ({self.target / GiB:.1f} GiB): put the target "
                "workers on other devices (pipeline.target_devices)",
            ),
            (
                self.feature_cache,
                f"the feature cache ({self.feature_cache / GiB:.1f} GiB): "
                "pipeline.feature_cache_gb",
            ),
        ]
        ranked = [what for size, what in sorted(knobs, key=lambda k: -k[0]) if size]
        msg = (
            f"the run would need {self.total / GiB:.1f} GiB on {self.device}, more than "
            f"{HEADROOM:.0%} of its {self.capacity / GiB:.1f} GiB. Lower "
            + "; or ".join(ranked[:2])
            + ". (pipeline.memory_plan=warn runs anyway.)\n"
            + "\n".join(self.lines())
        )
        if mode == "refuse":
            raise UserError(msg)
        log.warning(msg)


def planned_shape(cfg: Config) -> tuple[int, int]:
    """(rows, tokens per row) of the largest batch the batching settings allow."""
    b = cfg.batching
    rows = max(1, b.max_batch_size)
    tokens = min(cfg.data.max_length, max(1, b.max_tokens // rows))
    return rows, tokens


def step_peaks(
    objective: DFlashObjective,
    dcfg: DFlashConfig,
    vocab_size: int,
    device: torch.device,
    autocast: bool,
    dtypes: tuple[torch.dtype, torch.dtype],
    tokens: int,
    shapes: list[tuple[int, int]],
) -> list[int]:
    """For each (rows, anchors) of `shapes`: gradients + activations + temporaries at the peak
    of one drafter step's forward and backward on rows x `tokens`, measured by running them on
    fake tensors under LiveBytes (one fake drafter for all). `dtypes`: (the frozen embedding and
    LM head's, the features'), as the run has them. (AdamW's step adds its state, counted
    exactly by plan_memory, and small fused temporaries.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dflash_trainer.models.attention import coarser_split_chunks

    dcfg = dataclasses.replace(dcfg, attention="split")
    H = dcfg.hidden_size
    head_dtype, feature_dtype = dtypes
    peaks = []
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device(device):
        drafter = DFlashDrafter(dcfg)
        embed = torch.empty(vocab_size, H, dtype=head_dtype)
        head = torch.nn.Linear(H, vocab_size, bias=False, dtype=head_dtype).requires_grad_(False)
        generator = torch.Generator(device=device)
        for rows, anchors in shapes:
            step = copy.copy(objective)  # the run's own objective (settings only), at `anchors`
            step.num_anchors = anchors
            feats = torch.empty(rows, tokens, len(dcfg.target_layer_ids) * H, dtype=feature_dtype)
            ids = torch.zeros(rows, tokens, dtype=torch.long)
            mask = torch.ones(rows, tokens, dtype=torch.bool)
            final = (  # the target's final hidden states, where the objective reads them (KD)
                torch.empty(rows, tokens, H, dtype=feature_dtype)
                if step.needs_target_hidden
                else None
            )
            with LiveBytes() as live, coarser_split_chunks(PLAN_CHUNK_SCALE):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    out = step(drafter, embed, head, feats, ids, mask, generator, final)
                out.loss.backward()
                del out
            drafter.zero_grad(set_to_none=True)
            peaks.append(live.peak)
    return peaks


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensor storages made inside it that are alive, and their peak: what an
    allocator must hold for the code run inside (tensors made before it are not counted). A
    storage is counted once however many tensors view it, and leaves the count when it is
    freed (a weak reference's callback). Fake tensors count as their real selves would."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._known: dict[int, weakref.ref] = {}  # id(storage) -> a reference that frees it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # an output that shares an input's storage (a view, an in-place op, out=, a no-op cast)
        # made no memory; any other output storage is new
        inputs = {
            id(t.untyped_storage())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:
                self._count(t.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._known and self._known[key]() is storage:
            return
        size = storage.nbytes()

        def freed(_ref: weakref.ref, key: int = key, size: int = size) -> None:
            self.live -= size
            self._known.pop(key, None)

        self._known[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(self.peak, self.live)


# CPU bf16 kernels keep buffers of their own that dispatch-level tracking cannot see: oneDNN's
# bf16 LM-head matmul writes its [rows, vocab] output through an fp32 buffer. Measured against the
# CPU allocator (tests/test_memory_plan.py; the same with and without native bf16): 3.4-3.8 bytes
# per logit element of the LM head's chunk, i.e. one fp32 copy of the chunk's logits.
CPU_BF16_WORKSPACE_BYTES = 4


def cpu_bf16_workspace(objective: DFlashObjective, rows: int, anchors: int, vocab: int) -> int:
    """The CPU bf16 kernels' own buffers at the LM head: CPU_BF16_WORKSPACE_BYTES per logit
    of the largest chunk (train/objective.py chunk_blocks_for)."""
    slots = objective.loss_slots
    chunk = objective.chunk_blocks or chunk_blocks_for(vocab, "cpu", rows, slots)
    return CPU_BF16_WORKSPACE_BYTES * rows * min(anchors, chunk) * slots * vocab


def device_capacity(device: torch.device) -> int:
    """Bytes of memory `device` has: a GPU's total, a CPU's MemTotal (0 = unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def plan_memory(
    cfg: Config,
    drafter: DFlashDrafter,
    objective: DFlashObjective,
    vocab_size: int,
    device: torch.device,
    autocast: bool,
    feature_dtype: torch.dtype,
    head_dtype: torch.dtype,
    target_bytes: int = 0,
    world_size: int = 1,
    data_tokens: int | None = None,
) -> MemoryPlan:
    """The plan of this run's drafter device. `feature_dtype` / `head_dtype`: the hand-off's
    features' and the frozen embedding and LM head's (run/build.py). `target_bytes`: the
    weights of target workers on the same device (0: none there). `data_tokens`: the training
    set's tokens, which bound what the feature cache can hold (None: its whole budget)."""
    dcfg = drafter.config
    rows, tokens = planned_shape(cfg)
    anchors = cfg.objective.num_anchors
    params = [p for p in drafter.parameters() if p.requires_grad]
    n_bytes = sum(p.numel() * p.element_size() for p in params)
    optimizer = 2 * sum(p.numel() * 4 for p in params) + 4 * len(params)  # fp32 moments
    elem = torch.empty((), dtype=head_dtype).element_size()
    frozen = 2 * vocab_size * dcfg.hidden_size * elem  # embedding + LM head (untied worst case)
    # the loss's products through the frozen head on oneDNN's prepacked GEMM: two more copies
    frozen += FrozenMatmuls.copies_bytes(
        (vocab_size, dcfg.hidden_size), head_dtype, device, autocast
    )
    # A row's activations add up along the batch dimension; the chunked temporaries (attention,
    # LM head) are budgeted per chunk, whatever the rows. So one row and two rows give the slope
    # and the fixed part, and half the anchors on one row what a block costs. Fake steps on one or
    # two rows stay short.
    one, two, half = step_peaks(
        objective,
        dcfg,
        vocab_size,
        device,
        autocast,
        (head_dtype, feature_dtype),
        tokens,
        [(1, anchors), (2, anchors), (1, max(1, anchors // 2))],
    )
    per_block = max(0, one - half) // max(1, anchors - max(1, anchors // 2))
    peak = one + (rows - 1) * max(0, two - one)
    if autocast and device.type == "cpu":
        peak += cpu_bf16_workspace(objective, rows, anchors, vocab_size)
    if world_size > 1:  # DDP's gradient buckets: a second copy of the gradients
        peak += n_bytes
    width = len(dcfg.target_layer_ids) * dcfg.hidden_size
    if objective.needs_target_hidden:  # the final hidden states travel with the features
        width += dcfg.hidden_size
    feat_elem = torch.empty((), dtype=feature_dtype).element_size()
    one_batch = rows * tokens * (width * feat_elem + 8 + 1)  # features, ids, loss mask
    features = (cfg.pipeline.hs_queue_size + 2) * one_batch
    target = 0
    if target_bytes:
        mask = (-(-tokens // 64) * 64) ** 2 * elem  # the target step's one causal mask
        target = target_bytes + mask + rows * tokens * width * elem
    cache = int(cfg.pipeline.feature_cache_gb * GiB) if device.type == "cpu" else 0
    if data_tokens is not None:  # the cache holds at most every sample's features once
        cache = min(cache, data_tokens * width * feat_elem)
    return MemoryPlan(
        device=str(device),
        rows=rows,
        tokens=tokens,
        anchors=anchors,
        parameters=n_bytes,
        frozen=frozen,
        optimizer=optimizer,
        step_peak=peak,
        per_block=per_block,
        features=features,
        target=target,
        feature_cache=cache,
        capacity=device_capacity(device),
    )
