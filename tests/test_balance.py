"""Stage balance verdict and sizing from worker counters (observe/balance.py)."""

import re
from types import SimpleNamespace

import pytest

from dflash_trainer.observe.balance import assess
from dflash_trainer.observe.counters import WorkerCounters
from dflash_trainer.run import train
from tiny import tiny_config, tiny_dataset, tiny_target

S = 10**9  # ns per second


def _w(name, busy_s, wait_in_s, wait_out_s, tokens, steps=10):
    return WorkerCounters(
        name=name,
        role=name.rstrip("0123456789"),
        busy_ns=int(busy_s * S),
        wait_in_ns=int(wait_in_s * S),
        wait_out_ns=int(wait_out_s * S),
        tokens=tokens,
        steps=steps,
    )


def test_drafter_bound_run_is_named_and_sized():
    # target: 5 s busy, 5 s blocked on the full hidden queue, 1000 tok/s; drafter: always busy,
    # 500 tok/s -> one drafter absorbs half a target worker.
    b = assess(
        [_w("prefetch", 1, 0, 9, 0), _w("target0", 5, 0, 5, 5000), _w("drafter0", 10, 0, 0, 5000)]
    )
    assert b.verdict == "drafter-bound"
    assert b.target_busy == pytest.approx(0.5) and b.drafter_busy == pytest.approx(1.0)
    assert b.target_tok_s == pytest.approx(1000) and b.drafter_tok_s == pytest.approx(500)
    assert b.targets_per_drafter == pytest.approx(0.5)
    assert "drafter-bound" in b.advice() and "num_anchors" in b.advice()


def test_target_bound_with_two_targets():
    b = assess(
        [_w("target0", 10, 0, 0, 2000), _w("target1", 9, 1, 0, 1800), _w("drafter0", 4, 6, 0, 3800)]
    )
    assert b.verdict == "target-bound"
    assert b.num_targets == 2 and b.target_tok_s == pytest.approx(200)
    assert b.targets_per_drafter == pytest.approx((3800 / 4) / 200)
    assert "pipeline.target_devices" in b.advice()


def test_gpu_time_replaces_host_time():
    """On CUDA the host returns before the device finishes: device time from the event timer
    (scaled for untimed steps) is what counts."""
    d = _w("drafter0", 1, 9, 0, 1000, steps=10)
    d.gpu_timer = SimpleNamespace(enabled=True, total_ms=4500.0, count=5)  # 0.9 s/step
    b = assess([_w("target0", 9.5, 0, 0.5, 1000), d])
    assert b.drafter_busy == pytest.approx(0.9) and b.verdict == "balanced"


def test_too_little_work_or_no_pipeline_gives_none():
    assert assess([_w("target0", 0.1, 0, 0, 10), _w("drafter0", 0.1, 0, 0, 10)]) is None
    assert assess([_w("sequential0", 10, 0, 0, 100)]) is None


def test_train_reports_the_balance(tmp_path, monkeypatch):
    import functools
    import json

    import dflash_trainer.run.trainer as T

    monkeypatch.setattr(T, "assess_balance", functools.partial(assess, min_busy_s=0.0))
    cfg = tiny_config(tmp_path, **{"optim.epochs": 2})
    target = tiny_target()
    res = train(cfg, target=target, train_set=tiny_dataset())
    assert res.balance.startswith("pipeline ") and "one drafter can absorb" in res.balance
    # the target's decoder layers asked for their team (borrowing), and the hooks are gone
    assert re.search(r"the target on \d+% of its layers", res.balance), res.balance
    assert not any(layer._forward_pre_hooks for layer in target.layers)
    events = [
        json.loads(l)
        for l in (res.run_dir / "metrics.jsonl").read_text().splitlines()
        if "pipeline/verdict" in l
    ]
    assert len(events) == 1 and events[0]["pipeline/verdict"] in res.balance
    assert 0 < events[0]["pipeline/drafter_busy"] <= 1 and events[0]["pipeline/drafter_tok_s"] > 0


def test_train_with_four_threads_runs_the_adaptive_split(tmp_path):
    """pipeline.cpu_threads=4 (more than 2: another integer split exists): the run trains with
    the adaptive split on and the balance line names the split it started from and ended at."""
    cfg = tiny_config(tmp_path, **{"optim.epochs": 2, "pipeline.cpu_threads": 4})
    res = train(cfg, target=tiny_target(), train_set=tiny_dataset())
    assert res.steps > 0
    m = re.search(
        r"CPU threads: target (\d) : drafter (\d) of 4 \(adaptive: from 2 : 2", res.balance
    )
    assert m, res.balance
    assert int(m.group(1)) + int(m.group(2)) == 4 and min(int(m.group(1)), int(m.group(2))) >= 1
