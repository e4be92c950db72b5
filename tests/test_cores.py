"""CoreShare (pipeline/cores.py): the drafter borrows the target's cores only while the target is
parked, no core is ever claimed twice, and neither stage starves."""

import threading
import time

import pytest

from dflash_trainer.pipeline.cores import CoreShare
from dflash_trainer.pipeline.queues import BoundedQueue, Stopped


def _simulate(target_s: float, drafter_s: float, n: int = 24, capacity: int = 2):
    """One target thread and one drafter thread (1 core each of 2) with sleeps for work; returns
    (share, the most cores ever claimed at once, items the drafter got)."""
    q = BoundedQueue("hidden", capacity, 0.01)
    share = CoreShare(q, own=1, all_threads=2)
    stop = threading.Event()
    lock = threading.Lock()
    claimed = [0, 0]  # now, max

    def claim(k: int):
        with lock:
            claimed[0] += k
            claimed[1] = max(claimed[1], claimed[0])

    def target():
        for i in range(n):
            share.park_while_ahead(stop, 0.01)
            claim(1)
            time.sleep(target_s)
            claim(-1)
            q.put(i, stop)

    got = []

    def drafter():
        while len(got) < n:
            got.append(q.get(stop))
            k = share.drafter_threads(from_cache=False)
            claim(k)
            time.sleep(drafter_s)
            claim(-k)

    threads = [threading.Thread(target=target), threading.Thread(target=drafter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a stage starved or deadlocked"
    return share, claimed[1], got


def test_slow_drafter_borrows_without_ever_oversubscribing():
    share, most, got = _simulate(target_s=0.004, drafter_s=0.012)
    assert got == list(range(24))  # every batch, in order: the target never starved
    assert most <= 2, f"{most} cores claimed at once on 2"
    # the target is 3x faster: it is parked ahead for a large share of the drafter's steps
    assert share.borrowed_steps >= 6, share.summary()


def test_slow_target_is_never_parked_and_nothing_is_borrowed():
    share, most, got = _simulate(target_s=0.012, drafter_s=0.002)
    assert got == list(range(24))
    assert most <= 2
    assert share.borrowed_steps == 0, share.summary()


def test_park_hysteresis_and_stop():
    q = BoundedQueue("hidden", 2, 0.01)
    share = CoreShare(q, own=1, all_threads=2)
    stop = threading.Event()
    q.put(0, stop)
    assert share.park_while_ahead(stop, 0.01) == 0  # one free slot: no park
    assert share.drafter_threads(False) == 1
    q.put(1, stop)  # full: the next forward parks until the queue is EMPTY, not one slot free
    out = {}

    def target():
        out["parked_ns"] = share.park_while_ahead(stop, 0.01)

    t = threading.Thread(target=target)
    t.start()
    while not share.parked:
        time.sleep(0.001)
    q.get(stop)
    assert share.drafter_threads(False) == 2  # parked and one batch still queued: borrow
    time.sleep(0.02)
    assert t.is_alive() and share.parked  # one slot free is not enough to resume
    q.get(stop)
    t.join(timeout=5)
    assert not t.is_alive() and not share.parked and out["parked_ns"] > 0
    assert share.drafter_threads(False) == 1  # queue empty: the target is running again
    assert share.drafter_threads(True) == 2  # a cached batch: the target has nothing to do

    q.put(0, stop)
    q.put(1, stop)
    stop.set()
    with pytest.raises(Stopped):
        share.park_while_ahead(stop, 0.01)
    assert not share.parked


def test_several_target_workers_never_park():
    q = BoundedQueue("hidden", 1, 0.01)
    share = CoreShare(q, own=1, all_threads=3, park=False)
    stop = threading.Event()
    q.put(0, stop)
    assert share.park_while_ahead(stop, 0.01) == 0
    assert share.drafter_threads(False) == 1 and share.drafter_threads(True) == 3
