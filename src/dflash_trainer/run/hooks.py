"""What the run's threads call back into, as objects that hold only what they use.

The drafter thread runs `RunHooks.on_step_end` / `stop_vote` between optimizer steps (the
StepLoop holds the hooks), the supervisor's main thread `RunHooks.on_tick`, the checkpoint
writer's thread `CheckpointExport` and `CheckpointLogged`. None of them holds the Trainer, and
none holds what holds it: the objects form no reference cycle, so a finished run (the drafter,
the optimizer and the head copies) is freed as soon as its last reference goes, without the
garbage collector (a soak calling train() repeatedly once saw RSS climb by ~230 MB per call
while bound methods of the Trainer made such a cycle; test_pipeline checks it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dflash_trainer.checkpoint import (
    AsyncCheckpointWriter,
    CheckpointSnapshot,
    TrainState,
    snapshot_checkpoint,
)
from dflash_trainer.config import Config
from dflash_trainer.models.export import export_dtype, export_weights, training_record
from dflash_trainer.observe.counters import WorkerCounters
from dflash_trainer.observe.progress import progress_bar
from dflash_trainer.observe.ranks import rank_snapshot
from dflash_trainer.run.build import RunParts
from dflash_trainer.run.evaluation import PeriodicEval


class CheckpointExport:
    """The published-format export inside each checkpoint, from the snapshot's weights, with
    training.json (the target and the training config: `eval --drafter` needs no preset)."""

    def __init__(self, cfg: Config, parts: RunParts):
        self.config_dict = parts.config_dict
        self.drafter_config = parts.drafter.config
        self.dtype = export_dtype(cfg.checkpoint.export_dtype)

    def __call__(self, out_dir: Path, weights: dict, step: int) -> None:
        record = training_record(self.config_dict, step=step)
        export_weights(self.drafter_config, weights, out_dir, self.dtype, training=record)


class CheckpointLogged:
    """A written checkpoint's step as an event in the run's metrics (writer thread). The
    monitor is built after the writer: it is attached here once it exists."""

    def __init__(self) -> None:
        self.mon: Any = None

    def __call__(self, path: Path, snap: CheckpointSnapshot) -> None:
        if self.mon is not None:
            self.mon.log_event({"event/checkpoint_step": snap.step}, snap.step)


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


class SteadyRate:
    """Tokens/s between the first and the latest optimizer step (TrainResult.steady_tok_s)."""

    def __init__(self) -> None:
        self.first: tuple[float, int] | None = None  # (time s, tokens so far)
        self.last: tuple[float, int] | None = None

    def mark(self, now: float, tokens: int) -> None:
        if self.first is None:
            self.first = (now, tokens)
        self.last = (now, tokens)

    def rate(self) -> float:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return 0.0
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])


class RunHooks:
    """Between optimizer steps (drafter thread): periodic checkpoint and evaluation, and under
    torchrun the stop vote; every supervisor tick (main thread): the progress bar, and under
    torchrun this rank's snapshot and the peers' health.

    `ledger`: the StepLoop's list of (epoch, sample ids) since the last checkpoint, shared (the
    checkpoint takes its entries). `mon`, `bar` and `counters` (the drafter worker's) are
    attached by the Trainer once the stages and the monitor exist."""

    def __init__(
        self,
        cfg: Config,
        parts: RunParts,
        *,
        ledger: list,
        writer: AsyncCheckpointWriter,
        evaluator: PeriodicEval,
        events,
        dist=None,
        signals=None,
    ):
        self.cfg, self.parts, self.rank = cfg, parts, parts.rank
        self.state: TrainState = parts.state
        self.ledger, self.writer, self.evaluator = ledger, writer, evaluator
        self.events, self.dist, self.signals = events, dist, signals
        self.votes = dist is not None  # stop_vote is a collective of every rank
        self.steady = SteadyRate()
        self.t0 = time.monotonic()
        self.mon: Any = None
        self.bar: Any = None
        self.counters: WorkerCounters | None = None

    def progress(self, start_step: int) -> None:
        """The training progress bar (rank 0, metrics.console). With a time budget the step
        count is not known in advance (total_steps is only the epochs' cap): the bar counts
        steps and its postfix shows the time left."""
        budget = self.parts.budget
        self.bar = progress_bar(
            None if budget is not None else self.parts.total_steps,
            initial=start_step,
            desc="train",
            unit="step",
            lines=False,  # the monitor logs training's own lines
        )

    # ------------------------------------------------------------------ drafter thread
    def on_step_end(self, step: int) -> None:
        """After optimizer step `step`: periodic checkpoint and evaluation."""
        cfg = self.cfg
        self.steady.mark(time.monotonic(), self.state.tokens)
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
            self.checkpoint_now(background=True)
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and self.rank == 0:
            rec = self.evaluator.run(step)
            if rec:
                self.mon.log_event(rec, step)

    def stop_vote(self) -> bool:
        """torchrun: all ranks stop after the same optimizer step (a MAX vote of "signal")."""
        budget = self.parts.budget
        spent = budget is not None and budget.spent()
        return self.dist.agree_stop(self.signals.requested.is_set() or spent)

    def _take_ledger(self) -> list:
        taken = list(self.ledger)
        self.ledger.clear()
        return taken

    def _gather_ranks(self) -> tuple[dict, dict | None, list | None]:
        """torchrun: every rank calls this after the same step (DDP + the stop vote keep them
        in lockstep): gather positions, anchor RNG states and ledgers to rank 0."""
        parts = self.dist.gather_to_main(
            {
                "state": self.state.to_json(),
                "generator": self.parts.generator.get_state(),
                "ledger": self._take_ledger(),
            }
        )
        if self.rank != 0:
            return {}, None, None
        gathered = [e for part in parts for e in part["ledger"]]
        meta = {"world_size": self.parts.world_size, "ranks": [q["state"] for q in parts]}
        return meta, {"rank_generators": [q["generator"] for q in parts]}, gathered

    def _resume_meta(self) -> dict[str, Any]:
        """What a resume of this checkpoint needs besides the state: the LR schedule
        (checkpoint.lr_segments), the time spent, and the samples its epoch skips."""
        parts = self.parts
        meta: dict[str, Any] = {"total_steps": parts.total_steps, "lr_segments": parts.lr_segments}
        if parts.budget is not None:
            meta["budget_used_s"] = parts.budget.used()
        plan = parts.resume
        if (
            plan is not None
            and plan.epoch_skip is not None
            and self.state.epoch == plan.state.epoch
        ):
            meta["epoch_skip"] = {"epoch": plan.state.epoch, "samples": plan.epoch_skip}
        return meta

    def checkpoint_now(self, background: bool = False) -> Path | None:
        """Snapshot the state at this step boundary and write it: in the background when asked
        and enabled (periodic checkpoints), else before returning (the last one, signals)."""
        parts = self.parts
        extra_meta: dict[str, Any] = {}
        extra_blob, gathered = None, None
        if self.dist is not None:
            extra_meta, extra_blob, gathered = self._gather_ranks()
        if self.rank != 0:
            return None
        if parts.anchor_policy is not None:  # one process (run/build.py anchor_policy_for)
            extra_blob = {**(extra_blob or {}), "anchor_policy": parts.anchor_policy.state_dict()}
        extra_meta.update(self._resume_meta())
        ledger = self._take_ledger()
        if gathered is not None:  # torchrun: every rank's entries, gathered to rank 0
            ledger = gathered
        self.writer.wait()  # the previous write lands first: one snapshot in host memory
        snap = snapshot_checkpoint(
            drafter=parts.drafter,
            optimizer=parts.optimizer,
            scheduler=parts.scheduler,
            generator=parts.generator,
            state=self.state,
            config=parts.config_dict,
            extra_meta=extra_meta,
            extra_blob=extra_blob,
            ledger=ledger,
        )
        self.writer.submit(snap)
        if background and self.cfg.checkpoint.async_write:
            return None
        return self.writer.wait()

    # ------------------------------------------------------------------ main thread
    def publish(self, final: bool = False) -> None:
        """torchrun: this rank's snapshot for rank 0's merged metrics."""
        assert self.counters is not None
        snap = rank_snapshot(
            self.state, self.mon.latest(), self.counters, time.monotonic() - self.t0, final=final
        )
        self.dist.publish(snap)

    def on_tick(self) -> None:
        """Every supervisor tick."""
        if self.dist is not None:
            self.publish()
            self.dist.check_peers(self.events)  # a peer's failure stops this rank, naming it
        if self.bar is not None:
            self.bar.n = self.state.step
            post = _postfix(self.mon.latest())
            budget = self.parts.budget
            if budget is not None:
                post += f" left={max(0.0, budget.seconds - budget.used()):.0f}s"
            self.bar.set_postfix_str(post.strip(), refresh=False)
            self.bar.refresh()
