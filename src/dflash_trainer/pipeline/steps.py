"""The two step functions every schedule shares: target forward + hand-off, and drafter update.

Neither function reads a device value on the host. Scalars leave the drafter step through the
ScalarRing (non-blocking copy + event); the monitor reads them once ready.
"""

from __future__ import annotations

import contextlib

import torch

from dflash_trainer.observe.profile import StepMeter, StepTimer
from dflash_trainer.observe.scalars import ScalarRing
from dflash_trainer.pipeline.feature_cache import FeatureCache
from dflash_trainer.pipeline.messages import Batch, HiddenBatch, WorkItem
from dflash_trainer.pipeline.protocols import Objective, Target
from dflash_trainer.train.anchor_policy import AnchorPolicy
from dflash_trainer.train.optim import GuardedStep


def _is_cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda"


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class TargetStep:
    """H2D -> frozen tapped forward -> features handed off to the drafter device.

    Hand-off rule (ARCHITECTURE.md): on CUDA the work runs on this worker's own stream; an event is
    recorded after the last write (including the copy to the drafter device); the consumer waits on
    it and calls `record_stream` so the memory outlives the consumer's use. On CPU the same code
    runs with no streams and no events.
    """

    def __init__(
        self,
        target: Target,
        drafter_device: torch.device,
        feature_dtype: torch.dtype,
        final_hidden: bool = False,
        cache: FeatureCache | None = None,
    ):
        self.target = target
        self.cache = cache  # FeatureCache shared by the target workers, or None
        self.final_hidden = final_hidden  # also hand over the final hidden states (KD)
        self.device = torch.device(target.device)
        self.drafter_device = torch.device(drafter_device)
        self.feature_dtype = feature_dtype
        self.stream = torch.cuda.Stream(self.device) if _is_cuda(self.device) else None
        self._mask: torch.Tensor | None = None  # the longest length's; shorter ones slice it
        self.timer = StepTimer(self.device)

    def _causal_mask(self, seq_len: int) -> torch.Tensor | None:
        """[1, 1, S, S] additive causal mask (0 / dtype min). Additive, not boolean, so eager
        and SDPA attention read it the same way. One mask is kept, of the longest length seen
        (rounded up to 64), and shorter lengths get its top-left view: the upper-left S x S of
        a causal mask is the causal mask of S, and memory stays that of one mask however many
        lengths the batches have (a mask per length would reach GiBs at 8K tokens). None for
        flash / flex attention (target.attn_implementation): they are causal without a mask
        and fail on a tensor one."""
        if not self.target.takes_4d_mask:
            return None
        m = self._mask
        if m is None or m.shape[-1] < seq_len:
            n, dtype = -(-seq_len // 64) * 64, self.target.dtype
            m = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=self.device)
            self._mask = m = m.triu(1)[None, None]
        return m[..., :seq_len, :seq_len]

    def check(self) -> float:
        """The target's tap integrity check through this step's own capture path (the cached
        4-D causal mask included). Startup only."""
        n = 32  # the check's sequence length: the mask must be this length's
        mask = self._causal_mask(n)
        return self.target.check_taps(
            lambda ids: self.target.features(ids, mask), seq_len=n, attention_mask=mask
        )

    def __call__(self, item: WorkItem, meter: StepMeter | None = None) -> HiddenBatch:
        b: Batch = item.batch
        meter = meter if meter is not None else StepMeter()
        hit = self.cache.lookup(b, self.final_hidden) if self.cache is not None else None
        if hit is not None:
            meter.lap("cache")
            return HiddenBatch(
                seq_no=item.seq_no,
                epoch=item.epoch,
                input_ids=b.input_ids,
                loss_mask=b.loss_mask,
                features=hit[0],
                sample_ids=b.sample_ids,
                num_real_tokens=b.num_real_tokens,
                target_hidden=hit[1],
                from_cache=True,
                anchor_counts=b.anchor_counts,
            )
        with _on(self.stream):
            tok = self.timer.start(self.stream)
            ids = b.input_ids.to(self.device, non_blocking=True)
            meter.lap("h2d")
            # A plain causal mask on purpose: batches are right-padded, so under causal
            # attention no real token ever sees a pad, and pad positions are never anchors nor
            # visible context (kv < anchor <= last real token). Given a 2-D padding mask, or
            # none, HF inspects it on the host (`padding_mask.all()`, packed-sequence detection:
            # device syncs); a prepared 4-D mask is used as is.
            mask = self._causal_mask(ids.shape[1])
            if self.final_hidden:
                feats, final = self.target.features(ids, mask, final=True)
            else:  # the two-argument call: targets wrapped by users need not know `final`
                feats, final = self.target.features(ids, mask), None
            meter.lap("forward")
            feats = feats.to(self.drafter_device, dtype=self.feature_dtype, non_blocking=True)
            if final is not None:
                final = final.to(self.drafter_device, dtype=self.feature_dtype, non_blocking=True)
            if self.cache is not None:  # CPU only (checked at build): no device read
                self.cache.store(b, feats, final)
            ids_d = ids.to(self.drafter_device, non_blocking=True)
            mask_d = b.loss_mask.to(self.drafter_device, non_blocking=True)
            self.timer.stop(tok, self.stream)
            event = None
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
            meter.lap("handoff")
        return HiddenBatch.of(item, ids_d, mask_d, feats, final, event)


class DrafterStep:
    """Objective forward/backward, gradient accumulation, guarded optimizer step, metrics push."""

    EXTRA_METRICS = ["grad_norm", "skipped_total", "consecutive_skips"]

    @classmethod
    def metric_names(cls, objective: Objective) -> list[str]:
        return list(objective.metric_names) + cls.EXTRA_METRICS

    def __init__(
        self,
        *,
        drafter: torch.nn.Module,
        objective: Objective,
        embed_weight: torch.Tensor,
        lm_head: torch.nn.Module,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        optim_step: GuardedStep,
        generator: torch.Generator,
        device: torch.device,
        grad_accum: int,
        autocast_bf16: bool,
        ring: ScalarRing | None,
        policy: AnchorPolicy | None = None,
    ):
        self.drafter = drafter  # or its DDP wrapper
        self.objective = objective
        self.embed_weight = embed_weight
        self.lm_head = lm_head
        self.sched = scheduler
        self.optim_step = optim_step  # clip + on-device non-finite skip + AdamW step
        self.generator = generator
        self.device = torch.device(device)
        self.grad_accum = grad_accum
        self.autocast_bf16 = autocast_bf16
        self.ring = ring  # ScalarRing over metric_names() (observe/scalars.py)
        self.policy = policy  # on-policy anchors (train/anchor_policy.py), or None: uniform
        self.stream = torch.cuda.current_stream(self.device) if _is_cuda(self.device) else None
        self.timer = StepTimer(self.device)
        self.micro = 0

    def query_tokens(self, hb: HiddenBatch) -> int:
        """Block tokens of `hb` that hold an anchor (padding blocks are not useful work): what
        the drafter's FLOP count and MFU credit. Host counts only."""
        return self.objective.query_tokens(hb.anchor_counts, int(hb.input_ids.shape[0]))

    def _wait_for(self, hb: HiddenBatch) -> None:
        """CUDA: this stream waits on the producer's event and records its use of the tensors
        (record_stream), so their memory outlives this step's use."""
        if hb.ready_event is None:
            return
        assert self.stream is not None  # events exist on CUDA only
        self.stream.wait_event(hb.ready_event)
        for t in (hb.features, hb.input_ids, hb.loss_mask, hb.target_hidden):
            if t is not None:
                t.record_stream(self.stream)

    def _push_metrics(self, step: int, out, grad_norm: torch.Tensor) -> None:
        """The step's scalars into the ring, on the device (observe/scalars.py)."""
        if self.ring is None:  # observability switched off
            return
        vec = torch.cat(
            [
                out.metrics.detach().float().reshape(-1),
                grad_norm.float().reshape(1),
                self.optim_step.skipped.reshape(1),
                self.optim_step.consecutive.reshape(1),
            ]
        )
        self.ring.push(step + 1, vec)

    def __call__(self, hb: HiddenBatch, step: int, meter: StepMeter | None = None) -> bool:
        """Consume one micro-batch. Returns True when it completed an optimizer step."""
        meter = meter if meter is not None else StepMeter()
        self._wait_for(hb)
        tok = self.timer.start(self.stream)
        ac = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.autocast_bf16
            else contextlib.nullcontext()
        )
        anchors = self.objective.step_anchors(hb.anchor_counts)  # host counts: no device read
        meter.gauge("anchors", float(anchors))
        stepped = (self.micro + 1) % self.grad_accum == 0
        # DDP: only the micro-step that completes an optimizer step all-reduces gradients; the
        # others accumulate locally (forward and backward must both run inside no_sync).
        no_sync = getattr(self.drafter, "no_sync", None)  # DDP's, absent on a bare module
        sync_ctx = no_sync() if (no_sync is not None and not stepped) else contextlib.nullcontext()
        policy = self.policy
        rows = preferred = None
        if policy is not None:  # the memory's rows of this batch, found once for both uses
            rows = policy.rows(hb.sample_ids)
            preferred = policy.preferred(rows)
        with sync_ctx:
            with ac:
                out = self.objective(
                    self.drafter,
                    self.embed_weight,
                    self.lm_head,
                    hb.features,
                    hb.input_ids,
                    hb.loss_mask,
                    self.generator,
                    hb.target_hidden,
                    num_anchors=anchors,
                    preferred=preferred,
                    preferred_count=policy.preferred_count(anchors) if policy is not None else 0,
                    want_next_starts=policy is not None,
                )
            meter.lap("drafter_fwd")
            (out.loss / self.grad_accum).backward()
        if policy is not None and rows is not None and out.next_starts is not None:
            policy.record(rows, out.next_starts, self.generator)
        meter.lap("drafter_bwd")
        self.micro += 1
        if stepped:
            grad_norm, _ = self.optim_step(out.loss)
            self.sched.step()
            self._push_metrics(step, out, grad_norm)
            meter.gauge("lr", float(self.sched.get_last_lr()[0]))  # a Python float
        self.timer.stop(tok, self.stream)
        meter.lap("drafter_opt")
        return stepped
