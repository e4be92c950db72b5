"""pipeline.split = "T:D" on CPU (gloo): T target ranks feed D drafter ranks, tiny models.

Each job runs this file as a script under `python -m torch.distributed.run --nproc-per-node 3`,
one process per rank; each rank writes `result.RANK.json`. The batches are those of
tests/test_distributed.py (one bucket sorted by length, pairs, every valid position an anchor),
so D drafter ranks x grad_accum a can be compared with one process x grad_accum D*a.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __name__ == "__main__":
    sys.path.insert(0, str(HERE))

import pytest  # noqa: E402
import torch  # noqa: E402

from test_distributed import BASE, N, _env, _free_port, _ledger, _weights  # noqa: E402
from tiny import tiny_config, tiny_dataset, tiny_target  # noqa: E402

WORLD = 3


# ------------------------------------------------------------------------------ rank process
def _rank_main(spec: dict) -> None:
    import logging

    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s r{os.environ['RANK']} %(threadName)s %(message)s"
    )
    from dflash_trainer.run.distributed import train_distributed

    if spec.get("any_balance"):  # the balance line even for a run this short
        import functools

        import dflash_trainer.run.trainer as T
        from dflash_trainer.observe.balance import assess

        T.assess_balance = functools.partial(assess, min_busy_s=0.0)
    hits: list = []
    if spec.get("count_host_reads"):  # test_zero_sync's check, in every stage thread
        import contextlib
        import threading

        from dflash_trainer.pipeline.stage import Stage
        from test_zero_sync import CountHostReads

        lock = threading.Lock()

        @contextlib.contextmanager
        def count(worker):
            local: list = []
            with CountHostReads(worker, local):
                yield
            with lock:
                hits.extend(local)

        Stage.thread_context = staticmethod(count)
        # the stop vote reads one CPU int of the gloo group by design (host only): not counted
        from torch.utils._python_dispatch import _disable_current_modes

        from dflash_trainer.pipeline.split import DrafterContext

        vote = DrafterContext.agree_stop

        def agree_stop(self, local_stop):
            with _disable_current_modes():
                return vote(self, local_stop)

        DrafterContext.agree_stop = agree_stop
    cfg = tiny_config(Path(spec["base"]), **spec["over"])
    res = train_distributed(cfg, target=tiny_target(), train_set=tiny_dataset(N))
    rank = int(os.environ["RANK"])
    out = {
        "steps": res.steps,
        "reason": res.reason,
        "tokens": res.tokens,
        "losses": {str(s): m["loss"] for s, m in res.history},
        "balance": res.balance,
        "host_reads": [list(h) for h in hits],
        "metrics": {k: v for k, v in res.metrics.items() if k.startswith(("dist/", "worker/"))},
    }
    (Path(spec["base"]) / f"result.{rank}.json").write_text(json.dumps(out))


def torchrun(base: Path, over: dict, timeout=180, **extra) -> subprocess.CompletedProcess:
    base.mkdir(parents=True, exist_ok=True)
    spec = json.dumps({"base": str(base), "over": over, **extra})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={WORLD}",
        f"--master-port={_free_port()}",
        str(HERE / "test_split.py"),
        spec,
    ]
    t0 = time.monotonic()
    cp = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    print(f"split job {over.get('pipeline.split')}: {time.monotonic() - t0:.1f} s")
    assert cp.returncode == 0, cp.stderr[-5000:]
    return cp


def _results(base: Path) -> list[dict]:
    return [json.loads((base / f"result.{r}.json").read_text()) for r in range(WORLD)]


def _reference(tmp_path: Path, grad_accum: int):
    from dflash_trainer.run import train

    cfg = tiny_config(tmp_path, **dict(BASE, **{"optim.grad_accum": grad_accum}))
    return train(cfg, target=tiny_target(), train_set=tiny_dataset(N))


def _losses(history) -> dict[int, float]:
    return {int(s): float(v) for s, v in history.items()}


def _assert_losses_equal(got: dict, ref) -> None:
    want = {s: m["loss"] for s, m in ref.history}
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    steps = sorted(want)
    torch.testing.assert_close(
        torch.tensor([got[s] for s in steps], dtype=torch.float64),
        torch.tensor([want[s] for s in steps], dtype=torch.float64),
        rtol=1e-4,
        atol=1e-5,
    )


def _assert_every_sample_once_per_epoch(run: Path, epochs: int = 2) -> None:
    ledger = _ledger(run)
    for epoch in range(epochs):
        ids = sorted(s for e, s in ledger if e == epoch)
        assert ids == list(range(N)), (run, epoch, ids)


# ---------------------------------------------------------------------- 1 target : 2 drafters
@pytest.fixture(scope="module")
def one_two(tmp_path_factory):
    base = tmp_path_factory.mktemp("split12")
    torchrun(base, dict(BASE, **{"pipeline.split": "1:2"}), any_balance=True)
    return base, _results(base)


def test_one_target_two_drafters_match_one_process(one_two, tmp_path):
    """Ranks 0, 1 train (grad_accum 2 each, DDP between them), rank 2 runs the target for both:
    each step trains the 4 batches one process with grad_accum 4 trains, with its losses."""
    base, (d0, d1, t2) = one_two
    ref = _reference(tmp_path, 4)
    assert d0["steps"] == d1["steps"] == ref.steps == 6
    assert t2["steps"] == 0 and t2["losses"] == {}
    # one process logs the last micro-batch of each step, drafter rank 1's batch of that step
    _assert_losses_equal(_losses(d1["losses"]), ref)
    assert d0["losses"] != d1["losses"]  # the drafter ranks trained different batches
    a, b = _weights(base / "run" / "export"), _weights(ref.export_dir)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    _assert_every_sample_once_per_epoch(base / "run")
    # the target rank computed and sent every batch; the drafter ranks' tokens add up to it
    assert t2["tokens"] == d0["tokens"] + d1["tokens"]
    assert d0["metrics"]["dist/ranks_reporting"] == 2  # the drafter ranks' merged metrics
    # rank 0's balance verdict read the target rank's figures and sizes the split in T:D terms
    assert "one drafter can absorb" in d0["balance"], d0["balance"]
    assert re.search(r"over 3 devices pipeline.split=\d:\d \(this run: 1:2\)", d0["balance"])


def test_balance_advises_the_split_in_t_to_d_terms():
    from dflash_trainer.observe.balance import assess, best_split, remote_target
    from dflash_trainer.observe.counters import WorkerCounters

    assert best_split(3000, 1000, 8) == (2, 6)  # 2 x 3000 = 6 x 1000
    assert best_split(1000, 1000, 8) == (4, 4)
    assert best_split(1000, 7000, 8) == (7, 1)
    assert best_split(1000, 1000, 3) == (1, 2)  # a tie goes to more drafter ranks
    s = 10**9
    drafter = WorkerCounters(name="drafter0", role="drafter", busy_ns=10 * s, tokens=5000)
    target = WorkerCounters(name="target0", role="target", busy_ns=2 * s, wait_out_ns=8 * s,
                            tokens=5000)  # fmt: skip
    b = assess([drafter], remote=[remote_target(target)], split=(1, 2), devices=8)
    assert b.verdict == "drafter-bound" and b.target_busy == pytest.approx(0.2)
    assert b.targets_per_drafter == pytest.approx(500 / 2500)
    assert "balance at T:D = 1:5.0: over 8 devices pipeline.split=2:6 (this run: 1:2)" in b.advice()
    # a co-located run on GPUs is advised too; on CPU (devices 0) it is not
    b = assess([target, drafter], devices=8)
    assert "pipeline.split=2:6." in b.advice() and "this run" not in b.advice()
    assert "over 8 devices" not in assess([target, drafter]).advice()


# ---------------------------------------------------------------------- 2 targets : 1 drafter
def test_two_targets_one_drafter_match_one_process(tmp_path):
    """Rank 0 trains every batch (grad_accum 2), ranks 1 and 2 take turns with the target
    forwards: the losses of one process with grad_accum 2, step for step; and no stage thread of
    any rank reads a tensor's value on the host (tests/test_zero_sync.py's count)."""
    base = tmp_path / "split21"
    torchrun(base, dict(BASE, **{"pipeline.split": "2:1"}), count_host_reads=True)
    d0, t1, t2 = _results(base)
    for r in (d0, t1, t2):  # no stage thread read a tensor's value on the host after step 0
        assert [h for h in r["host_reads"] if h[1] >= 1] == [], r["host_reads"]
    ref = _reference(tmp_path, 2)
    assert d0["steps"] == ref.steps == 12
    _assert_losses_equal(_losses(d0["losses"]), ref)
    assert t1["tokens"] > 0 and t2["tokens"] > 0  # both targets worked
    assert t1["tokens"] + t2["tokens"] == d0["tokens"]
    _assert_every_sample_once_per_epoch(base / "run")


# ------------------------------------------------------------------------------ resume
def test_split_resumes_exactly_after_a_signal_on_the_target_rank(tmp_path, one_two):
    """SIGTERM reaches the target rank only: it joins the drafters' stop vote, they stop after
    the same step and rank 0 writes the checkpoint; a resumed 1:2 job trains the rest with the
    uninterrupted job's losses, and every sample once per epoch."""
    over = dict(BASE, **{"pipeline.split": "1:2"})
    part = tmp_path / "part"
    torchrun(part, dict(over, **{"pipeline.fault": "target@2:2:sigterm"}))
    d0, d1, _ = _results(part)
    assert d0["reason"] == d1["reason"] == "signal"
    k = d0["steps"]
    assert d1["steps"] == k and 1 <= k < 6, k
    meta = json.loads((part / "run" / "checkpoints" / f"step-{k:07d}" / "state.json").read_text())
    assert meta["world_size"] == 2 and len(meta["ranks"]) == 2
    for f in part.glob("result.*.json"):
        f.unlink()
    torchrun(part, dict(over, **{"checkpoint.resume": True}))
    resumed = _results(part)
    full = one_two[1]
    for r in range(2):
        got = resumed[r]["losses"]
        assert resumed[r]["steps"] == 6
        assert sorted(map(int, got)) == list(range(k + 1, 7)), (r, got)
        for s, loss in got.items():
            assert loss == pytest.approx(full[r]["losses"][s], rel=1e-5, abs=1e-6), (r, s)
    _assert_every_sample_once_per_epoch(part / "run")


# ------------------------------------------------------------------------------ failures
def test_a_failing_target_rank_stops_the_drafter_ranks_naming_it(tmp_path):
    """Three plain processes with torchrun's environment (no agent that would kill the others):
    the target rank fails, both drafter ranks stop through our own mechanism, naming it."""
    port, procs = _free_port(), []
    spec = json.dumps(
        {
            "base": str(tmp_path),
            "over": dict(
                BASE,
                **{"pipeline.split": "1:2", "optim.epochs": 50, "pipeline.fault": "target@2:5"},
            ),
        }
    )
    for r in range(WORLD):
        env = _env()
        env.update(
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(WORLD),
            LOCAL_WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        log = open(tmp_path / f"rank{r}.log", "w+")  # files, not pipes: nobody reads them yet
        cmd = [sys.executable, str(HERE / "test_split.py"), spec]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    outs = []
    try:
        for p, log in procs:
            p.wait(timeout=120)
            log.seek(0)
            outs.append((p.returncode, log.read()))
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    assert all(rc != 0 for rc, _ in outs), [rc for rc, _ in outs]
    assert "InjectedFault" in outs[2][1]
    for r in (0, 1):
        line = [l for l in outs[r][1].splitlines() if l.startswith(f"dflash-trainer: rank {r}:")]
        assert line, outs[r][1][-3000:]
        assert "rank 2: stage 'target0' failed: InjectedFault" in line[-1], line[-1]


def test_a_batch_the_drafter_does_not_expect_is_refused_naming_both_ranks():
    from types import SimpleNamespace

    from dflash_trainer.pipeline.feed import FeatureSender, FeedError
    from dflash_trainer.pipeline.messages import HiddenBatch
    from dflash_trainer.pipeline.split import Split

    ctx = SimpleNamespace(rank=3, store=None, backend="gloo", timeout_s=5.0)
    sender = FeatureSender(
        "feed0",
        events=None,
        stop=None,
        faults=None,
        ctx=ctx,
        split=Split(2, 3),
        hs_q=None,
        done=None,
        max_in_flight=2,
    )
    ids = torch.zeros(2, 16, dtype=torch.long)
    hb = HiddenBatch(0, 1, ids, ids.bool(), torch.zeros(2, 16, 8), torch.tensor([4, 9]), 20)
    header = {"rows": 2, "len": 16, "features": 8, "final": 0, "ids": [4, 9]}
    sender._check(header, hb, 6, 0)  # the same batch: accepted
    with pytest.raises(FeedError, match=r"target rank 3: batch 6 of epoch 1 .* drafter rank 0"):
        sender._check(dict(header, ids=[4, 10], len=24), hb, 6, 0)


# ------------------------------------------------------------------------------ refusals
def test_bad_splits_are_refused_naming_the_flags(tmp_path):
    from dflash_trainer.config import ConfigError
    from dflash_trainer.errors import UserError
    from dflash_trainer.pipeline.split import Split
    from dflash_trainer.run import train

    for bad in ("3", "0:2", "1:x", "1:2:3", "-1:2"):
        with pytest.raises(ConfigError, match=r"pipeline.split: .* is not T:D"):
            tiny_config(tmp_path, **{"pipeline.split": bad})
    with pytest.raises(ConfigError, match="one pipeline.target_devices entry"):
        tiny_config(tmp_path, **{"pipeline.split": "1:1", "pipeline.target_devices": "cpu,cpu"})
    with pytest.raises(ConfigError, match="pipeline.schedule=pipelined"):
        tiny_config(tmp_path, **{"pipeline.split": "1:1", "pipeline.schedule": "sequential"})
    with pytest.raises(UserError, match=r"runs 3 ranks \(1 target \+ 2 drafter\), but .* has 4"):
        Split(1, 2).check_world(4)
    cfg = tiny_config(tmp_path, **{"pipeline.split": "1:2"})
    with pytest.raises(UserError, match=r"--nproc-per-node=3.*--nproc 3"):
        train(cfg, target=tiny_target(), train_set=tiny_dataset(N))


def test_nproc_must_match_the_split(tmp_path):
    """`train` launches T+D ranks by itself; another --nproc is refused naming both."""
    from dflash_trainer.commands.train import launch_count
    from dflash_trainer.errors import UserError

    cfg = tiny_config(tmp_path, **{"pipeline.split": "1:2"})
    assert launch_count(cfg, 0) == launch_count(cfg, 3) == 3
    with pytest.raises(UserError, match=r"--nproc 2 does not match pipeline.split=1:2 .*--nproc 3"):
        launch_count(cfg, 2)
    assert launch_count(tiny_config(tmp_path), 2) == 2  # co-located cells: --nproc as given


def test_pairing_covers_each_batch_once():
    from dflash_trainer.pipeline.feed import target_start
    from dflash_trainer.pipeline.split import Split

    for t, d in [(1, 2), (2, 1), (2, 3), (3, 3), (2, 4), (1, 7)]:
        s = Split(t, d)
        seen = [(s.target_of(g), s.drafter_of(g)) for g in range(60)]
        for tr in range(d, d + t):  # every pair a target rank feeds, and nothing else
            assert {dr for trr, dr in seen if trr == tr} == set(s.fed_by(tr))
        # after k batches per drafter, target i starts at its first batch g >= k*d
        for k in range(5):
            for i in range(t):
                e, seq = target_start(0, k, s, i)
                g = i + seq * t
                assert g >= k * d and g - t < k * d, (t, d, k, i, g)


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
