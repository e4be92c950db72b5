"""CoreShare (pipeline/cores.py): the drafter borrows the target's cores only while the target is
parked, no core is ever claimed twice, and neither stage starves."""

import math
import random
import threading
import time

import pytest

from dflash_trainer.pipeline.cores import TRIAL_STEPS, CoreShare, ShareTrial, rebalanced
from dflash_trainer.pipeline.queues import BoundedQueue, Stopped


def _simulate(
    target_s: float,
    drafter_s: float,
    n: int = 24,
    capacity: int = 2,
    scaled: bool = False,
    layers: int = 1,
    slow_borrowed: float = 1.0,
    **share_kw,
):
    """One target thread and one drafter thread with sleeps for work (`scaled`: seconds / the
    threads a step runs with, linear scaling; else the same whatever they are), each asking the
    CoreShare for its team size and reporting its step; returns (share, the most cores ever
    claimed at once, items the drafter got). Default share: 1 core each of 2. `layers` > 1:
    the target's step runs in that many parts, each asking `target_layer_threads` (the decoder
    layers' pre-hook)."""
    q = BoundedQueue("hidden", capacity, 0.01)
    share = CoreShare(q, **{"own": 1, "all_threads": 2, **share_kw})
    stop = threading.Event()
    lock = threading.Lock()
    claimed = [0, 0]  # now, max

    def claim(k: int):
        with lock:
            claimed[0] += k
            claimed[1] = max(claimed[1], claimed[0])

    def work(stage: str, seconds: float, k: int):
        claim(k)
        t0 = time.perf_counter_ns()
        if stage == "drafter" and k == share.all_threads:
            seconds *= slow_borrowed
        time.sleep(seconds / k if scaled else seconds)
        share.record(stage, time.perf_counter_ns() - t0, k, tokens=100)
        claim(-k)

    def target():
        for i in range(n):
            share.park_while_ahead(stop, 0.01)
            k = share.target_threads()
            if layers == 1:
                work("target", target_s, k)
            for _ in range(layers if layers > 1 else 0):
                work("target", target_s / layers, share.target_layer_threads())
            q.put(i, stop)

    got = []

    def drafter():
        while len(got) < n:
            got.append(q.get(stop))
            work("drafter", drafter_s, share.drafter_threads(from_cache=False))

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
    # 25x apart: a drafter step delayed by the OS (a loaded machine) must still not let the
    # target fill the queue; at 6x (12 vs 2 ms) one such delay parked it once under load
    share, most, got = _simulate(target_s=0.05, drafter_s=0.002)
    assert got == list(range(24))
    assert most <= 2
    assert share.borrowed_steps == 0, share.summary()


def test_slow_target_borrows_the_waiting_drafters_core_between_layers():
    share, most, got = _simulate(target_s=0.012, drafter_s=0.003, scaled=True, layers=6)
    assert got == list(range(24))
    # the drafter waits most of the time: the target runs many layers on both cores
    assert share.borrowed_layers >= share.layers // 3, share.summary()
    assert "of its layers" in share.summary()
    # a drafter that takes a batch starts on its own core while the target finishes its layer:
    # that one overlap is the most ever claimed
    assert most <= 3, f"{most} cores claimed at once on 2"


def test_target_layer_threads_follow_the_drafter():
    q = BoundedQueue("hidden", 2, 0.01)
    share = CoreShare(q, own=1, all_threads=2)
    assert share.target_threads() == 1
    assert share.target_layer_threads() == 1  # the drafter holds its core (start-up)
    assert share.drafter_threads(False) == 1
    share.record("drafter", 10**6, 1)  # its step ended: it waits for a batch
    assert share.target_layer_threads() == 2
    assert share.drafter_threads(False) == 1  # a batch: the drafter starts on its own core
    assert share.target_layer_threads() == 1  # and the target's next layer gives it back
    several = CoreShare(q, own=1, all_threads=2, park=False)  # several target workers
    several.target_threads()
    several.record("drafter", 10**6, 1)
    assert several.target_layer_threads() == 1


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


# ------------------------------------------------------------------ the adaptive split (>= 3 cores)
@pytest.mark.parametrize("cores", [3, 4, 8, 16])
def test_rebalanced_never_starves_a_stage_under_fake_busy_profiles(cores):
    """Extreme and random thread-second profiles: the target keeps 1..cores-1 threads, every
    move goes towards the stage that did more work, and a move is one thread."""
    g = random.Random(cores)
    t = cores // 2
    profiles = [(0.0, 5.0), (5.0, 0.0), (0.0, 0.0), (1e-9, 1e9), (1e9, 1e-9)]
    profiles += [(g.expovariate(1.0), g.expovariate(1.0)) for _ in range(500)]
    for wt, wd in profiles:
        new = rebalanced(t, cores, wt, wd)
        assert 1 <= new <= cores - 1
        assert abs(new - t) <= 1
        if new > t:  # the target's share of the work is above its share of the threads
            assert wt / (wt + wd) > t / cores
        if new < t:
            assert wt / (wt + wd) < t / cores
        t = new


def test_rebalanced_with_two_cores_keeps_the_only_split():
    assert rebalanced(1, 2, 0.0, 9.0) == 1 and rebalanced(1, 2, 9.0, 0.0) == 1


@pytest.mark.parametrize(
    "cores,w_target,w_drafter", [(4, 1.0, 3.0), (8, 1.0, 1.0), (8, 5.0, 1.0), (16, 1.0, 6.0)]
)
def test_rebalanced_converges_to_the_balanced_split_without_see_saw(cores, w_target, w_drafter):
    """A fake pipeline whose stages scale linearly (a batch costs w thread-seconds): each
    window both stages do the same batches, so the split walks monotonically to a neighbour of
    cores * w_t / (w_t + w_d) and stays there."""
    t, seen = 1 if w_target > w_drafter else cores - 1, []
    for _ in range(3 * cores):
        batches = 10  # per window; thread-seconds do not depend on the split under linear scaling
        t = rebalanced(t, cores, w_target * batches, w_drafter * batches)
        seen.append(t)
    ideal = cores * w_target / (w_target + w_drafter)
    assert seen[-1] in (max(1, math.floor(ideal)), min(cores - 1, math.ceil(ideal)))
    steps = [b - a for a, b in zip(seen, seen[1:]) if b != a]
    assert all(s == steps[0] for s in steps)  # one direction only
    assert seen[-cores:] == [seen[-1]] * cores  # settled


def test_adaptive_split_moves_threads_to_the_slow_drafter_and_never_oversubscribes():
    """Threads with sleeps for work (w / threads: linear scaling) on 4 fake cores, starting
    2 : 2 with a drafter 3x the target's work: the split moves to 1 : 3 and no more cores than 4
    are claimed at any moment, moves included."""
    n = 60
    share, most, got = _simulate(
        0.006, 0.018, n, scaled=True, own=2, all_threads=4, park=False, adapt=True, window_s=0.05
    )
    assert got == list(range(n))
    assert most <= 4, f"{most} cores claimed at once on 4"
    assert (share.target_alloc, share.own) == (1, 3), share.summary()
    assert share.moves == 1 and "adaptive: from 2 : 2, 1 moves" in share.summary()


def test_a_moved_thread_is_taken_only_after_the_giver_let_go():
    """Deterministic order of calls across one move each way (4 cores, start 2 : 2)."""
    q = BoundedQueue("hidden", 2, 0.01)
    share = CoreShare(q, own=2, all_threads=4, park=False, adapt=True, window_s=0.0)
    assert share.target_threads() == 2 and share.drafter_threads(False) == 2
    share.record("target", 10**9, 2)
    share.record("drafter", 3 * 10**9, 2)  # the drafter did 3x the work: one thread moves to it
    assert (share.target_alloc, share.own) == (1, 3)
    assert share.drafter_threads(False) == 2  # the target's step still runs on 2
    assert share.target_threads() == 1  # its next step lets go of one
    assert share.drafter_threads(False) == 3  # then the drafter takes it
    share.record("target", 9 * 10**9, 1)
    assert share.drafter_threads(False) == 3  # its next step, before the next window ends
    share.record("drafter", 10**9, 3)  # now the target is the slow stage: one moves back
    assert (share.target_alloc, share.own) == (2, 2)
    # the drafter's step has ended (record): it holds no core until its next batch
    assert share.target_threads() == 2
    assert share.drafter_threads(False) == 2


# ------------------------------------------------------------ sharing decided by measurement
def _feed(trial, rate_on: float, rate_off: float, steps: int, tokens: int = 100) -> list[bool]:
    """Drafter steps of `tokens` each on a fake clock: a step takes tokens / rate of the mode the
    trial is in. Returns the mode after each step."""
    now, modes = 0, []
    mode = trial.step_done(tokens, now, False)  # the warm-up step opens the first window
    for _ in range(steps):
        now += int(tokens / (rate_on if mode else rate_off) * 1e9)
        mode = trial.step_done(tokens, now, False)
        modes.append(mode)
    return modes


@pytest.mark.parametrize("on, off, keep", [(1200.0, 1000.0, True), (900.0, 1000.0, False)])
def test_share_trial_keeps_the_faster_mode(on, off, keep):
    trial = ShareTrial(windows=3, steps=4)
    modes = _feed(trial, on, off, steps=40)
    # windows alternate on, off, on, off, on, off (4 steps each), then the verdict holds
    assert modes[:24] == ([True] * 3 + [False] + [False] * 3 + [True]) * 2 + (
        [True] * 3 + [False] + [False] * 3 + [keep]
    )
    assert modes[24:] == [keep] * 16 and trial.decided is keep
    assert trial.rates[True] == pytest.approx([on] * 3) and trial.rates[False] == pytest.approx(
        [off] * 3
    )
    assert ("kept" if keep else "switched off") in trial.summary()


def test_share_trial_skips_windows_with_cached_batches_and_can_be_off():
    trial = ShareTrial(windows=1, steps=2)
    trial.step_done(10, 0, False)
    trial.step_done(10, 10**9, False)
    trial.step_done(10, 2 * 10**9, True)  # a cached batch: the window restarts here
    assert trial.rates == {True: [], False: []}
    trial.step_done(10, 3 * 10**9, False)
    trial.step_done(10, 4 * 10**9, False)
    assert trial.rates[True] == [pytest.approx(10.0)] and trial.sharing is False
    assert ShareTrial(windows=0).step_done(10, 0, False) is True  # no trial: share


def test_a_trial_that_finds_sharing_slower_stops_parking_and_borrowing():
    """A target 3x faster than the drafter, on a CPU where a drafter step on both cores takes
    1.6x longer than on its own: the trial measures sharing slower, switches it off, and from
    then on nothing is borrowed and the target never parks."""
    share, most, got = _simulate(
        target_s=0.004, drafter_s=0.012, n=60, slow_borrowed=1.6, trial_windows=2
    )
    assert got == list(range(60)) and most <= 2
    assert share.trial.decided is False and not share.sharing, share.summary()
    trial_steps = 1 + 2 * 2 * TRIAL_STEPS  # warm-up, then 2 windows of each mode
    assert 0 < share.borrowed_steps <= trial_steps, share.summary()
    assert share.park_while_ahead(threading.Event(), 0.01) == 0
    assert "switched off" in share.summary()


def test_a_trial_that_finds_sharing_faster_keeps_it():
    share, most, got = _simulate(
        target_s=0.004, drafter_s=0.012, n=60, scaled=True, trial_windows=2
    )
    assert got == list(range(60)) and most <= 2
    assert share.trial.decided is True and share.sharing, share.summary()
    assert share.borrowed_steps > 2 * TRIAL_STEPS, share.summary()


def test_threads_split_the_cpus_the_process_may_use_not_the_hosts(monkeypatch):
    """A 2-CPU container (or `taskset -c 0,1`) on a 64-core host: the stages split the 2 CPUs of
    the process's affinity, not os.cpu_count()'s 64."""
    import os

    from dflash_trainer.config import Config
    from dflash_trainer.pipeline import cores
    from dflash_trainer.pipeline.split import localize_split
    from dflash_trainer.run.build import thread_split

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5}, raising=False)
    assert cores.usable_cpus() == 2
    assert thread_split(Config()) == (1, 1)
    assert localize_split(Config(), 0, 2).pipeline.cpu_threads == 1  # 2 ranks share the 2
    monkeypatch.delattr(os, "sched_getaffinity")  # no affinity API: the host's count
    assert cores.usable_cpus() == 64
