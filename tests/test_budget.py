"""optim.time_budget_s: training stops when the budget is spent, with a checkpoint, and the LR
schedule follows the time (train/budget.py)."""

import json

import pytest
import torch

from dflash_trainer.config import OptimConfig
from dflash_trainer.run import train
from dflash_trainer.train.budget import TimeBudget, budget_lr_lambda
from tiny import tiny_config, tiny_dataset, tiny_target


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_budget_starts_at_the_first_step_and_carries_earlier_use():
    clock = FakeClock()
    b = TimeBudget(10.0, used_s=4.0, clock=clock)
    clock.t += 50  # before start(): loading does not count
    assert b.used() == 4.0 and not b.spent()
    b.start()
    clock.t += 3
    b.start()  # idempotent
    assert b.used() == pytest.approx(7.0) and b.fraction() == pytest.approx(0.7)
    clock.t += 3
    assert b.spent() and b.fraction() == 1.0


def test_lr_follows_the_time_warmup_then_cosine_to_the_end_value():
    cfg = OptimConfig(warmup_ratio=0.1, min_lr_ratio=0.05)
    clock = FakeClock()
    b = TimeBudget(100.0, clock=clock)
    fn = budget_lr_lambda(cfg, b)
    b.start()
    assert fn(0) == pytest.approx(0.01)  # floor: the first step never has LR 0
    clock.t += 5
    assert fn(7) == pytest.approx(0.5)  # half-way through warm-up, whatever the step
    clock.t += 5
    assert fn(8) == pytest.approx(1.0)
    clock.t += 45  # half of the cosine part
    assert fn(9) == pytest.approx(0.05 + 0.95 * 0.5)
    clock.t += 100
    assert fn(10) == pytest.approx(0.05)


def test_budget_stops_training_with_a_checkpoint_and_the_lr_at_its_end(tmp_path):
    torch.manual_seed(0)
    cfg = tiny_config(
        tmp_path,
        **{
            "optim.epochs": 10000,
            "optim.time_budget_s": 1.5,
            "optim.min_lr_ratio": 0.1,
            "optim.warmup_ratio": 0.05,
        },
    )
    res = train(cfg, target=tiny_target(), train_set=tiny_dataset(), heldout=None)
    assert res.reason == "time_budget"
    assert 0 < res.steps < 10000 * 6
    meta = json.loads((res.checkpoint / "state.json").read_text())
    assert meta["train_state"]["step"] == res.steps and meta["budget_used_s"] >= 1.5
    blob = torch.load(res.checkpoint / "optimizer.pt", weights_only=True)
    last_lr = blob["scheduler"]["_last_lr"][0]
    assert last_lr == pytest.approx(cfg.optim.lr * 0.1)


def test_a_resumed_run_spends_only_what_is_left(tmp_path):
    over = {"optim.epochs": 10000, "optim.time_budget_s": 1.0}
    target, data = tiny_target(), tiny_dataset()
    first = train(tiny_config(tmp_path, **over), target=target, train_set=data, heldout=None)
    assert first.reason == "time_budget"
    over.update({"optim.time_budget_s": 2.0, "checkpoint.resume": True})
    second = train(tiny_config(tmp_path, **over), target=target, train_set=data, heldout=None)
    assert second.reason == "time_budget" and second.steps > first.steps
    meta = json.loads((second.checkpoint / "state.json").read_text())
    # the clock went on from the first run's 1 s (plus at most one step), not from 0
    assert 2.0 <= meta["budget_used_s"] < 2.0 + 1.0
