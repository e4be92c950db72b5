"""A wall-time budget for training (`optim.time_budget_s`), and the LR schedule that follows it.

Users often know how long they can train, not how many steps that is. With a budget the run
trains until the budget is spent (at most `optim.epochs` passes), then checkpoints and exports
as at the end of any run; warm-up and cosine decay are laid over the budget's time instead of
over a step count, so the LR reaches its end value when the time is up, whatever the step rate.

The clock starts at the first training step (loading and data preparation do not count) and is
carried by checkpoints (`budget_used_s`), so a resumed run spends only what is left.
"""

from __future__ import annotations

import math
import time

from dflash_trainer.config import OptimConfig


class TimeBudget:
    def __init__(self, seconds: float, used_s: float = 0.0, clock=time.monotonic):
        if seconds <= 0:
            raise ValueError(f"a time budget must be > 0 s, got {seconds}")
        self.seconds = float(seconds)
        self._used_before = float(used_s)
        self._clock = clock
        self._t0: float | None = None

    def start(self) -> None:
        """At the first step; later calls do nothing."""
        if self._t0 is None:
            self._t0 = self._clock()

    def used(self) -> float:
        run = 0.0 if self._t0 is None else self._clock() - self._t0
        return self._used_before + run

    def fraction(self) -> float:
        return min(1.0, self.used() / self.seconds)

    def spent(self) -> bool:
        return self.used() >= self.seconds


def budget_lr_lambda(cfg: OptimConfig, budget: TimeBudget):
    """LambdaLR factor from the budget's elapsed fraction: linear warm-up over the first
    `warmup_ratio` of the time, then cosine to `min_lr_ratio` at the end of the budget. The
    step argument is ignored (the step rate is not known in advance)."""
    warm = cfg.warmup_ratio

    def fn(_step: int) -> float:
        f = budget.fraction()
        if warm and f < warm:
            return max(f / warm, 0.01)  # the first step must not have LR 0
        progress = (f - warm) / max(1e-9, 1.0 - warm)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine

    return fn
