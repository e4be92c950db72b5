"""A target rank of a `pipeline.split` job (pipeline/split.py has the layout, pipeline/feed.py
the protocol). A drafter rank trains through the usual Trainer, its features received from the
target ranks (run/trainer.py, `_build_fed_stages`); a target rank runs `TargetRank`: its share
of each epoch's plan through the frozen target, the features sent to the drafter ranks that ask
for them, under the usual supervisor (failures, stall detector, monitor).

A target rank keeps no training state: it starts where the drafter ranks' checkpoint says they
are (their position is a prefix of the epoch's plan: the first done x D batches) and writes
nothing but its log. A signal it receives joins the drafter ranks' stop vote (pipeline/split.py
SIGNAL_KEY); it ends when the drafters it feeds stop asking.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.checkpoint import contiguous_prefix
from dflash_trainer.config import Config
from dflash_trainer.errors import UserError
from dflash_trainer.observe.balance import remote_target
from dflash_trainer.observe.monitor import Monitor
from dflash_trainer.pipeline.feed import FeatureSender, ShardPrefetcher, target_start, wire_dtype
from dflash_trainer.pipeline.queues import BoundedQueue
from dflash_trainer.pipeline.runtime import SignalGuard, Supervisor
from dflash_trainer.pipeline.split import BALANCE_KEY, SIGNAL_KEY, Split
from dflash_trainer.pipeline.stage import FaultInjector
from dflash_trainer.pipeline.steps import TargetStep
from dflash_trainer.pipeline.workers import TargetWorker
from dflash_trainer.run.build import claim_run_dir, resume_plan
from dflash_trainer.run.trainer import NullMonitor, TrainResult, check_taps
from dflash_trainer.train.objective import needs_final_hidden

log = logging.getLogger(__name__)


def target_position(cfg: Config, split: Split, rank: int) -> tuple[tuple[int, int], list | None]:
    """((epoch, seq_no) of this target rank's first batch, the samples its first epoch skips):
    from the checkpoint the drafter ranks resume from, if any."""
    plan = resume_plan(cfg, Path(cfg.run_dir), 0, split.drafters, claim_run_dir(cfg, rank))
    if plan is None:
        return (0, 0), None
    ranks = plan.meta.get("ranks") or []
    if int(plan.meta.get("world_size", 1)) == split.drafters and ranks:
        where = {(r["epoch"], len(r["consumed"])) for r in ranks}
        if len(where) > 1:
            raise UserError(
                f"checkpoint {plan.path}: its {len(ranks)} drafter ranks stopped at different "
                f"positions {sorted(where)}; a split job needs them in lockstep (as every "
                "torchrun checkpoint of this project has them)"
            )
    st = plan.state
    start = target_start(st.epoch, contiguous_prefix(st.consumed), split, rank - split.drafters)
    return start, plan.epoch_skip


class TargetRank:
    """One target rank: prefetcher (ShardPrefetcher) -> target worker -> feed sender."""

    def __init__(self, cfg: Config, ctx, split: Split, target, train_set, observe: bool = True):
        p, o = cfg.pipeline, cfg.objective
        self.cfg, self.ctx, self.split = cfg, ctx, split
        self.run_dir = Path(cfg.run_dir)
        self.stop, self.done = threading.Event(), threading.Event()
        self.events: queue.Queue = queue.Queue()
        faults = FaultInjector(p.fault, ctx.rank)
        start, skip = target_position(cfg, split, ctx.rank)
        work_q = BoundedQueue("work", p.work_queue_size, p.poll_s)
        hs_q = BoundedQueue("hidden", p.hs_queue_size, p.poll_s)
        device = torch.device(p.target_devices[0])
        common: dict[str, Any] = dict(events=self.events, stop=self.stop, faults=faults)
        self.prefetcher = ShardPrefetcher(
            train_set,
            cfg.batching,
            work_q,
            self.stop,
            self.events,
            epochs=cfg.optim.epochs,
            pin_memory=device.type == "cuda",
            start=start,
            skip_samples=skip,
            faults=faults,
            split=split,
            target_index=ctx.rank - split.drafters,
        )
        final = needs_final_hidden(o.kd_weight, o.hidden_weight, o.label_source)
        step = TargetStep(target, device, wire_dtype(device), final)
        check_taps(cfg, step, "target0")
        self.worker = TargetWorker(
            "target0",
            threads=p.cpu_threads,
            step_fn=step,
            work_q=work_q,
            hs_q=hs_q,
            lock=threading.Lock(),
            **common,
        )
        self.sender = FeatureSender(
            "feed0",
            ctx=ctx,
            split=split,
            hs_q=hs_q,
            done=self.done,
            max_in_flight=p.hs_queue_size,
            **common,
        )
        self.threads = [self.prefetcher, self.worker, self.sender]
        self.mon = (
            Monitor(
                cfg.metrics,
                self.run_dir,
                workers=[t.counters for t in self.threads],
                queues=[work_q, hs_q],
                composition=self.prefetcher.composition,
                devices=[device],
                rank=ctx.rank,
            )
            if observe
            else NullMonitor()
        )
        self.signals = SignalGuard()
        self._signalled = False
        self.sup = Supervisor(
            threads=self.threads,
            events=self.events,
            stop=self.stop,
            done=self.done,
            monitor=self.mon,
            tick_s=cfg.metrics.tick_s,
            deadline_s=p.shutdown_deadline_s,
            stall_timeout_s=p.stall_timeout_s,
            on_tick=self.on_tick,
        )

    def on_tick(self) -> None:
        """Main thread: a signal joins the drafters' stop vote; a peer's failure stops this
        rank, naming it."""
        if self.signals.requested.is_set() and not self._signalled:
            self._signalled = True
            self.ctx.store.set(SIGNAL_KEY, str(self.ctx.rank))
            log.warning("signal: the drafter ranks stop after their next step (vote)")
        self.ctx.check_peers(self.events)
        self.publish()

    def publish(self) -> None:
        """This rank's target figures for drafter rank 0's balance verdict (best effort)."""
        try:
            figures = remote_target(self.worker.counters)
            self.ctx.store.set(BALANCE_KEY.format(rank=self.ctx.rank), json.dumps(figures))
        except Exception as e:  # like every collector: never fails the run
            log.debug("target figures not published: %s", e)

    def run(self) -> TrainResult:
        t0 = time.monotonic()
        t, n = self.ctx.rank - self.split.drafters, self.split.targets
        log.info(
            "target rank %d of split %s: batches %d, %d, %d, ... of each epoch's plan, from "
            "epoch %d, batch %d of this share",
            self.ctx.rank,
            self.split.spec,
            t,
            t + n,
            t + 2 * n,
            *self.prefetcher.start_position,
        )
        with self.signals:
            try:
                outcome = self.sup.run()
            except BaseException as e:
                raise self.ctx.explain_failure(e)  # noqa: B904
        self.publish()  # final figures
        self.mon.tick()
        metrics = dict(self.mon.latest())
        self.mon.close()
        return TrainResult(
            run_dir=self.run_dir,
            steps=0,
            reason=outcome.reason,
            wall_s=time.monotonic() - t0,
            tokens=self.sender.counters.tokens,
            export_dir=None,
            checkpoint=None,
            metrics=metrics,
            train_s=outcome.wall_s,
        )


def run_target_rank(
    cfg: Config, ctx, split: Split, *, target, train_set, observe: bool = True, **_unused
) -> TrainResult:
    """Train as target rank `ctx.rank` of `split` (run/distributed.py calls it)."""
    return TargetRank(cfg, ctx, split, target, train_set, observe=observe).run()
