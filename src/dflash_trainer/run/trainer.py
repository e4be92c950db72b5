"""`Trainer`: wires one run's pipeline from its built parts (run/build.py) and runs it.

The data flow, the stage table and the shutdown protocol are in pipeline/runtime.py. One batch:
BatchPrefetcher (pipeline/prefetcher.py) -> work_q -> TargetWorker (pipeline/workers.py) running
TargetStep (pipeline/steps.py) -> hs_q -> DrafterWorker -> StepLoop -> DrafterStep ->
DFlashObjective (train/objective.py) -> GuardedStep (train/optim.py).
Between optimizer steps the drafter thread runs the run's hooks (run/hooks.py: periodic
checkpoint and evaluation, and under torchrun the stop vote); the supervisor ticks them too. The
hooks hold only what they use, never the Trainer: no reference cycle keeps a finished run alive.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_trainer.checkpoint import (
    AsyncCheckpointWriter,
    contiguous_prefix,
)
from dflash_trainer.config import Config
from dflash_trainer.eval.parity import parity_gate
from dflash_trainer.layout import RunLayout
from dflash_trainer.models.export import (
    export_drafter,
    export_dtype,
    serving_note,
    training_record,
)
from dflash_trainer.observe.balance import assess as assess_balance
from dflash_trainer.observe.flops import FlopsModel
from dflash_trainer.observe.monitor import Monitor
from dflash_trainer.observe.progress import console_above_bar
from dflash_trainer.observe.ranks import MergingSink, merge_snapshots
from dflash_trainer.observe.scalars import ScalarRing
from dflash_trainer.observe.sinks import build_sinks
from dflash_trainer.pipeline.cores import DrafterTeam
from dflash_trainer.pipeline.feed import FeatureReceiver, FeatureSource
from dflash_trainer.pipeline.prefetcher import BatchPrefetcher
from dflash_trainer.pipeline.queues import BoundedQueue
from dflash_trainer.pipeline.runtime import SignalGuard, Supervisor
from dflash_trainer.pipeline.split import Split
from dflash_trainer.pipeline.stage import FaultInjector, Stage
from dflash_trainer.pipeline.steps import DrafterStep, TargetStep
from dflash_trainer.pipeline.workers import (
    DrafterWorker,
    SequentialWorker,
    StepLoop,
    TargetWorker,
)
from dflash_trainer.run.build import (
    RunParts,
    build_run,
    feature_cache,
    replicate_target,
    share_cores,
    thread_split,
)
from dflash_trainer.run.evaluation import PeriodicEval
from dflash_trainer.run.hooks import CheckpointExport, CheckpointLogged, RunHooks
from dflash_trainer.run.rundir import Claim

log = logging.getLogger(__name__)


class RecordingRing:
    """The drafter's ScalarRing as the monitor sees it: drains also feed the run's history and
    the latest values the supervisor checks (e.g. consecutive skipped steps)."""

    def __init__(self, ring: ScalarRing):
        self.ring = ring
        self.history: list[tuple[int, dict]] = []
        self.last: dict[str, float] = {}

    @property
    def dropped(self) -> int:
        return self.ring.dropped

    def consecutive_skips(self) -> float:
        """The latest count of consecutive skipped optimizer steps (the supervisor's check)."""
        return self.last.get("consecutive_skips", 0.0)

    def drain(self, limit=None):
        out = self.ring.drain(limit)
        self.history.extend(out)
        for _, values in out:
            self.last.update(values)
        return out


class NullMonitor:
    """Observability switched off (benchmarks): no monitor work, no metrics ring, no sinks."""

    def tick(self):
        pass

    def latest(self):
        return {}

    def stalled(self, timeout_s):
        return []

    def log_event(self, record, step=None):
        pass

    def close(self):
        pass


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    reason: str
    wall_s: float  # the whole call: building, training, final checkpoint, evaluation, export
    tokens: int
    export_dir: Path | None
    checkpoint: Path | None
    metrics: dict = field(default_factory=dict)  # last monitor snapshot
    history: list = field(default_factory=list)  # (step, drafter metrics) from the ring
    balance: str = ""  # which stage bounded the run, and advice
    # the end-of-run evaluation on every reported held-out prompt (eval.at_end): eval/tau,
    # eval/tau/<source>, eval/tau_sim, eval/tau_sim_gap, ...; empty when none ran
    eval: dict = field(default_factory=dict)
    # seconds the stages ran (supervised training only): tokens / train_s is the training rate
    # without start-up, the final checkpoint, evaluation and export
    train_s: float = 0.0
    # tokens/s from the end of the first optimizer step to the end of the last: the rate a long
    # run converges to (a pipeline's fill before the first step and the batches its target ran
    # ahead at the end are left out; in a 12-step benchmark they are ~15% of the time); 0.0
    # with fewer than two steps
    steady_tok_s: float = 0.0


def setup_run_logging(run_dir: Path, rank: int = 0) -> logging.Handler:
    """Full tracebacks go to the run's log (layout.py); the console gets one-line messages."""
    run_dir.mkdir(parents=True, exist_ok=True)
    h = logging.FileHandler(RunLayout(run_dir).log(rank), encoding="utf-8")
    h.setLevel(logging.DEBUG)
    h.setFormatter(
        logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(name)s: %(message)s")
    )
    logging.getLogger().addHandler(h)
    return h


def check_taps(cfg: Config, step: TargetStep, name: str) -> None:
    if not cfg.target.check_taps:
        return
    t0 = time.perf_counter()
    err = step.check()
    log.info(
        "%s: tapped layers %s match output_hidden_states (max relative error %.1e; "
        "checked in %.2f s)",
        name,
        step.target.layer_ids,
        err,
        time.perf_counter() - t0,
    )


class Trainer:
    """One run: the drafter step, the step loop, the stage threads, the monitor and the
    supervisor, built from `parts`; `run()` trains, checkpoints, evaluates and exports.

    `dist`: a pipeline.distributed.DistContext when this process is one rank of a torchrun job.
    `monitor`: a monitor to use instead of building one (it is not closed); `observe=False`
    switches observability off (benchmarks). `captured`: the target's features kept while
    generating the data (pipeline/feature_cache.py: CapturedFeatures), for the feature cache."""

    def __init__(
        self, parts: RunParts, *, dist=None, monitor=None, observe: bool = True, captured=None
    ):
        cfg = parts.cfg
        self.parts, self.cfg, self.dist, self.observe = parts, cfg, dist, observe
        self.rank, self.run_dir = parts.rank, parts.run_dir
        self.start_steps = parts.state.step
        self.recorder, self.drafter_step = self._build_drafter_step()
        self.logged = CheckpointLogged()
        self.writer = AsyncCheckpointWriter(
            parts.run_dir,
            keep_last=cfg.checkpoint.keep_last,
            export_fn=CheckpointExport(cfg, parts),
            on_done=self.logged,
            timeout_s=cfg.checkpoint.write_timeout_s,
        )
        self.target_lock = threading.Lock()  # the target worker and the periodic eval share it
        self.evaluator = PeriodicEval(
            cfg, parts.target, parts.drafter, parts.heldout, parts.run_dir, self.target_lock
        )
        self.events: queue.Queue = queue.Queue()
        self.signals = SignalGuard()
        ledger: list = []
        self.hooks = RunHooks(
            cfg,
            parts,
            ledger=ledger,
            writer=self.writer,
            evaluator=self.evaluator,
            events=self.events,
            dist=dist,
            signals=self.signals,
        )
        self.loop = StepLoop(
            step_fn=self.drafter_step,
            state=parts.state,
            max_steps=parts.total_steps,
            hooks=self.hooks,
            ledger=ledger,
            budget=parts.budget,
        )
        self.stop = threading.Event()
        self.done = threading.Event()
        self._build_stages(captured)
        self.own_monitor = monitor is None
        self.mon = self._build_monitor(monitor)
        self.hooks.mon = self.logged.mon = self.mon
        if parts.memory is not None and self.rank == 0:
            self.mon.log_event(parts.memory.record(), self.start_steps)
        self.hooks.counters = self.threads[-1].counters
        if observe and self.rank == 0 and cfg.metrics.console:
            self.hooks.progress(self.start_steps)
        self.bar = self.hooks.bar
        p = cfg.pipeline
        self.sup = Supervisor(
            threads=self.threads,
            events=self.events,
            stop=self.stop,
            done=self.done,
            monitor=self.mon,
            tick_s=cfg.metrics.tick_s,
            deadline_s=p.shutdown_deadline_s,
            stall_timeout_s=p.stall_timeout_s,
            max_consecutive_skips=cfg.optim.max_consecutive_skips,
            consecutive_skips=self.recorder.consecutive_skips,
            on_tick=self.hooks.on_tick,
            # torchrun: a signal only feeds the stop vote (all ranks stop together)
            signals=self.signals if dist is None else None,
        )
        self.t0 = time.monotonic()

    # ------------------------------------------------------------------ building
    def _build_drafter_step(self) -> tuple[RecordingRing, DrafterStep]:
        p = self.parts
        ring = ScalarRing(
            DrafterStep.metric_names(p.objective), capacity=256, device=p.drafter_device
        )
        step = DrafterStep(
            drafter=p.model,
            objective=p.objective,
            embed_weight=p.embed_weight,
            lm_head=p.lm_head,
            scheduler=p.scheduler,
            optim_step=p.optim_step,
            generator=p.generator,
            device=p.drafter_device,
            grad_accum=self.cfg.optim.grad_accum,
            autocast_bf16=p.autocast,
            ring=ring if self.observe else None,
            policy=p.anchor_policy,
        )
        return RecordingRing(ring), step

    def _build_prefetcher(
        self, work_q: BoundedQueue, faults: FaultInjector, start: tuple[int, int]
    ) -> BatchPrefetcher:
        """From `start`, this rank's training position (a resume continues inside its epoch)."""
        cfg, parts = self.cfg, self.parts
        return BatchPrefetcher(
            parts.train_set,
            cfg.batching,
            work_q,
            self.stop,
            self.events,
            epochs=cfg.optim.epochs,
            rank=self.rank,
            world_size=parts.world_size,
            pin_memory=any(d.startswith("cuda") for d in cfg.pipeline.target_devices),
            start=start,
            skip_samples=parts.resume.epoch_skip if parts.resume is not None else None,
            faults=faults,
        )

    def start_position(self) -> tuple[int, int]:
        """(epoch, seq_no) of this rank's first batch: a resume continues inside its epoch."""
        state = self.parts.state
        return state.epoch, contiguous_prefix(state.consumed)

    def _build_stages(self, captured=None) -> None:
        """The prefetcher, then target + drafter workers (pipelined) or one sequential worker."""
        cfg, p, parts = self.cfg, self.cfg.pipeline, self.parts
        faults = FaultInjector(p.fault, self.rank)
        pipelined = p.schedule == "pipelined"
        n_targets = len(p.target_devices) if pipelined else 1
        # work_q: the prefetcher -> every target worker (or the sequential worker)
        work_q = BoundedQueue("work", p.work_queue_size, p.poll_s, consumers=n_targets)
        t_threads, d_threads = thread_split(cfg)
        start = self.start_position()  # the prefetcher's and the drafter's first batch
        self.prefetcher = self._build_prefetcher(work_q, faults, start)
        # KD and hidden regression: the target step also hands over its final hidden states.
        kd = parts.objective.needs_target_hidden
        self.cache = feature_cache(cfg, parts, captured)
        self.cores = None  # CPU pipelines only (set below)
        target_step = TargetStep(
            parts.target, parts.drafter_device, parts.feature_dtype, kd, self.cache
        )
        self.threads: list[Stage] = [self.prefetcher]
        self.queues = [work_q]
        common = dict(events=self.events, stop=self.stop, faults=faults)
        if getattr(self.dist, "split", None) is not None:  # target ranks feed this one
            self._build_fed_stages(work_q, start, common)
            return
        if not pipelined:
            check_taps(cfg, target_step, "target")
            self.threads.append(
                SequentialWorker(
                    "sequential0",
                    threads=t_threads,
                    target_step=target_step,
                    step_loop=self.loop,
                    work_q=work_q,
                    done=self.done,
                    lock=self.target_lock,
                    **common,
                )
            )
            return
        hs_q = BoundedQueue("hidden", p.hs_queue_size, p.poll_s, producers=n_targets)
        self.queues.append(hs_q)
        first = parts.target
        targets = [first] if len(p.target_devices) == 1 else replicate_target(cfg, first)
        self.cores = share_cores(cfg, hs_q, self.cache, d_threads, t_threads * len(targets))
        for i, tgt in enumerate(targets):
            step_fn = (
                target_step
                if i == 0
                else TargetStep(tgt, parts.drafter_device, parts.feature_dtype, kd, self.cache)
            )
            if i == 0 or tgt is not first:  # a target shared with worker 0 is checked once
                check_taps(cfg, step_fn, f"target{i}")
            self.threads.append(
                TargetWorker(
                    f"target{i}",
                    threads=t_threads,
                    step_fn=step_fn,
                    work_q=work_q,
                    hs_q=hs_q,
                    lock=self.target_lock,
                    cores=self.cores,
                    **common,
                )
            )
        if self.cores is not None:
            self.loop.team = DrafterTeam(self.cores, d_threads)
        self.threads.append(self._drafter_worker(hs_q, len(targets), d_threads, start, common))

    def _drafter_worker(self, hs_q, producers: int, threads: int, start, common) -> DrafterWorker:
        return DrafterWorker(
            "drafter0",
            threads=threads,
            step_loop=self.loop,
            hs_q=hs_q,
            num_producers=producers,
            done=self.done,
            start=start,
            **common,
        )

    def _build_fed_stages(self, work_q: BoundedQueue, start, common) -> None:
        """pipeline.split, a drafter rank: the features of its batches come from the target
        ranks (pipeline/feed.py) instead of a target worker; the drafter takes every thread."""
        p, parts = self.cfg.pipeline, self.parts
        hs_q = BoundedQueue("hidden", p.hs_queue_size, p.poll_s)
        self.queues.append(hs_q)
        target = parts.target
        source = FeatureSource(
            self.dist,
            self.dist.split,
            parts.drafter_device,
            len(target.layer_ids) * int(target.hidden_size),
            int(target.hidden_size) if parts.objective.needs_target_hidden else 0,
            parts.feature_dtype,
        )
        self.threads.append(
            FeatureReceiver("feed0", source=source, work_q=work_q, hs_q=hs_q, **common)
        )
        self.threads.append(self._drafter_worker(hs_q, 1, p.cpu_threads, start, common))

    def _build_monitor(self, monitor):
        if not self.observe:
            return NullMonitor()
        if monitor is not None:
            return monitor
        cfg, parts, p = self.cfg, self.parts, self.cfg.pipeline
        sinks = None
        if self.dist is not None and self.rank == 0:  # merged per-rank metrics; rank 0 writes
            inner = build_sinks(cfg.metrics, parts.run_dir, parts.config_dict)
            sinks = MergingSink(inner, self.dist)
        target = parts.target
        devices = {torch.device(d) for d in p.target_devices} | {parts.drafter_device}
        return Monitor(
            cfg.metrics,
            parts.run_dir,
            sinks=sinks,
            config_dict=parts.config_dict,
            workers=[t.counters for t in self.threads],
            queues=self.queues,
            composition=self.prefetcher.composition,
            rings={"drafter": self.recorder},
            devices=sorted(devices, key=str),
            flops=FlopsModel.from_configs(
                target.model.config,
                max(target.layer_ids) + 1,
                parts.drafter.config,
                seq_len=float(parts.train_set.lengths.mean()),
                loss_slots=parts.objective.loss_slots,
                read_slots=parts.drafter.last_layer_slots(
                    parts.objective.read_slots, parts.objective.attention, parts.drafter_device
                ),
            ),
            rank=self.rank,
        )

    def checkpoint_now(self, background: bool = False) -> Path | None:
        """A checkpoint of this step boundary (RunHooks.checkpoint_now)."""
        return self.hooks.checkpoint_now(background)

    # ------------------------------------------------------------------ running
    def _supervise(self) -> str:
        """Run the stages to their end; the reason ("finished", at the end of the data or at
        optim.max_steps; "signal"; "time_budget")."""
        with self.signals:
            if self.start_steps >= self.parts.total_steps:
                log.info(
                    "already at step %d of %d: nothing to train",
                    self.start_steps,
                    self.parts.total_steps,
                )
                return "finished"
            try:
                outcome = self.sup.run()
            except BaseException as e:
                if self.dist is None:
                    raise
                # explain_failure returns `e` or an error whose __cause__ it set itself
                raise self.dist.explain_failure(e)  # noqa: B904
            reason = "signal" if self.loop.stopped_by_vote else outcome.reason
            budget = self.parts.budget
            if budget is not None and budget.spent() and not self.signals.requested.is_set():
                log.info(
                    "time budget of %.0f s spent at step %d", budget.seconds, self.loop.state.step
                )
                reason = "time_budget"
            return reason

    def _balance_context(self) -> dict:
        """What the balance verdict knows beyond this process's workers: a split job's target
        ranks (their figures through the store) and the devices to advise a T:D split over (a
        split's ranks; a CUDA run's visible GPUs; none on CPU)."""
        split = getattr(self.dist, "split", None)
        if split is not None:
            remote = self.dist.target_figures()
            return dict(
                remote=remote, split=(split.targets, split.drafters), devices=split.world_size
            )
        cuda = self.parts.drafter_device.type == "cuda"
        return dict(devices=torch.cuda.device_count() if cuda else 0)

    def _report_balance(self) -> str:
        bal = assess_balance([t.counters for t in self.threads], **self._balance_context())
        balance = bal.advice() if bal is not None else ""
        if self.cores is not None:
            balance = f"{balance} {self.cores.summary()}.".strip()
        if self.cache is not None:
            balance = f"{balance} {self.cache.summary()}.".strip()
        if balance:
            log.info("%s", balance)
        if bal is None:
            return balance
        self.mon.log_event(
            {
                "pipeline/verdict": bal.verdict,
                "pipeline/target_busy": round(bal.target_busy, 4),
                "pipeline/drafter_busy": round(bal.drafter_busy, 4),
                "pipeline/target_tok_s_per_worker": round(bal.target_tok_s, 1),
                "pipeline/drafter_tok_s": round(bal.drafter_tok_s, 1),
                "pipeline/targets_per_drafter": round(bal.targets_per_drafter, 3),
            },
            self.loop.state.step,
        )
        return balance

    def _evaluate_at_end(self, reason: str, export_dir: Path | None) -> dict:
        """The validation subset once more (best/ sees the final drafter), then every reported
        held-out prompt with the export (eval.at_end). Rank 0 only; skipped after a signal."""
        if self.rank != 0 or reason == "signal":
            return {}
        step = self.loop.state.step
        if self.cfg.eval.every_steps:
            rec = self.evaluator.run(step)
            if rec:
                self.mon.log_event(rec, step)
        if not self.cfg.eval.at_end:
            return {}
        rec = self.evaluator.final(step, export_dir)
        if not rec:
            return {}
        self.mon.log_event(rec, step)
        return rec

    def _parity_gate(self, export_dir: Path | None, reason: str) -> dict | None:
        """eval.parity: vLLM serving the export must decode as our loop does (eval/parity.py):
        the check on the end-of-run evaluation's vLLM comparison where it made one, else on a
        pinned sample of the reported held-out prompts; a UserError stops the run after the
        checkpoint and the export are written. Rank 0; skipped after a signal."""
        if self.cfg.eval.parity == "off" or self.rank != 0 or reason == "signal":
            return None
        ev = self.evaluator
        pinned = sorted(ev.report or ev.validation, key=lambda e: e.id)
        pinned = pinned[: self.cfg.eval.parity_prompts]
        if export_dir is None or not pinned:
            log.warning("parity gate: no export or no held-out prompts to serve; skipped")
            return None
        target, drafter = ev.eval_target(), ev.exported_drafter(export_dir)  # in eval.dtype
        prompts = [e.prompt for e in pinned]
        rec = parity_gate(
            self.cfg, target, drafter, export_dir, prompts, ev.dtype_name, ev.final_run
        )
        if rec:
            self.mon.log_event(rec, self.loop.state.step)
        return rec

    def _export_final(self) -> Path | None:
        if self.rank != 0:
            return None
        record = training_record(self.parts.config_dict, step=self.loop.state.step)
        note = serving_note(getattr(self.parts.target.model.config, "architectures", None))
        if note:
            log.warning("export: %s", note)
        dtype = export_dtype(self.cfg.checkpoint.export_dtype)
        # export_drafter replaces the directory atomically itself
        return export_drafter(
            self.parts.drafter, RunLayout(self.run_dir).export, dtype, training=record
        )

    def run(self) -> TrainResult:
        merged: dict = {}
        console = console_above_bar(self.bar)  # log lines print above the progress bar
        try:
            t_train = time.monotonic()
            reason = self._supervise()
            train_s = time.monotonic() - t_train
            balance = self._report_balance()
            # The drafter thread has stopped: its state is consistent. Checkpoint + export.
            if self.dist is not None:  # final snapshot; the checkpoint gather then orders it
                self.hooks.publish(final=True)
            ck = self.checkpoint_now()
            if self.dist is not None and self.rank == 0:
                merged.update(merge_snapshots(self.dist.snapshots(), self.parts.world_size))
            export_dir = self._export_final()  # first: the end-of-run evaluation decodes it
            final_eval = self._evaluate_at_end(reason, export_dir)
            parity = self._parity_gate(export_dir, reason)
            if parity:
                final_eval = {**final_eval, **parity}
        finally:
            if self.bar is not None:
                self.bar.close()
            console.close()
            try:  # a background write still in flight after a failure: let it land
                self.writer.wait()
            except BaseException as e:
                log.error("background checkpoint write failed: %s", e)
            self.mon.tick()
            history = list(self.recorder.history)
            final_metrics = dict(self.mon.latest())
            final_metrics.update(merged)
            if self.own_monitor:
                self.mon.close()
            self.evaluator.close()
        st = self.loop.state
        return TrainResult(
            run_dir=self.run_dir,
            steps=st.step,
            reason=reason,
            wall_s=time.monotonic() - self.t0,
            tokens=st.tokens,
            export_dir=export_dir,
            checkpoint=ck,
            metrics=final_metrics,
            history=history,
            balance=balance,
            eval=final_eval,
            train_s=train_s,
            steady_tok_s=self.hooks.steady.rate(),
        )


def train(
    cfg: Config,
    *,
    target=None,
    train_set=None,
    heldout=None,
    rank: int = 0,
    world_size: int = 1,
    ddp_wrap=None,
    monitor=None,
    observe: bool = True,
    dist=None,
    captured=None,
    claimed: Claim | None = None,
) -> TrainResult:
    """Build the run from `cfg` (the given target / datasets are used instead of loading them)
    and train it. `dist`: a pipeline.distributed.DistContext when this process is one rank of a
    torchrun job (run.distributed.train_distributed builds it); it sets rank/world_size and the
    DDP wrapper. `captured`: features kept while generating the data (Trainer). `claimed`: the
    run directory's policy as the caller already applied it (run/rundir.py); None: train
    applies it."""
    if dist is not None:
        rank, world_size = dist.rank, dist.world_size
        ddp_wrap = ddp_wrap if ddp_wrap is not None else dist.ddp_wrap
    split = Split.of(cfg.pipeline.split)
    if split is not None and getattr(dist, "split", None) is None:
        split.check_world(1)  # refused: a split runs under torchrun (run/distributed.py)
    parts = build_run(
        cfg,
        target=target,
        train_set=train_set,
        heldout=heldout,
        rank=rank,
        world_size=world_size,
        ddp_wrap=ddp_wrap,
        claimed=claimed,
    )
    return Trainer(parts, dist=dist, monitor=monitor, observe=observe, captured=captured).run()
