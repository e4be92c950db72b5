"""The features of a `pipeline.split` job, from target ranks to drafter ranks (pipeline/split.py
has the layout: batch g of an epoch's global plan is computed by target rank D + g mod T and
trained by drafter rank g mod D).

```
 target rank t                                          drafter rank d
   ShardPrefetcher (batches g = t mod T)                  BatchPrefetcher (rank d of D)
   == work_q ==> TargetWorker (TargetStep, features       == work_q ==> FeatureReceiver:
      stay on this rank's device)                            post irecv, then ask (store key
   == hs_q ==> FeatureSender: wait for the ask, check        feed/req/E/G = the batch's header),
      the header, isend (<= K in flight)  --- p2p --->       wait -> HiddenBatch
                                                          == hs_q ==> DrafterWorker (as ever)
```

Both ends build the same plan, so a drafter rank knows every batch's shapes and sample ids
itself: only the features (and the final hidden states, for KD) travel, as tensors of known
shapes. The protocol is *pull*: a target rank sends batch g only after drafter rank g mod D has
asked for it, and a drafter rank asks only after posting its receive. So every send has a
receive posted for it and no send is ever left unmatched, whenever and however the drafters
stop; and the ask carries the batch's header (rows, length, feature width, sample ids), which
the target checks against its own batch: two ranks that built different plans fail naming
both, instead of exchanging wrong tensors.

| end      | waits for                          | bounded by             | timeout              |
|----------|------------------------------------|------------------------|----------------------|
| receiver | the peer's first readiness         | -                      | none (start-up)      |
|          | the features it asked for          | one target forward     | collective_timeout_s |
| sender   | the peer's first readiness         | -                      | none (start-up)      |
|          | the ask for its next batch         | the drafters' progress | collective_timeout_s |
|          | its oldest send (K = hs_queue_size) | a transfer            | collective_timeout_s |

Every wait also ends when the rank's stop event is set (a failure anywhere: the supervisor),
except a transfer already asked for, which completes or times out.

In flight: a target rank holds at most hs_queue_size computed batches in its queue and
hs_queue_size sends; a drafter rank at most hs_queue_size received batches plus the one it is
receiving.

End: a drafter rank's receiver, when it ends for any reason (its data done, max_steps, the
stop vote, a failure), sets `feed/stop/D` after its last ask. A target rank goes through its
batches in order: one that was asked for is sent; one whose drafter has stopped without asking
for it is skipped (a drafter asks in order, so it asks for nothing later either); when every
drafter it feeds has stopped, or its data is done, it waits for its sends and ends.

Transport: gloo (CPU) sends and receives complete in `Work.wait(timeout)`: blocking, and gloo
closes the pair on a timeout, so it is waited on only where the peer is known to act (after the
ask). NCCL (CUDA) receives are stream-ordered (`wait()` makes this thread's stream wait; the
drafter stream waits on the batch's ready event), and the sender polls `is_completed()` (an
event query, no host sync) to keep K sends in flight.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_trainer.data.batching import EpochPlan, plan_skipping
from dflash_trainer.pipeline.messages import End, EpochEnd, HiddenBatch, WorkItem
from dflash_trainer.pipeline.prefetcher import BatchPrefetcher
from dflash_trainer.pipeline.queues import BoundedQueue, Stopped
from dflash_trainer.pipeline.split import Split
from dflash_trainer.pipeline.stage import Stage, oom_context

log = logging.getLogger(__name__)


class FeedError(RuntimeError):
    """The feed between a target rank and a drafter rank broke; the message names both."""


def wire_dtype(device: torch.device) -> torch.dtype:
    """The features' dtype on the wire: bfloat16 between GPUs, float32 on CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _ready_key(rank: int) -> str:
    return f"feed/ready/{rank}"


def _ask_key(epoch: int, g: int) -> str:
    return f"feed/req/{epoch}/{g}"


def _stop_key(drafter: int) -> str:
    return f"feed/stop/{drafter}"


def _beat() -> None:
    c = getattr(threading.current_thread(), "counters", None)
    if c is not None:
        c.beat()


def _poll(ready, stop: threading.Event, deadline: float | None = None):
    """`ready()` until it returns something truthy (returned), polling from 0.5 ms up to 20 ms.
    Raises Stopped when `stop` is set, TimeoutError past `deadline` (monotonic s)."""
    pause = 0.0005
    while True:
        got = ready()
        if got:
            return got
        if stop.is_set():
            raise Stopped("feed")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError
        _beat()  # waiting on a peer, not hung
        time.sleep(pause)
        pause = min(2 * pause, 0.02)


class Wire:
    """Point-to-point transfers on the default group, and the store keys of the protocol."""

    def __init__(self, ctx, timeout_s: float):
        self.ctx, self.store, self.rank = ctx, ctx.store, ctx.rank
        self.nccl = ctx.backend == "nccl"
        self.timeout_s = float(timeout_s)
        self._ready: set[int] = set()

    def announce(self) -> None:
        self.store.set(_ready_key(self.rank), "1")

    def await_peer(self, peer: int, stop: threading.Event) -> None:
        """Once per peer: it has built everything and started its feed (start-up can take any
        time: no deadline; a failing peer stops this rank through the supervisor)."""
        if peer not in self._ready:
            _poll(lambda: self.store.check([_ready_key(peer)]), stop)
            self._ready.add(peer)

    def finish(self, works, what: str) -> None:
        """Complete `works` (gloo: wait on the host; NCCL: order this thread's stream after
        them). A timeout is an error naming `what`."""
        for w in works:
            try:
                if self.nccl:
                    w.wait()
                else:
                    w.wait(timeout=timedelta(seconds=self.timeout_s))
            except Exception as e:
                raise FeedError(
                    f"rank {self.rank}: {what} did not complete within {self.timeout_s:.0f} s "
                    f"(pipeline.collective_timeout_s): {type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200]}"
                ) from e

    def sent(self, works, what: str, stop: threading.Event) -> None:
        """Sends `works` complete (the sender's bound on sends in flight)."""
        if not self.nccl:
            self.finish(works, what)
            return
        deadline = time.monotonic() + self.timeout_s
        try:
            _poll(lambda: all(w.is_completed() for w in works), stop, deadline)
        except TimeoutError:
            raise FeedError(
                f"rank {self.rank}: {what} did not complete within {self.timeout_s:.0f} s "
                "(pipeline.collective_timeout_s)"
            ) from None


# ------------------------------------------------------------------------------- target side
class ShardPrefetcher(BatchPrefetcher):
    """A target rank's prefetcher: batches g = t, t+T, t+2T, ... of each epoch's global plan cut
    to a multiple of D (what the drafter ranks train); WorkItem.seq_no is the index in that
    share, so batch g = t + seq_no x T."""

    def __init__(self, *args, split: Split, target_index: int, **kw):
        self.split, self.index = split, int(target_index)
        super().__init__(*args, **kw)

    def plan(self, epoch: int) -> EpochPlan:
        skip = self.skip_samples if epoch == self.start_position[0] else None
        full = plan_skipping(self.dataset.lengths, self.cfg, epoch, 0, 1, skip)
        n = len(full.batches)
        usable = n - n % self.split.drafters
        share = slice(self.index, usable, self.split.targets)
        dropped = full.batches[usable:]
        return EpochPlan(
            full.batches[share],
            full.buckets[share],
            full.num_buckets,
            dropped_batches=len(dropped) if self.index == 0 else 0,
            dropped_samples=sum(len(b) for b in dropped) if self.index == 0 else 0,
        )


def target_start(state_epoch: int, done_batches: int, split: Split, index: int) -> tuple:
    """(epoch, seq_no) of target `index`'s first batch when the drafter ranks have trained the
    first `done_batches` batches each of `state_epoch` (a prefix: the first done x D of the
    global plan)."""
    first = done_batches * split.drafters  # global index of the first batch not trained
    return state_epoch, max(0, -(-(first - index) // split.targets))


class FeatureSender(Stage):
    """hs_q -> the drafter ranks: each batch once its drafter asks for it (see the module
    docstring). Ends after its data, or once every drafter it feeds has stopped asking."""

    role = "feed"

    def __init__(
        self,
        name,
        *,
        events,
        stop,
        faults,
        ctx,
        split: Split,
        hs_q: BoundedQueue,
        done: threading.Event,
        max_in_flight: int,
    ):
        super().__init__(name, events=events, stop=stop, faults=faults)
        self.split, self.hs_q, self.done = split, hs_q, done
        self.wire = Wire(ctx, ctx.timeout_s)
        self.index = ctx.rank - split.drafters
        self.max_in_flight = max(1, int(max_in_flight))
        self.in_flight: deque = deque()  # (works, what, tensors kept alive)
        self.stopped: set[int] = set()  # drafter ranks that will ask for nothing more
        self.fed = set(split.fed_by(ctx.rank))
        self.stream: torch.cuda.Stream | None = None
        self.skipped = 0  # batches computed but not asked for (drafters stopped first)

    def on_epoch_end(self, item: EpochEnd) -> None:
        pass

    def loop(self) -> None:
        c = self.counters
        self.wire.announce()
        dev = None
        for hb in self.items(self.hs_q):
            assert isinstance(hb, HiddenBatch), type(hb)
            g = self.index + hb.seq_no * self.split.targets
            d = self.split.drafter_of(g)
            if d in self.stopped:
                self.skipped += 1
                continue
            self.wire.await_peer(d, self.stop)
            header = self._await_ask(hb.epoch, g, d)
            if header is None:  # d stopped before asking for g: nothing later either
                self.stopped.add(d)
                self.skipped += 1
                if self.stopped >= self.fed:
                    break
                continue
            self._check(header, hb, g, d)
            t0 = time.perf_counter_ns()
            c.begin_busy(t0)
            if dev is None:
                dev = hb.features.device
                if dev.type == "cuda":
                    self.stream = torch.cuda.Stream(dev)
            self._send(hb, g, d)
            c.end_busy(time.perf_counter_ns())
            c.steps += 1
            c.items += int(hb.sample_ids.numel())
            c.tokens += hb.num_real_tokens
            c.padded_tokens += int(hb.input_ids.numel())
            c.beat()
        while self.in_flight:
            self._complete_oldest()
        if self.skipped:
            log.info("%s: %d computed batches not asked for (the drafters stopped)", self.name,
                     self.skipped)  # fmt: skip
        self.done.set()

    def _await_ask(self, epoch: int, g: int, d: int) -> dict | None:
        """The header drafter rank d asked for batch (epoch, g) with, or None when it stopped
        without asking for it."""
        store, key = self.wire.store, _ask_key(epoch, g)

        def asked():
            if store.check([key]):
                return "ask"
            if store.check([_stop_key(d)]):  # asks precede the stop mark: look once more
                return "ask" if store.check([key]) else "stopped"
            return None

        t0 = time.perf_counter_ns()
        deadline = time.monotonic() + self.wire.timeout_s
        try:
            got = _poll(asked, self.stop, deadline)
        except TimeoutError:
            raise FeedError(
                f"target rank {self.wire.rank}: drafter rank {d} did not ask for batch {g} of "
                f"epoch {epoch} within {self.wire.timeout_s:.0f} s (pipeline.collective_timeout_s;"
                " a drafter rank busy longer than that between steps, e.g. a long evaluation, "
                "needs a larger one)"
            ) from None
        finally:
            self.counters.wait_in_ns += time.perf_counter_ns() - t0
        if got == "stopped":
            return None
        header = json.loads(store.get(key).decode())
        store.delete_key(key)
        return header

    def _check(self, header: dict, hb: HiddenBatch, g: int, d: int) -> None:
        final = 0 if hb.target_hidden is None else int(hb.target_hidden.shape[-1])
        mine = {
            "rows": int(hb.input_ids.shape[0]),
            "len": int(hb.input_ids.shape[1]),
            "features": int(hb.features.shape[-1]),
            "final": final,
            "ids": hb.sample_ids.tolist(),  # CPU tensor
        }
        diff = {k: (header.get(k), v) for k, v in mine.items() if header.get(k) != v}
        if diff:
            raise FeedError(
                f"target rank {self.wire.rank}: batch {g} of epoch {hb.epoch} differs from what "
                f"drafter rank {d} expects ("
                + ", ".join(f"{k}: drafter {a}, target {b}" for k, (a, b) in diff.items())
                + "): every rank must build the same plan and the same features (the same data, "
                "data.*, batching.*, seed and target.taps; objective settings that need the "
                "target's final hidden states)"
            )

    def _send(self, hb: HiddenBatch, g: int, d: int) -> None:
        tensors = [t.contiguous() for t in (hb.features, hb.target_hidden) if t is not None]
        what = f"the send of batch {g} of epoch {hb.epoch} to drafter rank {d}"
        with _on(self.stream):
            if self.stream is not None and hb.ready_event is not None:
                self.stream.wait_event(hb.ready_event)  # the target stream's writes first
            works = [dist.isend(t, d, tag=i) for i, t in enumerate(tensors)]
        self.in_flight.append((works, what, tensors))
        while len(self.in_flight) > self.max_in_flight - 1:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        works, what, _tensors = self.in_flight.popleft()
        t0 = time.perf_counter_ns()
        self.wire.sent(works, what, self.stop)
        self.counters.wait_out_ns += time.perf_counter_ns() - t0


# ------------------------------------------------------------------------------- drafter side
class FeatureSource:
    """A drafter rank's end: for one WorkItem of its plan, post the receives, ask target rank
    D + g mod T for batch g, wait, and hand the batch to the drafter as a HiddenBatch."""

    def __init__(
        self,
        ctx,
        split: Split,
        device: torch.device,
        feature_dim: int,
        final_dim: int,
        feature_dtype: torch.dtype,
    ):
        self.ctx, self.split = ctx, split
        self.wire = Wire(ctx, ctx.timeout_s)
        self.device = torch.device(device)
        self.feature_dim, self.final_dim = int(feature_dim), int(final_dim)
        self.wire_dtype = wire_dtype(self.device)
        self.feature_dtype = feature_dtype
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.timer = None  # no device work of its own to time
        self.closed = False

    def __call__(self, item: WorkItem, stop: threading.Event) -> HiddenBatch:
        b = item.batch
        g = item.seq_no * self.split.drafters + self.ctx.rank
        src = self.split.target_of(g)
        self.wire.await_peer(src, stop)
        rows, length = (int(x) for x in b.input_ids.shape)
        header = {
            "rows": rows,
            "len": length,
            "features": self.feature_dim,
            "final": self.final_dim,
            "ids": b.sample_ids.tolist(),  # CPU tensor
        }
        with _on(self.stream):
            feats = torch.empty(
                (rows, length, self.feature_dim), dtype=self.wire_dtype, device=self.device
            )
            final = (
                torch.empty((rows, length, self.final_dim), dtype=self.wire_dtype,
                            device=self.device)
                if self.final_dim
                else None
            )  # fmt: skip
            bufs = [t for t in (feats, final) if t is not None]
            works = [dist.irecv(t, src, tag=i) for i, t in enumerate(bufs)]
            self.wire.store.set(_ask_key(item.epoch, g), json.dumps(header))
            self.wire.finish(
                works, f"the receive of batch {g} of epoch {item.epoch} from target rank {src}"
            )
            if feats.dtype != self.feature_dtype:
                feats = feats.to(self.feature_dtype)
                final = final.to(self.feature_dtype) if final is not None else None
            ids = b.input_ids.to(self.device, non_blocking=True)
            mask = b.loss_mask.to(self.device, non_blocking=True)
            event = None
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
        return HiddenBatch.of(item, ids, mask, feats, final, event)

    def close(self) -> None:
        """No more asks from this rank (after its last one): the target ranks skip the rest."""
        if self.closed:
            return
        self.closed = True
        try:
            self.wire.store.set(_stop_key(self.ctx.rank), "1")
        except Exception as e:  # the store host is gone: the targets fail on their own
            log.warning("could not tell the target ranks that this drafter stopped: %s", e)


class FeatureReceiver(Stage):
    """work_q -> FeatureSource -> hs_q on a drafter rank, in the plan's order. Passes EpochEnd
    and End on; whatever ends it, the target ranks are told that it asks for nothing more."""

    role = "feed"

    def __init__(
        self,
        name,
        *,
        events,
        stop,
        faults,
        source: FeatureSource,
        work_q: BoundedQueue,
        hs_q: BoundedQueue,
    ):
        super().__init__(name, events=events, stop=stop, faults=faults)
        self.source, self.work_q, self.hs_q = source, work_q, hs_q

    def on_end(self, item: End) -> None:
        self.hs_q.put(End(self.name), self.stop)

    def on_epoch_end(self, item: EpochEnd) -> None:
        self.hs_q.put(item, self.stop)

    def loop(self) -> None:
        self.source.wire.announce()
        try:
            self._loop()
        finally:
            self.source.close()

    def _loop(self) -> None:
        c = self.counters
        for item in self.items(self.work_q):
            assert isinstance(item, WorkItem), type(item)
            t0 = time.perf_counter_ns()
            c.begin_busy(t0)
            # the receive buffers live on the drafter's device (no fault hook: `target` faults
            # fire on target ranks)
            with oom_context("drafter", item.batch.input_ids.shape):
                hb = self.source(item, self.stop)
            t1 = time.perf_counter_ns()
            c.end_busy(t1)
            self.hs_q.put(hb, self.stop)
            c.wait_out_ns += time.perf_counter_ns() - t1
            c.steps += 1
            c.items += int(item.batch.sample_ids.numel())
            c.tokens += item.batch.num_real_tokens
            c.padded_tokens += item.batch.num_padded_tokens
            c.beat()
