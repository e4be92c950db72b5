import math

import torch

from dflash_trainer.config import OptimConfig
from dflash_trainer.train.optim import GuardedStep, build_optimizer, lr_lambda


def _setup():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    opt = build_optimizer(lin.parameters(), OptimConfig(lr=1e-2))
    return lin, opt, GuardedStep(opt, lin.parameters(), 1.0, torch.device("cpu"))


def test_nonfinite_step_is_skipped_on_device_and_counted():
    lin, opt, guard = _setup()
    x = torch.randn(5, 4)
    loss = lin(x).pow(2).mean()
    loss.backward()
    guard(loss)
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    state_before = {k: v.clone() for k, v in opt.state[lin.weight].items()}
    for _ in range(2):
        bad = (lin(x) * float("nan")).sum()
        bad.backward()
        norm, finite = guard(bad)
        assert not bool(finite)
    for k, v in lin.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    for k, v in opt.state[lin.weight].items():
        torch.testing.assert_close(v, state_before[k], rtol=0, atol=0)
    assert float(guard.skipped) == 2 and float(guard.consecutive) == 2
    loss = lin(x).pow(2).mean()
    loss.backward()
    guard(loss)
    assert float(guard.consecutive) == 0 and float(guard.skipped) == 2
    assert float(opt.state[lin.weight]["step"]) == 2


def test_guarded_step_matches_plain_adamw_with_clipping():
    lin, opt, guard = _setup()
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(lin.state_dict())
    ref_opt = torch.optim.AdamW(
        ref.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0
    )
    for _ in range(3):
        x = torch.randn(5, 4) * 10
        for m, o in ((lin, None), (ref, ref_opt)):
            loss = m(x).pow(2).mean()
            loss.backward()
            if o is None:
                guard(loss)
            else:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
                o.step()
                o.zero_grad()
    for a, b in zip(lin.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


def test_schedule_warmup_then_cosine_to_min():
    cfg = OptimConfig(warmup_ratio=0.1, min_lr_ratio=0.1)
    f = lr_lambda(cfg, 100)
    assert f(0) == 0.1 and f(9) == 1.0
    assert math.isclose(f(10), 1.0)
    assert f(55) < f(30) < 1.0
    assert math.isclose(f(100), 0.1)


def test_segmented_schedule_is_continuous_across_a_changed_total():
    from dflash_trainer.train.optim import segmented_lr_lambda

    cfg = OptimConfig(warmup_ratio=0.1, min_lr_ratio=0.1)
    plain, one = lr_lambda(cfg, 100), segmented_lr_lambda(cfg, [[100, 0]])
    assert all(plain(s) == one(s) for s in range(101))
    # resumed at step 40 of 100 with 160 steps in all now (e.g. half the ranks): the curve
    # follows the old one to step 40, then stretches the rest over 120 steps to the same end.
    f = segmented_lr_lambda(cfg, [[100, 0], [160, 40]])
    assert all(f(s) == plain(s) for s in range(41))
    assert abs(f(41) - f(40)) < 0.01  # no jump at the resume step
    assert math.isclose(f(100), plain(70))  # halfway through what was left
    assert math.isclose(f(160), 0.1)  # ends where the schedule ends
    assert all(f(s + 1) <= f(s) for s in range(10, 160))
    # the naive rebuild (what a resume used to do) jumps up at the resume step
    assert lr_lambda(cfg, 160)(41) - plain(40) > 0.05
    # resumed inside the warm-up: the warm-up goes on, it does not restart
    w = segmented_lr_lambda(cfg, [[100, 0], [50, 5]])
    assert w(5) == plain(5) and plain(5) < w(6) <= 1.0 and math.isclose(w(50), 0.1)
    # a second resume composes with the first
    g = segmented_lr_lambda(cfg, [[100, 0], [160, 40], [130, 100]])
    assert all(g(s) == f(s) for s in range(101))
    assert math.isclose(g(115), f(130)) and math.isclose(g(130), 0.1)
