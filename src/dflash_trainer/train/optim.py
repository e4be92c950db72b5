"""AdamW with warmup + cosine, gradient clipping, and an on-device guard against non-finite steps.

The guard never reads a value on the host: the fused AdamW kernel takes a `found_inf` tensor and
skips the update (and undoes its step-count increment) on device when it is non-zero, the same
mechanism GradScaler uses. Skip counts stay on device too and reach the host through the metrics
ring, where the supervisor reads them without syncing the worker.
"""

from __future__ import annotations

import math

import torch

from dflash_trainer.config import OptimConfig
from dflash_trainer.train.budget import TimeBudget, budget_lr_lambda


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.AdamW:
    params = [p for p in params if p.requires_grad]
    # fused AdamW exists on CPU and CUDA and is what makes the device-side skip possible.
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=True,
    )


def lr_lambda(cfg: OptimConfig, total_steps: int):
    warmup = int(round(cfg.warmup_ratio * total_steps))

    def fn(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine

    return fn


def segmented_lr_lambda(cfg: OptimConfig, segments: list):
    """The schedule of a run resumed with a different number of steps left (another world size
    re-plans the rest of the data, or more epochs were asked for).

    segments = [[total_0, 0], [total_1, resume_1], ...]: the run started with a total_0-step
    schedule; at step resume_k the total became total_k. Up to each resume step the previous
    schedule holds; after it the rest of that schedule's progress is spread over the new
    remaining steps. The LR neither jumps nor restarts its warm-up at a resume point and still
    reaches its end at the last step. One segment = the plain schedule."""
    fn = lr_lambda(cfg, int(segments[0][0]))
    for (prev_total, _), (total, resume) in zip(segments, segments[1:]):
        prev_total, total, resume = int(prev_total), int(total), int(resume)

        def fn(step, prev=fn, prev_total=prev_total, total=total, resume=resume):
            if step <= resume:
                return prev(step)
            frac = (step - resume) / max(1, total - resume)  # of what is left
            return prev(resume + frac * (prev_total - resume))

    return fn


def build_scheduler(
    opt: torch.optim.Optimizer,
    cfg: OptimConfig,
    total_steps: int,
    segments: list | None = None,
    budget: TimeBudget | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """`segments`: see segmented_lr_lambda (None = a fresh total_steps schedule). `budget`: the
    schedule follows wall time instead (train/budget.py)."""
    if budget is not None:
        fn = budget_lr_lambda(cfg, budget)
    elif segments:
        fn = segmented_lr_lambda(cfg, segments)
    else:
        fn = lr_lambda(cfg, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(opt, fn)


class GuardedStep:
    """clip -> check finiteness -> fused AdamW step that is a no-op on device when not finite.

    Device counters: `skipped` (total) and `consecutive` (reset by a finite step).
    """

    def __init__(
        self, optimizer: torch.optim.AdamW, params, grad_clip: float, device: torch.device
    ):
        self.opt = optimizer
        self.params = [p for p in params if p.requires_grad]
        self.grad_clip = grad_clip
        self.skipped = torch.zeros((), device=device)
        self.consecutive = torch.zeros((), device=device)

    def __call__(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (grad_norm, finite) as 0-d device tensors. Call after backward."""
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)
        finite = torch.isfinite(grad_norm) & torch.isfinite(loss.detach())
        found_inf = (~finite).to(torch.float32)
        # Read by the fused kernel (the GradScaler protocol); grad_scale None = no unscaling.
        self.opt.grad_scale = None  # type: ignore[attr-defined]
        self.opt.found_inf = found_inf  # type: ignore[attr-defined]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.skipped += found_inf
        self.consecutive.add_(found_inf).mul_(found_inf)
        return grad_norm.detach(), finite
