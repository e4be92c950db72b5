import logging
import queue
import threading

import numpy as np
import pytest
import torch

from dflash_trainer.checkpoint import contiguous_prefix
from dflash_trainer.config import BatchingConfig
from dflash_trainer.data.batching import plan_epoch
from dflash_trainer.data.chat import TokenizedDataset
from dflash_trainer.errors import UserError
from dflash_trainer.pipeline.messages import End, EpochEnd, StageFailure, WorkItem
from dflash_trainer.pipeline.prefetcher import BatchPrefetcher
from dflash_trainer.pipeline.queues import BoundedQueue

CFG = BatchingConfig(
    max_tokens=512, max_batch_size=8, pad_multiple=8, num_buckets=4, seed=1, sort_window=32
)


def make_dataset(n=120, seed=0, pad_id=7):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(40), 0.8, n), 4, 200).astype(int)
    ids = [rng.integers(10, 100, L) for L in lengths]
    masks = [(rng.random(L) < 0.5).astype(np.uint8) for L in lengths]
    return TokenizedDataset(ids, masks, [f"s{i}" for i in range(n)], pad_id=pad_id)


def run_prefetcher(ds, epochs=2, start=(0, 0), stop_after=None, rank=0, world_size=1, cap=2):
    """Consume items as a trainer would; stop after `stop_after` WorkItems (None = to the End)."""
    q, stop, failures = BoundedQueue("work", cap, poll_s=0.01), threading.Event(), queue.Queue()
    pf = BatchPrefetcher(
        ds, CFG, q, stop, failures, epochs, rank=rank, world_size=world_size, start=start
    )
    pf.start()
    items, markers = [], []
    while True:
        msg = q.get(stop)
        if isinstance(msg, WorkItem):
            items.append(msg)
            if stop_after is not None and len(items) == stop_after:
                stop.set()
                break
        else:
            markers.append(msg)
            if isinstance(msg, End):
                break
    pf.join(timeout=5)
    assert not pf.is_alive()
    assert_ended_cleanly(failures)
    return pf, items, markers


def assert_ended_cleanly(events: queue.Queue) -> None:
    """The events channel got exactly one message: End("prefetch") (no StageFailure)."""
    got = []
    while not events.empty():
        got.append(events.get_nowait())
    assert len(got) == 1 and isinstance(got[0], End), [getattr(g, "tb", g) for g in got]
    assert got[0].producer == "prefetch"


def test_stream_contents_and_markers(caplog):
    ds = make_dataset()
    with caplog.at_level(logging.INFO, logger="dflash_trainer.pipeline.prefetcher"):
        pf, items, markers = run_prefetcher(ds, epochs=2)
    plans = [plan_epoch(ds.lengths, CFG, e) for e in range(2)]
    assert [type(m) for m in markers] == [EpochEnd, EpochEnd, End]
    assert [(m.epoch, m.num_batches) for m in markers[:2]] == [
        (0, len(plans[0])),
        (1, len(plans[1])),
    ]
    assert [(it.epoch, it.seq_no) for it in items] == [
        (e, s) for e in range(2) for s in range(len(plans[e]))
    ]
    assert len({(it.epoch, it.seq_no) for it in items}) == len(items)  # each batch once
    assert f"epoch 0 fully queued ({len(plans[0])} batches)" in caplog.text
    for it, idx in zip(items, plans[0] + plans[1]):
        b = it.batch
        assert b.sample_ids.tolist() == idx
        assert b.input_ids.dtype == torch.long and b.loss_mask.dtype == torch.bool
        assert b.input_ids.shape[1] % CFG.pad_multiple == 0
        assert b.input_ids.shape[1] >= int(ds.lengths[idx].max())
        assert b.num_real_tokens == int(ds.lengths[idx].sum())
        for r, i in enumerate(idx):  # naive reference: right padding with the pad id
            n = len(ds.input_ids[i])
            assert b.input_ids[r, :n].tolist() == ds.input_ids[i].tolist()
            assert (b.input_ids[r, n:] == 7).all()
            assert b.loss_mask[r, :n].tolist() == ds.loss_mask[i].astype(bool).tolist()
            assert not b.loss_mask[r, n:].any()
    c = pf.counters
    assert c.steps == len(items) and c.items == 2 * len(ds)
    assert c.tokens == 2 * int(ds.lengths.sum())
    assert c.padded_tokens == sum(it.batch.num_padded_tokens for it in items) and c.busy_ns > 0
    assert sum(pf.bucket_batches) == len(items)


def test_resume_matches_uninterrupted_stream():
    ds = make_dataset()
    _, full, _ = run_prefetcher(ds, epochs=3)
    n0 = len(plan_epoch(ds.lengths, CFG, 0))
    for k in (5, n0, n0 + 3):  # mid-epoch, exactly at an epoch end, in epoch 1
        pf, head, _ = run_prefetcher(ds, epochs=3, stop_after=k)
        # the resume mechanism: the step loop's consumed seq_nos of the current epoch
        last = head[-1]
        consumed = [it.seq_no for it in head if it.epoch == last.epoch]
        start = (last.epoch, contiguous_prefix(consumed))
        _, tail, markers = run_prefetcher(ds, epochs=3, start=start)
        got = head + tail
        assert len(got) == len(full)
        for a, b in zip(got, full):
            assert (a.epoch, a.seq_no) == (b.epoch, b.seq_no)
            torch.testing.assert_close(a.batch.sample_ids, b.batch.sample_ids)
            torch.testing.assert_close(a.batch.input_ids, b.batch.input_ids)
            torch.testing.assert_close(a.batch.loss_mask, b.batch.loss_mask)
            assert a.batch.num_real_tokens == b.batch.num_real_tokens


def test_resume_start_rules():
    """The start seq_no of a resumed epoch: the batches 0..k-1 are done (none, some, all)."""
    assert contiguous_prefix([]) == 0 and contiguous_prefix(None) == 0
    assert contiguous_prefix([3, 0, 4, 1, 2]) == 5  # any order
    assert contiguous_prefix(range(10)) == 10  # the epoch is complete: it yields nothing more
    with pytest.raises(UserError, match="not a prefix"):
        contiguous_prefix([0, 1, 3])


def test_ranks_disjoint_sample_ids():
    ds = make_dataset()
    seen = []
    for r in range(3):
        _, items, _ = run_prefetcher(ds, epochs=1, rank=r, world_size=3)
        seen.append([i for it in items for i in it.batch.sample_ids.tolist()])
    flat = [i for s in seen for i in s]
    assert len(flat) == len(set(flat)) and len({len(s) > 0 for s in seen}) == 1


def test_failure_reported_as_value():
    ds = make_dataset()
    ds.input_ids[ds.lengths.argmax()] = ds.input_ids[ds.lengths.argmax()][:2]  # corrupt row
    got = []
    q, stop = BoundedQueue("work", 1000, poll_s=0.01), threading.Event()
    pf = BatchPrefetcher(ds, CFG, q, stop, got.append, epochs=1)
    pf.start()
    pf.join(timeout=10)
    assert not pf.is_alive() and len(got) == 1
    assert isinstance(got[0], StageFailure) and got[0].stage == "prefetch"  # and no End
    assert isinstance(got[0].exc, ValueError) and "Traceback" in got[0].tb
    assert not any(isinstance(m, End) for m in q.drain())  # no End after a failure


def test_stop_while_blocked_exits_quietly():
    ds = make_dataset()
    q, stop, failures = BoundedQueue("work", 1, poll_s=0.01), threading.Event(), queue.Queue()
    pf = BatchPrefetcher(ds, CFG, q, stop, failures, epochs=5)
    pf.start()
    q.get(stop)
    stop.set()
    pf.join(timeout=5)
    assert not pf.is_alive()
    assert_ended_cleanly(failures)


def test_composition_metrics():
    ds = make_dataset(300)
    pf, items, _ = run_prefetcher(ds, epochs=1)
    comp = pf.composition()
    real = sum(it.batch.num_real_tokens for it in items)
    padded = sum(it.batch.num_padded_tokens for it in items)
    assert comp["batch/padding_eff"] == pytest.approx(real / padded)
    assert 0.0 <= comp["batch/bucket_entropy"] <= 1.0 and comp["batch/bucket_entropy"] > 0.8
    assert comp["batch/len_max"] == ds.lengths.max()
    assert comp["batch/len_p50"] == pytest.approx(np.percentile(ds.lengths, 50))
    fracs = [comp[f"batch/bucket/{k}_frac"] for k in range(pf.num_buckets)]
    assert sum(fracs) == pytest.approx(1.0)
    assert all(isinstance(v, float) for v in comp.values())


def test_pin_memory_only_with_cuda():
    ds = make_dataset(20)
    q, stop, failures = BoundedQueue("work", 100, poll_s=0.01), threading.Event(), queue.Queue()
    pf = BatchPrefetcher(ds, CFG, q, stop, failures, epochs=1, pin_memory=True)
    pf.start()
    pf.join(timeout=10)
    items = [m for m in q.drain() if isinstance(m, WorkItem)]
    assert_ended_cleanly(failures)
    assert items
    assert all(it.batch.input_ids.is_pinned() == torch.cuda.is_available() for it in items)


def test_fault_hook_reports_failure():
    from dflash_trainer.pipeline.stage import FaultInjector

    ds = make_dataset()
    got = []
    q, stop = BoundedQueue("work", 1000, poll_s=0.01), threading.Event()
    pf = BatchPrefetcher(ds, CFG, q, stop, got.append, epochs=1)
    pf.faults = FaultInjector("prefetch:3")
    pf.start()
    pf.join(timeout=10)
    assert len(got) == 1 and "injected fault in stage 'prefetch' at step 3" in str(got[0].exc)
    assert len([m for m in q.drain() if isinstance(m, WorkItem)]) == 3
