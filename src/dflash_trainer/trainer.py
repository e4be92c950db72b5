"""`dflash-trainer train`: build target, data, drafter, optimizer and pipeline; run; checkpoint.

`train(cfg, ...)` is the library entry point (the demo, benchmarks and tests call it with their own
target or dataset); `train_command` is the CLI wrapper.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_trainer.checkpoint import (
    AsyncCheckpointWriter,
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    snapshot_checkpoint,
)
from dflash_trainer.config import Config, to_dict
from dflash_trainer.data.batching import plan_epoch
from dflash_trainer.errors import UserError
from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter
from dflash_trainer.models.export import export_drafter, export_weights
from dflash_trainer.observe.balance import assess as assess_balance
from dflash_trainer.observe.flops import FlopsModel
from dflash_trainer.observe.scalars import ScalarRing
from dflash_trainer.pipeline.queues import BoundedQueue
from dflash_trainer.pipeline.runtime import SignalGuard, Supervisor
from dflash_trainer.pipeline.workers import (
    DrafterWorker,
    FaultInjector,
    SequentialWorker,
    TargetWorker,
    Trainer,
)
from dflash_trainer.train.objective import DFlashObjective
from dflash_trainer.train.optim import GuardedStep, build_optimizer, build_scheduler
from dflash_trainer.train.step import DrafterStep, TargetStep

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
    wall_s: float
    tokens: int
    export_dir: Path | None
    checkpoint: Path | None
    metrics: dict = field(default_factory=dict)  # last monitor snapshot
    history: list = field(default_factory=list)  # (step, drafter metrics) from the ring
    balance: str = ""  # which stage bounded the run, and advice


def setup_run_logging(run_dir: Path, name: str = "train.log") -> logging.Handler:
    """Full tracebacks go to {run_dir}/train.log; the console gets one-line messages."""
    run_dir.mkdir(parents=True, exist_ok=True)
    h = logging.FileHandler(run_dir / name, encoding="utf-8")
    h.setLevel(logging.DEBUG)
    h.setFormatter(
        logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(name)s: %(message)s")
    )
    logging.getLogger().addHandler(h)
    return h


def thread_split(cfg: Config) -> tuple[int, int]:
    """(target threads per worker, drafter threads) for CPU stages."""
    total = cfg.pipeline.cpu_threads or os.cpu_count() or 1
    if cfg.pipeline.schedule == "sequential":
        return total, total
    t = max(1, round(total * cfg.pipeline.target_thread_share))
    return t, max(1, total - t)


def count_steps(lengths, cfg: Config, rank: int = 0, world: int = 1) -> tuple[int, list[int]]:
    per_epoch = [
        len(plan_epoch(lengths, cfg.batching, e, rank, world)) for e in range(cfg.optim.epochs)
    ]
    total = sum(per_epoch) // cfg.optim.grad_accum
    if cfg.optim.max_steps:
        total = min(total, cfg.optim.max_steps)
    return total, per_epoch


def _check_taps(cfg: Config, step: TargetStep, name: str) -> None:
    if not cfg.target.check_taps or not hasattr(step.target, "check_taps"):
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


def build_drafter(cfg: Config, target, device) -> DFlashDrafter:
    from dflash_trainer.models.attention import resolve_impl

    try:  # fail before any work, not at the first drafter step
        resolve_impl(cfg.drafter.attention, device)
    except ValueError as e:
        raise UserError(str(e)) from None
    dcfg = DFlashConfig.from_configs(cfg.drafter, target)
    torch.manual_seed(cfg.pipeline.seed)
    return DFlashDrafter(dcfg).to(device)


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
) -> TrainResult:
    """`dist`: a pipeline.distributed.DistContext when this process is one rank of a torchrun
    job (train_distributed builds it); it sets rank/world_size and the DDP wrapper."""
    from dflash_trainer.data.prefetcher import BatchPrefetcher, plan_skipping
    from dflash_trainer.observe.monitor import Monitor
    from dflash_trainer.pipeline import distributed as dist_mod

    if dist is not None:
        rank, world_size = dist.rank, dist.world_size
        ddp_wrap = ddp_wrap if ddp_wrap is not None else dist.ddp_wrap

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.pipeline.seed)
    p = cfg.pipeline
    drafter_device = torch.device(p.drafter_device)
    if target is None:
        from dflash_trainer.models.target import TargetModel

        target = TargetModel.load(cfg.target, p.target_devices[0])
    if train_set is None:
        from dflash_trainer.data.prepare import prepare_data

        train_set, heldout = prepare_data(cfg, target.tokenizer)
    if len(train_set) == 0:
        raise UserError(
            "no training examples left after filtering; check data.sources and data.max_length"
        )

    drafter = build_drafter(cfg, target, drafter_device)
    model = ddp_wrap(drafter) if ddp_wrap is not None else drafter
    autocast = p.precision == "bf16" or (p.precision == "auto" and drafter_device.type == "cuda")
    feature_dtype = (
        torch.bfloat16 if drafter_device.type == "cuda" else next(drafter.parameters()).dtype
    )
    objective = DFlashObjective(
        cfg.drafter.block_size,
        cfg.drafter.num_anchors,
        cfg.drafter.gamma,
        drafter.config.mask_token_id,
        cfg.drafter.loss_chunk_blocks,
    )
    optimizer = build_optimizer(drafter.parameters(), cfg.optim)
    # This rank's position in the checkpoint (another world size: the rest of its epoch is
    # re-planned without the samples already trained), known before the LR schedule is built.
    resume_ck = latest_checkpoint(run_dir) if cfg.checkpoint.resume else None
    rank_state, epoch_skip, set_rank_rng = (None, None, None)
    if resume_ck is not None:
        rank_state, epoch_skip, set_rank_rng = dist_mod.resume_position(
            resume_ck, rank=rank, world_size=world_size, seed=p.seed
        )
    total_steps, per_epoch = count_steps(train_set.lengths, cfg, rank, world_size)
    if epoch_skip is not None:
        first = len(
            plan_skipping(
                train_set.lengths, cfg.batching, rank_state.epoch, rank, world_size, epoch_skip
            ).batches
        )
        left = first - len(rank_state.consumed or []) + sum(per_epoch[rank_state.epoch + 1 :])
        total_steps = rank_state.step + max(0, left) // cfg.optim.grad_accum
        if cfg.optim.max_steps:
            total_steps = min(total_steps, cfg.optim.max_steps)
    lr_segments = [[total_steps, 0]]
    if resume_ck is not None:
        # A checkpoint of a run with another total (world size, epochs): keep the LR curve
        # continuous at the resume step instead of jumping to the new schedule's value there.
        meta = json.loads((resume_ck / "state.json").read_text())
        saved = meta.get("lr_segments") or (
            [[meta["total_steps"], 0]] if meta.get("total_steps") else None
        )
        if saved:
            lr_segments = [list(x) for x in saved]
            if int(lr_segments[-1][0]) != total_steps:
                lr_segments.append([total_steps, rank_state.step])
                log.info(
                    "resuming at step %d of a %d-step schedule with %d steps in all now: "
                    "the rest of the LR schedule is spread over the new remaining steps",
                    rank_state.step,
                    int(saved[-1][0]),
                    total_steps,
                )
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps, lr_segments)
    guard = GuardedStep(optimizer, drafter.parameters(), cfg.optim.grad_clip, drafter_device)
    generator = torch.Generator(device=drafter_device)
    generator.manual_seed(cfg.pipeline.seed * 1000003 + rank)
    config_dict = to_dict(cfg)

    state = TrainState(consumed=[])
    if cfg.checkpoint.resume:
        ck = latest_checkpoint(run_dir)
        if ck is not None:
            state = load_checkpoint(
                ck,
                drafter=drafter,
                optimizer=optimizer,
                scheduler=scheduler,
                generator=generator,
                config=config_dict,
            )
            if rank_state is not None and ck == resume_ck:
                state = rank_state
                set_rank_rng(generator)
            log.info(
                "resumed from %s at step %d (epoch %d, %d batches of it done)",
                ck,
                state.step,
                state.epoch,
                len(state.consumed),
            )
    start_steps = state.step

    # The drafter shares the target's frozen embedding and LM head. Without autocast they must
    # also be in the drafter's dtype (e.g. a bf16 target on CPU with an fp32 drafter): then, or
    # on another device, the drafter gets its own frozen copy.
    head_dtype = target.embed_weight.dtype if autocast else next(drafter.parameters()).dtype
    embed_weight = target.embed_weight.to(drafter_device, dtype=head_dtype)
    lm_head = target.lm_head
    if (
        drafter_device != torch.device(target.device)
        or next(lm_head.parameters()).dtype != head_dtype
    ):
        import copy

        lm_head = copy.deepcopy(target.lm_head).to(drafter_device, dtype=head_dtype)
        lm_head.requires_grad_(False)
    ring = ScalarRing(DrafterStep.metric_names(objective), capacity=256, device=drafter_device)
    recorder = RecordingRing(ring)
    drafter_step = DrafterStep(
        drafter=model,
        objective=objective,
        embed_weight=embed_weight,
        lm_head=lm_head,
        optimizer=optimizer,
        scheduler=scheduler,
        guard=guard,
        generator=generator,
        device=drafter_device,
        grad_accum=cfg.optim.grad_accum,
        autocast_bf16=autocast,
        ring=ring if observe else None,
    )

    def export_fn(out_dir, weights):
        export_weights(drafter.config, weights, out_dir)

    ledger_path = run_dir / "ledger.jsonl"

    def checkpoint_written(path: Path, snap) -> None:
        """After the checkpoint is on disk (writer thread when async): the ledger entries it
        covers, then the event. The ledger never runs ahead of a complete checkpoint."""
        if snap.ledger:
            with open(ledger_path, "a", encoding="utf-8") as f:
                for epoch, ids in snap.ledger:
                    f.write(json.dumps({"epoch": epoch, "samples": ids}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        if mon is not None:
            mon.log_event({"event/checkpoint_step": snap.step}, snap.step)

    writer = AsyncCheckpointWriter(
        run_dir,
        keep_last=cfg.checkpoint.keep_last,
        export_fn=export_fn,
        on_done=checkpoint_written,
        timeout_s=cfg.checkpoint.write_timeout_s,
    )

    def checkpoint_now(trainer: Trainer, background: bool = False) -> Path | None:
        """Snapshot the state at this step boundary and write it: in the background when asked
        and enabled (periodic checkpoints), else before returning (the last one, signals)."""
        extra_meta, extra_blob, gathered = {}, None, None
        if dist is not None:
            # Every rank calls this after the same step (DDP + the stop vote keep them in
            # lockstep): gather positions, anchor RNG states and ledgers to rank 0.
            parts = dist.gather_to_main(
                {
                    "state": trainer.state.to_json(),
                    "generator": generator.get_state(),
                    "ledger": trainer.ledger,
                }
            )
            trainer.ledger = []
            if rank != 0:
                return None
            gathered = [e for part in parts for e in part["ledger"]]
            extra_meta = {"world_size": world_size, "ranks": [q["state"] for q in parts]}
            extra_blob = {"rank_generators": [q["generator"] for q in parts]}
        if rank != 0:
            return None
        extra_meta["total_steps"] = total_steps  # the LR schedule (see lr_segments above)
        extra_meta["lr_segments"] = lr_segments
        if epoch_skip is not None and trainer.state.epoch == rank_state.epoch:
            extra_meta["epoch_skip"] = {"epoch": rank_state.epoch, "samples": epoch_skip}
        ledger, trainer.ledger = trainer.ledger, []
        if gathered is not None:  # torchrun: every rank's entries, gathered to rank 0
            ledger = gathered
        writer.wait()  # the previous write lands first: one snapshot in host memory
        snap = snapshot_checkpoint(
            drafter=drafter,
            optimizer=optimizer,
            scheduler=scheduler,
            generator=generator,
            state=trainer.state,
            config=config_dict,
            extra_meta=extra_meta,
            extra_blob=extra_blob,
            ledger=ledger,
        )
        writer.submit(snap)
        if background and cfg.checkpoint.async_write:
            return None
        return writer.wait()

    target_lock = threading.Lock()  # the target worker and the periodic eval share the target
    evaluator = PeriodicEval(cfg, target, drafter, heldout, run_dir, target_lock)

    def on_step_end(step: int) -> None:
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
            checkpoint_now(trainer, background=True)
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and rank == 0:
            rec = evaluator.run(step)
            if rec and mon is not None:
                mon.log_event(rec, step)

    trainer = Trainer(step_fn=drafter_step, state=state, max_steps=total_steps)
    trainer.on_step_end = on_step_end
    if dist is not None:
        # All ranks stop after the same optimizer step: a MAX vote of "signal received".
        trainer.stop_vote = lambda: dist.agree_stop(signals.requested.is_set())
    trainer.queries_per_row = cfg.drafter.num_anchors * cfg.drafter.block_size

    # ---- threads
    events: queue.Queue = queue.Queue()
    stop = threading.Event()
    done = threading.Event()
    faults = FaultInjector(p.fault, rank)
    work_q = BoundedQueue("work", p.work_queue_size, p.timeout_s)
    t_threads, d_threads = thread_split(cfg)
    remaining_epochs = cfg.optim.epochs
    prefetcher = BatchPrefetcher(
        train_set,
        cfg.batching,
        work_q,
        stop,
        events,
        epochs=remaining_epochs,
        rank=rank,
        world_size=world_size,
        pin_memory=any(d.startswith("cuda") for d in p.target_devices),
        start=(state.epoch, _contiguous_prefix(state.consumed)),
        skip_samples=epoch_skip,
    )
    prefetcher.faults = faults
    target_step = TargetStep(target, drafter_device, feature_dtype)
    threads: list[threading.Thread] = [prefetcher]
    queues = [work_q]
    if p.schedule == "pipelined":
        hs_q = BoundedQueue("hidden", p.hs_queue_size, p.timeout_s)
        queues.append(hs_q)
        targets = [target] if len(p.target_devices) == 1 else _replicate_target(cfg, target)
        for i, tgt in enumerate(targets):
            step_fn = (
                target_step if tgt is target else TargetStep(tgt, drafter_device, feature_dtype)
            )
            _check_taps(cfg, step_fn, f"target{i}")
            threads.append(
                TargetWorker(
                    f"target{i}",
                    events,
                    stop,
                    t_threads,
                    faults,
                    step_fn=step_fn,
                    work_q=work_q,
                    hs_q=hs_q,
                    lock=target_lock,
                )
            )
        threads.append(
            DrafterWorker(
                "drafter0",
                events,
                stop,
                d_threads,
                faults,
                trainer=trainer,
                hs_q=hs_q,
                num_producers=len(targets),
                done=done,
            )
        )
    else:
        _check_taps(cfg, target_step, "target")
        threads.append(
            SequentialWorker(
                "sequential0",
                events,
                stop,
                t_threads,
                faults,
                target_step=target_step,
                trainer=trainer,
                work_q=work_q,
                done=done,
                lock=target_lock,
            )
        )

    workers = [t.counters for t in threads]
    mon = monitor if observe else NullMonitor()
    if mon is None:
        sinks = None
        if dist is not None and rank == 0:  # merged per-rank metrics; only rank 0 writes
            from dflash_trainer.observe.sinks import build_sinks

            sinks = dist_mod.MergingSink(build_sinks(cfg.metrics, run_dir, config_dict), dist)
        mon = Monitor(
            cfg.metrics,
            run_dir,
            sinks=sinks,
            config_dict=config_dict,
            workers=workers,
            queues=queues,
            composition=getattr(prefetcher, "composition", None),
            rings={"drafter": recorder},
            devices=sorted({torch.device(d) for d in p.target_devices} | {drafter_device}, key=str),
            flops=FlopsModel.from_configs(
                target.model.config,
                max(target.layer_ids) + 1,
                drafter.config,
                seq_len=float(train_set.lengths.mean()),
            ),
            rank=rank,
        )
    bar = _progress_bar(cfg, total_steps, start_steps) if observe and rank == 0 else None

    def on_tick():
        if dist is not None:
            dist.publish(
                dist_mod.rank_snapshot(
                    trainer.state, mon.latest(), threads[-1].counters, time.monotonic() - t0
                )
            )
            dist.check_peers(events)  # a peer's failure stops this rank, naming the peer
        if bar is not None:
            c = trainer.state
            bar.n = c.step
            snap = mon.latest()
            bar.set_postfix_str(_postfix(snap), refresh=False)
            bar.refresh()

    signals = SignalGuard()
    sup = Supervisor(
        threads=threads,
        events=events,
        stop=stop,
        done=done,
        monitor=mon,
        tick_s=cfg.metrics.tick_s,
        deadline_s=p.shutdown_deadline_s,
        stall_timeout_s=p.stall_timeout_s,
        max_consecutive_skips=cfg.optim.max_consecutive_skips,
        consecutive_skips=lambda: recorder.last.get("consecutive_skips", 0.0),
        on_tick=on_tick,
        # torchrun: a signal only feeds the stop vote (all ranks stop together)
        signals=signals if dist is None else None,
    )
    t0 = time.monotonic()
    outcome = None
    merged: dict = {}
    balance = ""
    try:
        with signals:
            if start_steps >= total_steps:
                log.info("already at step %d of %d: nothing to train", start_steps, total_steps)
                outcome_reason = "finished"
            else:
                try:
                    outcome = sup.run()
                except BaseException as e:
                    if dist is None:
                        raise
                    # explain_failure returns `e` or an error whose __cause__ it set itself
                    raise dist.explain_failure(e)  # noqa: B904
                outcome_reason = "signal" if trainer.stopped_by_vote else outcome.reason
        bal = assess_balance([t.counters for t in threads])
        if bal is not None:
            balance = bal.advice()
            log.info("%s", balance)
            mon.log_event(
                {
                    "pipeline/verdict": bal.verdict,
                    "pipeline/target_busy": round(bal.target_busy, 4),
                    "pipeline/drafter_busy": round(bal.drafter_busy, 4),
                    "pipeline/target_tok_s_per_worker": round(bal.target_tok_s, 1),
                    "pipeline/drafter_tok_s": round(bal.drafter_tok_s, 1),
                    "pipeline/targets_per_drafter": round(bal.targets_per_drafter, 3),
                },
                trainer.state.step,
            )
        # The drafter thread has stopped: its state is consistent. Checkpoint + export.
        if dist is not None:  # final snapshot; the checkpoint gather then orders it
            dist.publish(
                dist_mod.rank_snapshot(
                    trainer.state,
                    mon.latest(),
                    threads[-1].counters,
                    time.monotonic() - t0,
                    final=True,
                )
            )
        ck = checkpoint_now(trainer)
        if dist is not None and rank == 0:
            merged.update(dist_mod.merge_snapshots(dist.snapshots(), world_size))
        if cfg.eval.every_steps and rank == 0 and outcome_reason != "signal":
            rec = evaluator.run(trainer.state.step)
            if rec:
                mon.log_event(rec, trainer.state.step)
        export_dir = None
        if rank == 0:
            export_dir = run_dir / "export"
            tmp = run_dir / "export.tmp"
            export_drafter(drafter, tmp)
            if export_dir.exists():
                import shutil

                shutil.rmtree(export_dir)
            os.replace(tmp, export_dir)
    finally:
        if bar is not None:
            bar.close()
        try:  # a background write still in flight after a failure: let it land
            writer.wait()
        except BaseException as e:
            log.error("background checkpoint write failed: %s", e)
        mon.tick()
        history = list(recorder.history)
        final_metrics = dict(mon.latest())
        final_metrics.update(merged)
        if monitor is None:
            mon.close()
        # `on_step_end` closes over `trainer`, which holds it: a reference cycle that would keep
        # the drafter, optimizer and head copies alive until the next full GC (a soak that calls
        # train() repeatedly saw RSS climb by ~230 MB per call).
        trainer.on_step_end = None
    return TrainResult(
        run_dir=run_dir,
        steps=trainer.state.step,
        reason=outcome_reason,
        wall_s=time.monotonic() - t0,
        tokens=trainer.state.tokens,
        export_dir=export_dir,
        checkpoint=ck,
        metrics=final_metrics,
        history=history,
        balance=balance,
    )


class PeriodicEval:
    """Acceptance length on held-out prompts during training (drafter thread, between steps).

    It borrows the target under `lock` (the target worker takes the same lock per batch), so the
    pipeline stalls for no longer than the evaluation itself. The best drafter by tau is exported
    to `{run_dir}/best`.
    """

    def __init__(self, cfg: Config, target, drafter, heldout, run_dir: Path, lock):
        self.cfg, self.target, self.drafter, self.run_dir, self.lock = (
            cfg,
            target,
            drafter,
            run_dir,
            lock,
        )
        self.prompts = _heldout_prompts(heldout, cfg.eval.num_prompts)
        self.best = float("-inf")

    def run(self, step: int) -> dict | None:
        if not self.prompts:
            return None
        from dflash_trainer.eval.specdecode import quick_acceptance

        block = self.cfg.eval.block_size or self.cfg.drafter.block_size
        t0 = time.perf_counter()
        with self.lock:
            res = quick_acceptance(
                self.target, self.drafter, self.prompts, self.cfg.eval.max_new_tokens, block
            )
        rec = {
            "eval/tau": float(res["tau"]),
            "eval/seconds": time.perf_counter() - t0,
            "eval/step": step,
        }
        log.info(
            "eval at step %d: tau %.3f on %d held-out prompts (%.1f s)",
            step,
            res["tau"],
            len(self.prompts),
            rec["eval/seconds"],
        )
        if res["tau"] > self.best:
            self.best = res["tau"]
            tmp = self.run_dir / "best.tmp"
            export_drafter(self.drafter, tmp)
            (tmp / "eval.json").write_text(json.dumps({"step": step, "tau": res["tau"]}))
            if (self.run_dir / "best").exists():
                import shutil

                shutil.rmtree(self.run_dir / "best")
            os.replace(tmp, self.run_dir / "best")
            rec["eval/best_tau"] = self.best
        return rec


def _heldout_prompts(heldout, limit: int) -> list[list[int]]:
    """Prompt token ids of held-out examples: everything before the first supervised token."""
    out = []
    if heldout is None:
        return out
    for ids, mask in zip(heldout.input_ids, heldout.loss_mask):
        first = int(mask.argmax()) if mask.any() else 0
        if first > 0:
            out.append([int(t) for t in ids[:first]])
        if len(out) >= limit:
            break
    return out


def _contiguous_prefix(consumed) -> int:
    """Resume point inside an epoch: the batches 0..k-1 are done. With one target worker the
    drafter consumes in order, so `consumed` is exactly that prefix."""
    done = set(consumed or [])
    k = 0
    while k in done:
        k += 1
    if len(done) != k:
        raise UserError(
            f"checkpoint position is not a prefix of the epoch (batches {sorted(done)[:8]}"
            "...); resume with the same pipeline.target_devices it was written with."
        )
    return k


def _replicate_target(cfg: Config, first):
    from dflash_trainer.models.target import TargetModel

    out = [first]
    for dev in cfg.pipeline.target_devices[1:]:
        out.append(TargetModel.load(cfg.target, dev))
    return out


def _postfix(snap: dict) -> str:
    parts = []
    for key, label, fmt in (
        ("drafter/loss", "loss", "{:.3f}"),
        ("drafter/accept_len", "acc_len", "{:.2f}"),
        ("tput/drafter_tok_s", "tok/s", "{:.0f}"),
    ):
        if key in snap:
            parts.append(f"{label}={fmt.format(snap[key])}")
    return " ".join(parts)


def _progress_bar(cfg: Config, total: int, start: int):
    if not cfg.metrics.console:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)


def train_command(cfg: Config, args) -> int:
    nproc = getattr(args, "nproc", 0) or 0
    if nproc > 1 and "LOCAL_RANK" not in os.environ:
        # Convenience: relaunch this very command under torchrun, one process per cell.
        import sys

        from dflash_trainer.pipeline.distributed import launch_torchrun

        return launch_torchrun(nproc, sys.argv[1:])
    rank = int(os.environ.get("RANK", "0"))
    handler = setup_run_logging(
        Path(cfg.run_dir), "train.log" if rank == 0 else f"train.rank{rank}.log"
    )
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun
            from dflash_trainer.pipeline.distributed import train_distributed

            result = train_distributed(cfg)
        else:
            result = train(cfg)
    finally:
        logging.getLogger().removeHandler(handler)
    if rank != 0:
        return 0
    print(
        f"trained {result.steps} steps in {result.wall_s:.0f} s ({result.reason}); "
        f"export: {result.export_dir}; checkpoint: {result.checkpoint}"
    )
    if result.balance:
        print(result.balance)
    return 0
