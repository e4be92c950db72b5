"""Checkpoints are atomic: a crash or a full disk mid-write never loses the last good one."""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from dflash_trainer.checkpoint import (
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from dflash_trainer.errors import UserError


def _parts(seed=0, width=64):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    gen = torch.Generator().manual_seed(seed)
    return model, opt, sched, gen


def _save(run_dir, step, model, opt, sched, gen, keep=3):
    return save_checkpoint(
        run_dir,
        drafter=model,
        optimizer=opt,
        scheduler=sched,
        generator=gen,
        state=TrainState(step=step, consumed=[0, 1]),
        config={"x": 1},
        keep_last=keep,
    )


def test_round_trip_and_retention(tmp_path):
    model, opt, sched, gen = _parts()
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model, opt, sched, gen, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert names == ["step-0000003", "step-0000004"]
    m2, o2, s2, g2 = _parts(seed=1)
    st = load_checkpoint(
        latest_checkpoint(tmp_path),
        drafter=m2,
        optimizer=o2,
        scheduler=s2,
        generator=g2,
        config={"x": 1},
    )
    assert st.step == 4 and st.consumed == [0, 1]
    for a, b in zip(model.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(g2.get_state(), gen.get_state())


def test_disk_full_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, sched, gen = _parts()
    good = _save(tmp_path, 1, model, opt, sched, gen)
    import dflash_trainer.checkpoint as ck

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck, "save_file", full)
    with pytest.raises(UserError, match=r"could not write checkpoint .*step-0000002.*No space"):
        _save(tmp_path, 2, model, opt, sched, gen)
    assert latest_checkpoint(tmp_path) == good
    assert not list((tmp_path / "checkpoints").glob("*.tmp-*"))


def test_stale_partial_checkpoint_is_ignored(tmp_path):
    model, opt, sched, gen = _parts()
    good = _save(tmp_path, 1, model, opt, sched, gen)
    partial = tmp_path / "checkpoints" / "step-0000002.tmp-99999"
    partial.mkdir()
    (partial / "drafter.safetensors").write_bytes(b"\x00" * 10)
    assert latest_checkpoint(tmp_path) == good


def test_sigkill_during_checkpoint_writes(tmp_path):
    """Kill a process that checkpoints in a loop at an arbitrary moment: the last complete
    checkpoint still loads."""
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_checkpoint import _parts, _save
        model, opt, sched, gen = _parts(width=512)
        step = 0
        while True:
            step += 1
            _save({str(tmp_path)!r}, step, model, opt, sched, gen)
            print(step, flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    first = p.stdout.readline()  # at least one checkpoint done
    assert first.strip()
    time.sleep(0.7)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    ck = latest_checkpoint(tmp_path)
    assert ck is not None
    m2, o2, s2, g2 = _parts(seed=3, width=512)
    st = load_checkpoint(ck, drafter=m2, optimizer=o2, scheduler=s2, generator=g2, config={"x": 1})
    assert st.step >= 1


# ------------------------------------------------------------------ background writes


def _snap(step, model, opt, sched, gen, ledger=()):
    from dflash_trainer.checkpoint import snapshot_checkpoint

    return snapshot_checkpoint(
        drafter=model,
        optimizer=opt,
        scheduler=sched,
        generator=gen,
        state=TrainState(step=step, consumed=[0]),
        config={"x": 1},
        ledger=list(ledger),
    )


def test_snapshot_is_isolated_from_later_updates(tmp_path):
    """What is written is the state at the snapshot, even if training changes the live
    weights and optimizer buffers in place before the write."""
    from dflash_trainer.checkpoint import write_checkpoint

    model, opt, sched, gen = _parts()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_avg = opt.state[next(iter(model.parameters()))]["exp_avg"].clone()
    snap = _snap(5, model, opt, sched, gen)
    with torch.no_grad():  # a training step after the snapshot
        for p in model.parameters():
            p.add_(1.0)
        opt.state[next(iter(model.parameters()))]["exp_avg"].add_(1.0)
    path = write_checkpoint(tmp_path, snap, keep_last=3)
    m2, o2, s2, g2 = _parts(seed=3)
    load_checkpoint(path, drafter=m2, optimizer=o2, scheduler=s2, generator=g2, config={"x": 1})
    for k, v in m2.state_dict().items():
        torch.testing.assert_close(v, want[k])
    torch.testing.assert_close(o2.state[next(iter(m2.parameters()))]["exp_avg"], want_avg)


def test_async_writer_returns_at_once_and_orders_writes(tmp_path, monkeypatch):
    import threading

    from dflash_trainer import checkpoint as C

    release, seen = threading.Event(), []
    real = C.write_checkpoint

    def slow_write(run_dir, snap, **kw):
        seen.append((snap.step, threading.current_thread().name, release.wait(10)))
        return real(run_dir, snap, **kw)

    monkeypatch.setattr(C, "write_checkpoint", slow_write)
    done = []
    w = C.AsyncCheckpointWriter(tmp_path, keep_last=3, on_done=lambda p, s: done.append(s.step))
    model, opt, sched, gen = _parts()
    w.submit(_snap(1, model, opt, sched, gen))
    assert done == []  # submit returned while the write is blocked
    release.set()  # (a synchronous write would have waited 10 s and failed)
    w.submit(_snap(2, model, opt, sched, gen))  # waits for step 1 first
    assert w.wait().name == "step-0000002"
    assert done == [1, 2]
    assert [s for s, _, _ in seen] == [1, 2] and all(ok for _, _, ok in seen)
    assert all(name.startswith("ckpt-writer") for _, name, _ in seen)


def test_async_write_failure_is_raised_in_the_caller(tmp_path, monkeypatch):
    from dflash_trainer import checkpoint as C

    model, opt, sched, gen = _parts()
    w = C.AsyncCheckpointWriter(tmp_path, keep_last=3)
    w.submit(_snap(1, model, opt, sched, gen))
    w.wait()

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(C, "save_file", full_disk)
    w.submit(_snap(2, model, opt, sched, gen))
    with pytest.raises(UserError, match="could not write checkpoint .*step-0000002.*intact"):
        w.wait()
    assert latest_checkpoint(tmp_path).name == "step-0000001"
    assert w.wait() is None  # reported once


# ------------------------------------------------------------------ the sample ledger


def _ledger_rows(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]


def test_a_kill_between_checkpoint_and_ledger_append_loses_no_ledger_entry(tmp_path, monkeypatch):
    """`latest` names step 2 but the process died before the writer appended step 2's ledger
    entries (the window the SIGKILL test can land in): the resume appends them from the
    checkpoint's own ledger.json, once."""
    from dflash_trainer import checkpoint as C

    model, opt, sched, gen = _parts()
    w = C.AsyncCheckpointWriter(tmp_path, keep_last=3)
    w.submit(_snap(1, model, opt, sched, gen, ledger=[(0, [0, 1]), (0, [2])]))
    w.wait()
    monkeypatch.setattr(C, "append_ledger", lambda *a, **k: None)  # killed right after `latest`
    w.submit(_snap(2, model, opt, sched, gen, ledger=[(0, [3]), (1, [4, 5])]))
    w.wait()
    assert latest_checkpoint(tmp_path).name == "step-0000002"
    assert [r["samples"] for r in _ledger_rows(tmp_path)] == [[0, 1], [2]]
    monkeypatch.undo()
    for _ in range(2):  # idempotent: a second resume from the same checkpoint adds nothing
        C.reconcile_ledger(tmp_path, latest_checkpoint(tmp_path))
        rows = _ledger_rows(tmp_path)
        assert [(r["epoch"], r["samples"], r["step"]) for r in rows] == [
            (0, [0, 1], 1),
            (0, [2], 1),
            (0, [3], 2),
            (1, [4, 5], 2),
        ]


def test_reconcile_drops_a_torn_line_and_lines_past_the_checkpoint(tmp_path):
    from dflash_trainer import checkpoint as C

    model, opt, sched, gen = _parts()
    w = C.AsyncCheckpointWriter(tmp_path, keep_last=3)
    for step, ids in ((1, [0]), (2, [1]), (3, [2])):
        w.submit(_snap(step, model, opt, sched, gen, ledger=[(0, ids)]))
    w.wait()
    with open(tmp_path / "ledger.jsonl", "a") as f:
        f.write('{"epoch": 0, "samp')  # a kill mid-append
    C.reconcile_ledger(tmp_path, tmp_path / "checkpoints" / "step-0000003")
    assert [r["samples"] for r in _ledger_rows(tmp_path)] == [[0], [1], [2]]
    # a resume from the older checkpoint trains step 3's batches again: their line goes
    C.reconcile_ledger(tmp_path, tmp_path / "checkpoints" / "step-0000002")
    assert [r["samples"] for r in _ledger_rows(tmp_path)] == [[0], [1]]
    # a checkpoint of another run leaves this run's ledger alone
    other = C.write_checkpoint(
        tmp_path / "other", _snap(5, model, opt, sched, gen, [(0, [9])]), keep_last=1
    )
    C.reconcile_ledger(tmp_path, other)
    assert [r["samples"] for r in _ledger_rows(tmp_path)] == [[0], [1]]
