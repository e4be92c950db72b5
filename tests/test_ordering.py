"""Several target workers, one training order (pipeline/ordering.py): the drafter trains the
plan's batches in the plan's order whatever order the workers hand them over in, so a run with
two target workers gives the one-worker run's losses step for step, and resumes exactly."""

import random
import time

import pytest
import torch

from dflash_trainer.pipeline import workers
from dflash_trainer.pipeline.messages import HiddenBatch
from dflash_trainer.pipeline.ordering import InOrder
from dflash_trainer.run import train
from test_pipeline import _ledger, _losses, _run, assert_resumed_exactly
from tiny import tiny_config, tiny_dataset, tiny_target


def _hb(epoch, seq_no):
    z = torch.zeros(1, 1)
    return HiddenBatch(seq_no, epoch, z, z, z, torch.zeros(1), 1)


def test_in_order_releases_the_plan_order_across_epochs():
    rng = random.Random(0)
    sizes = {0: 7, 1: 5, 2: 0, 3: 4}
    keys = [(e, k) for e, n in sizes.items() for k in range(n)]
    for trial in range(20):
        # arrivals shuffled within a window of 3, as 3 workers could; EpochEnd(e) reaches the
        # drafter at any point after its epoch's first batch was taken (or after the last one)
        arrivals = sorted(keys, key=lambda k: keys.index(k) + rng.uniform(0, 3))
        order, out = InOrder(0, 0), []
        ends = {e: rng.randrange(keys.index((e, 0)), len(keys) + 1) for e in (0, 1, 3)}
        ends[2] = ends[3]  # an epoch of no batches
        for i, (e, k) in enumerate(arrivals):
            out += order.add(_hb(e, k))
            for ep, at in ends.items():
                if at == i:
                    out += order.epoch_end(ep, sizes[ep])
        for ep, at in ends.items():
            if at >= len(arrivals):
                out += order.epoch_end(ep, sizes[ep])
        assert [(h.epoch, h.seq_no) for h in out] == keys, trial
        assert not order.held


def test_in_order_starts_inside_an_epoch_and_refuses_a_batch_twice():
    order = InOrder(1, 3)
    assert order.add(_hb(1, 4)) == []
    assert [h.seq_no for h in order.add(_hb(1, 3))] == [3, 4]
    with pytest.raises(RuntimeError, match="arrived twice"):
        order.add(_hb(1, 4))


@pytest.fixture
def swapped_handoffs(monkeypatch):
    """Every third batch's hand-off to the drafter is late (after its forward, outside the
    target lock): the other worker's next batch overtakes it."""
    put = workers.BoundedQueue.put
    seen: list[tuple[int, int]] = []

    def late_put(self, item, stop, *a, **kw):
        if isinstance(item, HiddenBatch):
            if item.seq_no % 3 == 0:
                time.sleep(0.15)
            seen.append((item.epoch, item.seq_no))
        return put(self, item, stop, *a, **kw)

    monkeypatch.setattr(workers.BoundedQueue, "put", late_put)
    return seen


TWO = {"pipeline.target_devices": "cpu,cpu", "optim.epochs": 3}


def test_two_target_workers_train_the_one_worker_steps(tmp_path, swapped_handoffs):
    one = _run(tmp_path / "one", **{"optim.epochs": 3})
    two = _run(tmp_path / "two", **TWO)
    arrived = list(swapped_handoffs)
    assert arrived != sorted(arrived), "the hand-offs were not reordered: the test tests nothing"
    la, lb = _losses(one), _losses(two)
    assert la.keys() == lb.keys()
    for k in la:
        assert lb[k] == pytest.approx(la[k], rel=1e-5, abs=1e-6), k
    assert _ledger(two.run_dir) == _ledger(one.run_dir)


def test_two_target_workers_resume_exactly_after_sigterm(tmp_path, swapped_handoffs):
    full = _run(tmp_path / "full", **TWO)
    part = _run(tmp_path / "run2", **TWO, **{"pipeline.fault": "drafter:9:sigterm"})
    assert part.reason == "signal" and 9 <= part.steps < full.steps
    cfg = tiny_config(tmp_path / "run2", **TWO, **{"checkpoint.resume": True})
    res = train(cfg, target=tiny_target(), train_set=tiny_dataset())
    assert_resumed_exactly(full, res, first=part.steps + 1)


_KILLED_RUN = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from dflash_trainer.pipeline import workers
from dflash_trainer.pipeline.messages import HiddenBatch
from dflash_trainer.run import train
from tiny import tiny_config, tiny_dataset, tiny_target

put = workers.BoundedQueue.put

def late_put(self, item, stop, *a, **kw):  # as the swapped_handoffs fixture
    if isinstance(item, HiddenBatch) and item.seq_no % 3 == 0:
        time.sleep(0.15)
    return put(self, item, stop, *a, **kw)

workers.BoundedQueue.put = late_put
over = {over!r}
train(tiny_config(Path({root!r}), **over), target=tiny_target(), train_set=tiny_dataset())
"""


def test_two_target_workers_resume_exactly_after_sigkill(tmp_path, swapped_handoffs):
    """SIGKILL after a checkpoint (no graceful stop: the process dies where it stands, with two
    target workers and reordered hand-offs): the resumed run starts at the checkpoint and trains
    the uninterrupted run's steps, losses and ledger exactly."""
    import os
    import signal
    import subprocess
    import sys

    full = _run(tmp_path / "full", **TWO, **{"checkpoint.every_steps": 4})
    root = tmp_path / "run2"
    # the drafter stalls at step 14, after the checkpoint of step 12: killed there
    over = {**TWO, "checkpoint.every_steps": 4, "pipeline.fault": "drafter:14:hang"}
    code = _KILLED_RUN.format(tests=os.path.dirname(__file__), over=over, root=str(root))
    proc = subprocess.Popen([sys.executable, "-c", code])
    latest = root / "run" / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip().endswith("12"):
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be killed"
    assert latest.read_text().strip().endswith("12")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    cfg = tiny_config(root, **TWO, **{"checkpoint.every_steps": 4, "checkpoint.resume": True})
    res = train(cfg, target=tiny_target(), train_set=tiny_dataset())
    assert_resumed_exactly(full, res, first=13)
    assert _ledger(res.run_dir) == _ledger(full.run_dir)
