"""Atomic, resumable checkpoints.

Layout under `{run_dir}/checkpoints/`:

    step-000120/            one complete checkpoint (never modified after the rename)
        drafter.safetensors     trainable drafter weights
        optimizer.pt            optimizer + scheduler + RNG state (tensors only: weights_only load)
        state.json              step, data position, resolved config
        ledger.json             the (epoch, sample ids) of the batches since the previous one
        export/                 the drafter in the published DFlash format
    latest                  text file naming the newest complete checkpoint (atomic replace)

The sample ledger of the run is `{run_dir}/ledger.jsonl`, one line per batch tagged with the
checkpoint that covers it, appended by the writer once that checkpoint is on disk. A process
killed between the two leaves the ledger behind `latest`: a resume first makes the ledger agree
with the checkpoint it starts from (`reconcile_ledger`, from the checkpoint's own ledger.json).

A checkpoint is written to `step-N.tmp-<pid>/`, fsynced, then renamed: a crash (SIGKILL, full disk)
mid-write leaves the previous checkpoint and `latest` intact.

This module is the only reader of checkpoint files. It also plans a resume (`plan_resume`: this
rank's position, before anything is built; another world size re-plans the rest of the epoch)
and keeps the LR schedule continuous across it (`lr_segments`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash_trainer.errors import UserError
from dflash_trainer.files import write_atomic
from dflash_trainer.layout import RunLayout

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Host-side training position: everything besides tensors needed to resume exactly."""

    step: int = 0  # optimizer steps done
    micro_step: int = 0  # micro-batches consumed
    epoch: int = 0  # epoch of the next batch to train
    consumed: list[int] = field(default_factory=list)  # seq_nos of `epoch` trained (any order)
    tokens: int = 0
    # Sample ids of `epoch` already trained: lets a run on another world size re-plan the rest
    # of the epoch over the samples no rank has seen (pipeline/distributed.py).
    consumed_samples: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "micro_step": self.micro_step,
            "epoch": self.epoch,
            "consumed": sorted(self.consumed),
            "tokens": self.tokens,
            "consumed_samples": sorted(self.consumed_samples),
        }

    @classmethod
    def from_json(cls, d: dict) -> TrainState:
        return cls(
            step=d["step"],
            micro_step=d["micro_step"],
            epoch=d["epoch"],
            consumed=list(d["consumed"]),
            tokens=d.get("tokens", 0),
            consumed_samples=list(d.get("consumed_samples", [])),
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def ckpt_root(run_dir: str | Path) -> Path:
    return RunLayout.of(run_dir).checkpoints


@dataclass
class CheckpointSnapshot:
    """Everything a checkpoint holds, copied to host memory at one step boundary: training may go
    on while it is written (AsyncCheckpointWriter), and what lands on disk is this step's state."""

    step: int
    weights: dict  # trainable drafter tensors (CPU copies)
    blob: dict  # optimizer.pt content (CPU copies)
    meta: dict  # state.json content
    ledger: list = field(default_factory=list)  # sample-ledger entries up to this step


def _host_copy(obj):
    """Deep copy with every tensor copied to CPU (optimizer state tensors are live buffers)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v) for v in obj)
    return copy.deepcopy(obj)


def snapshot_checkpoint(
    *,
    drafter,
    optimizer,
    scheduler,
    generator: torch.Generator,
    state: TrainState,
    config: dict,
    extra_meta: dict | None = None,
    extra_blob: dict | None = None,
    ledger=None,
) -> CheckpointSnapshot:
    """`extra_meta` (JSON) joins state.json and `extra_blob` (tensors) optimizer.pt: the
    per-rank states of a torchrun run (pipeline/distributed.py). Reads device values: call it
    between steps, never inside one."""
    weights = {
        k: v.detach().to("cpu", copy=True).contiguous() for k, v in drafter.state_dict().items()
    }
    blob = _host_copy(
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "generator": generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            **(extra_blob or {}),
        }
    )
    meta = {
        "train_state": state.to_json(),
        "config": config,
        "format": 1,
        **copy.deepcopy(extra_meta or {}),
    }
    return CheckpointSnapshot(
        step=state.step, weights=weights, blob=blob, meta=meta, ledger=list(ledger or [])
    )


def write_checkpoint(run_dir, snap: CheckpointSnapshot, *, keep_last: int, export_fn=None) -> Path:
    """Write `snap` as `checkpoints/step-N` atomically; `export_fn(out_dir, weights, step)` adds
    the published-format export from the same weights."""
    root = ckpt_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{snap.step:07d}"
    final = root / name
    tmp = root / f"{name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        save_file(snap.weights, str(tmp / "drafter.safetensors"))
        torch.save(snap.blob, tmp / "optimizer.pt")
        _write_json(tmp / "state.json", snap.meta)
        _write_json(tmp / "ledger.json", snap.ledger)  # [[epoch, ids], ...]
        if export_fn is not None:
            export_fn(tmp / "export", snap.weights, snap.step)
        for f in tmp.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():  # re-saving the same step (e.g. signal right after a save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_atomic(root / "latest", name + "\n")
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(
            f"could not write checkpoint {final}: {e}. The previous checkpoint is "
            "intact; free disk space and resume with --checkpoint.resume=true."
        ) from e
    _prune(root, keep_last)
    return final


def save_checkpoint(
    run_dir,
    *,
    drafter,
    optimizer,
    scheduler,
    generator: torch.Generator,
    state: TrainState,
    config: dict,
    keep_last: int,
    export_fn=None,
    extra_meta: dict | None = None,
    extra_blob: dict | None = None,
) -> Path:
    """Snapshot + write, in the caller's thread."""
    snap = snapshot_checkpoint(
        drafter=drafter,
        optimizer=optimizer,
        scheduler=scheduler,
        generator=generator,
        state=state,
        config=config,
        extra_meta=extra_meta,
        extra_blob=extra_blob,
    )
    return write_checkpoint(run_dir, snap, keep_last=keep_last, export_fn=export_fn)


def _ledger_line(epoch: int, ids: list[int], step: int) -> str:
    """One ledger.jsonl line: a batch's epoch and sample ids, and the checkpoint covering it."""
    return json.dumps({"epoch": epoch, "samples": ids, "step": step})


def append_ledger(run_dir, entries: list, step: int) -> None:
    """The ledger entries checkpoint `step` covers, appended to {run_dir}/ledger.jsonl and
    fsynced: the ledger never runs ahead of a complete checkpoint."""
    if not entries:
        return
    with open(RunLayout.of(run_dir).ledger, "a", encoding="utf-8") as f:
        for epoch, ids in entries:
            f.write(_ledger_line(epoch, ids, step) + "\n")
        f.flush()
        os.fsync(f.fileno())


def reconcile_ledger(run_dir, path: Path) -> None:
    """Make `{run_dir}/ledger.jsonl` cover exactly the batches up to checkpoint `path` of this
    run, before a resume from it appends more: lines of later checkpoints go (a resume from an
    older one trains those batches again), a line torn by a kill goes, and the checkpoint's own
    entries are appended when the process died before the writer appended them."""
    if path.resolve().parent != ckpt_root(run_dir).resolve():
        return  # a checkpoint of another run: this run's ledger starts with its own batches
    step = step_of(path)
    layout = RunLayout.of(run_dir)
    kept: list[str] = []
    covered = False
    lines = (
        layout.ledger.read_text(encoding="utf-8").splitlines() if layout.ledger.is_file() else []
    )
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the last line, cut short by a kill mid-append
        at = row.get("step")
        if at is not None and step is not None and at > step:
            continue
        covered = covered or at == step
        kept.append(line)
    own = path / "ledger.json"
    if not covered and step is not None and own.is_file():
        entries = json.loads(own.read_text(encoding="utf-8"))
        kept += [_ledger_line(e, ids, step) for e, ids in entries]
    if kept != lines:
        log.info("ledger.jsonl made to agree with %s (%d lines)", path, len(kept))
        write_atomic(layout.ledger, "".join(line + "\n" for line in kept))


class AsyncCheckpointWriter:
    """Writes snapshots on a background thread, one at a time, so the drafter trains on while
    files are written and fsynced (for a 1B-parameter drafter with AdamW that is ~12 GB).

    At most one write is in flight: `submit` first waits for the previous one, which keeps
    checkpoints and their ledger entries in step order (call `wait` before taking the next
    snapshot, as the trainer does, to hold one snapshot in host memory at a time).
    After each write it appends the snapshot's ledger entries (append_ledger), then calls
    `on_done(path, snap)`. A failed write is raised (once) by the next `submit` or by `wait`,
    in the training thread.
    Atomicity is unchanged: a write that dies half-way leaves only a `.tmp-` directory.
    """

    def __init__(
        self, run_dir, *, keep_last: int, export_fn=None, on_done=None, timeout_s: float = 3600.0
    ):
        self.run_dir, self.keep_last, self.export_fn = run_dir, keep_last, export_fn
        self.on_done = on_done  # on_done(path, snap), on the writer thread
        self.timeout_s = timeout_s
        self._thread: threading.Thread | None = None
        self._result: tuple[Path | None, BaseException | None] = (None, None)

    def submit(self, snap: CheckpointSnapshot) -> None:
        self.wait()
        self._result = (None, None)
        self._thread = threading.Thread(
            target=self._write, args=(snap,), daemon=True, name=f"ckpt-writer-{snap.step}"
        )
        self._thread.start()

    def _write(self, snap: CheckpointSnapshot) -> None:
        try:
            path = write_checkpoint(
                self.run_dir, snap, keep_last=self.keep_last, export_fn=self.export_fn
            )
            append_ledger(self.run_dir, snap.ledger, snap.step)
            if self.on_done is not None:
                self.on_done(path, snap)
            self._result = (path, None)
        except BaseException as e:  # crosses to the training thread as a value
            self._result = (None, e)

    def wait(self) -> Path | None:
        """Block until the write in flight (if any) is on disk; return its path or raise."""
        t = self._thread
        if t is None:
            return None
        t.join(self.timeout_s)
        if t.is_alive():
            raise UserError(
                f"a checkpoint write under {ckpt_root(self.run_dir)} did not finish "
                f"in {self.timeout_s:.0f} s; check the disk, then resume from the "
                "last complete checkpoint."
            )
        self._thread = None
        path, err = self._result
        self._result = (None, None)
        if err is not None:
            raise err
        return path


def step_of(path: Path) -> int | None:
    """The step number of a checkpoint directory `step-N` (None: not a complete one's name)."""
    name = Path(path).name
    if not name.startswith("step-") or ".tmp" in name:
        return None
    try:
        return int(name[len("step-") :])
    except ValueError:
        return None


def list_checkpoints(run_dir) -> list[Path]:
    """The complete checkpoints under `run_dir/checkpoints`, oldest step first (by the step
    number, not the name: `step-10000000` sorts after `step-9999999`)."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step-*") if step_of(p) is not None and p.is_dir()]
    return sorted(done, key=lambda p: step_of(p) or 0)


def _prune(root: Path, keep_last: int) -> None:
    done = [p for p in list_checkpoints(root.parent) if (p / "state.json").is_file()]
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob("*.tmp-*"):
        if stale.is_dir() and not str(stale).endswith(f".tmp-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(run_dir) -> Path | None:
    root = ckpt_root(run_dir)
    ptr = root / "latest"
    if ptr.is_file():
        p = root / ptr.read_text().strip()
        if (p / "state.json").is_file():
            return p
    # `latest` missing or pointing at a pruned dir: fall back to the newest complete one.
    done = [p for p in list_checkpoints(run_dir) if (p / "state.json").is_file()]
    return done[-1] if done else None


def checkpoint_dir(path) -> Path:
    """`path` as a checkpoint directory: a checkpoint itself, a run directory, its
    `checkpoints/` or the `checkpoints/latest` pointer file (then their latest checkpoint).
    Raises UserError naming what it expects."""
    p = Path(path)
    if (p / "state.json").is_file():
        return p
    if p.name == "latest" and p.is_file():  # the pointer users tab-complete to
        p = p.parent
    run_dir = p.parent if p.name == "checkpoints" else p
    found = latest_checkpoint(run_dir) if ckpt_root(run_dir).is_dir() else None
    if found is not None:
        return found
    raise UserError(
        f"{p} is not a checkpoint: expected a directory holding state.json, "
        "drafter.safetensors and optimizer.pt (RUN_DIR/checkpoints/step-N), or a run "
        "directory with checkpoints."
    )


def checkpoint_export(path) -> Path:
    """The published-format export a checkpoint holds (`export/`), or UserError."""
    out = Path(path) / "export"
    if not (out / "config.json").is_file() or not (out / "model.safetensors").is_file():
        raise UserError(
            f"checkpoint {path} holds no export/ (config.json + model.safetensors); it was "
            "written without one. Resume it for one step with --resume-from to write one."
        )
    return out


def load_checkpoint(
    path: Path, *, drafter, optimizer, scheduler, generator: torch.Generator, config: dict
) -> TrainState:
    """Load checkpoint `path` into the built objects; the TrainState it saved (rank 0's)."""
    meta = read_meta(path)
    _load_into(
        path,
        meta,
        drafter=drafter,
        optimizer=optimizer,
        scheduler=scheduler,
        generator=generator,
        config=config,
    )
    return TrainState.from_json(meta["train_state"])


def _check_config(path: Path, saved: dict, config: dict) -> None:
    for section in ("drafter", "target"):
        a, b = saved.get(section, {}), config.get(section, {})
        diff = [
            k
            for k in set(a) | set(b)
            if a.get(k) != b.get(k) and k not in {"attention", "cache_dir", "dtype"}
        ]
        if diff:
            raise UserError(
                f"checkpoint {path} was written with another {section} config "
                f"(differs in {', '.join(f'{section}.{k}' for k in sorted(diff))}: saved "
                f"{[a.get(k) for k in sorted(diff)]} vs now {[b.get(k) for k in sorted(diff)]}). "
                "Use the same settings, or a new run_dir."
            )


def _load_into(
    path: Path,
    meta: dict,
    *,
    drafter,
    optimizer,
    scheduler,
    generator,
    config: dict,
    then=None,
    stateful: dict | None = None,
) -> None:
    """Weights, optimizer, scheduler, generator and torch RNG from `path` (optimizer.pt is read
    once; `then(generator, blob)` sees it). `stateful`: more objects with load_state_dict, by
    their key in optimizer.pt (a checkpoint without one leaves it as built, and says so)."""
    _check_config(path, meta.get("config", {}), config)
    try:
        weights = load_file(str(path / "drafter.safetensors"))
    except Exception as e:  # safetensors raises its own error types for truncated/tampered files
        raise UserError(
            f"checkpoint weights {path / 'drafter.safetensors'} are corrupt ({e}); "
            "resume from an older checkpoint."
        ) from e
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise UserError(
            f"checkpoint {path} does not match the drafter: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}."
        )
    blob = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    generator.set_state(blob["generator"])
    torch.set_rng_state(blob["torch_rng"])
    for key, obj in (stateful or {}).items():
        if key in blob:
            obj.load_state_dict(blob[key])
        else:
            log.warning("checkpoint %s holds no %s; it starts afresh", path, key)
    if then is not None:
        then(generator, blob)


# ------------------------------------------------------------------------------- resume
def contiguous_prefix(consumed) -> int:
    """Resume point inside an epoch: the batches 0..k-1 are done. The drafter trains in the
    plan's order whatever the number of target workers (pipeline/ordering.py), so `consumed` is
    exactly that prefix."""
    done = set(consumed or [])
    k = 0
    while k in done:
        k += 1
    if len(done) != k:
        raise UserError(
            f"checkpoint position is not a prefix of the epoch (batches {sorted(done)[:8]}"
            "...): it was written by a version that trained several target workers' batches in "
            "arrival order; resume from a checkpoint at an epoch's end, or start anew."
        )
    return k


@dataclass
class ResumePlan:
    """This rank's position in checkpoint `path`, read before anything is built.

    Same world size: exact (this rank's own position and anchor RNG state). Other world size:
    the rest of the checkpoint's epoch is re-planned over the samples no rank has trained yet
    (`epoch_skip` = every sample id consumed in that epoch by any rank, plus what that epoch had
    already skipped), later epochs as usual; anchor RNGs are reseeded per rank and step, and
    the token count restarts on rank 0 with the sum over the old ranks.
    """

    path: Path
    meta: dict  # state.json, read once
    state: TrainState
    epoch_skip: list[int] | None
    rng: str  # "saved": the checkpoint's generator; "rank": rank_generators[rank]; "reseed"
    rank: int = 0
    seed: int = 0

    def apply_rng(self, generator: torch.Generator, blob: dict) -> None:
        """After `load_checkpoint` has restored rank 0's generator from `blob`."""
        if self.rng == "rank":
            gens = blob.get("rank_generators")
            if gens:
                generator.set_state(gens[self.rank])
        elif self.rng == "reseed":
            base_step = TrainState.from_json(self.meta["train_state"]).step
            generator.manual_seed(self.seed * 1000003 + self.rank + 7919 * (base_step + 1))


def read_meta(path: Path) -> dict:
    """state.json of checkpoint `path` (the only reader of it)."""
    try:
        return json.loads((Path(path) / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(
            f"checkpoint {path} is unreadable ({e}); delete it or point "
            "checkpoints/latest at an older one."
        ) from e


def plan_resume(
    run_dir, *, rank: int, world_size: int, seed: int, checkpoint=None
) -> ResumePlan | None:
    """Where this rank resumes in the latest checkpoint of `run_dir`, or in the checkpoint
    directory `checkpoint` when given (None: none there)."""
    path = checkpoint_dir(checkpoint) if checkpoint else latest_checkpoint(run_dir)
    if path is None:
        return None
    meta = read_meta(path)
    base = TrainState.from_json(meta["train_state"])
    saved_world = int(meta.get("world_size", 1))
    ranks = meta.get("ranks")
    skip_meta = meta.get("epoch_skip") or {}
    epoch_skip = list(skip_meta.get("samples", [])) if skip_meta.get("epoch") == base.epoch else []
    common: dict[str, Any] = dict(path=path, meta=meta, rank=rank, seed=seed)
    if saved_world == world_size:
        if not ranks:
            return ResumePlan(state=base, epoch_skip=epoch_skip or None, rng="saved", **common)
        state = TrainState.from_json(ranks[rank])
        return ResumePlan(state=state, epoch_skip=epoch_skip or None, rng="rank", **common)
    per_rank = ranks or [meta["train_state"]]
    done = set(epoch_skip)
    for r in per_rank:
        done.update(r.get("consumed_samples") or [])
    state = TrainState(
        step=base.step,
        micro_step=base.micro_step,
        epoch=base.epoch,
        consumed=[],
        consumed_samples=[],
        tokens=sum(r.get("tokens", 0) for r in per_rank) if rank == 0 else 0,
    )
    log.info(
        "resuming a %d-rank checkpoint on %d ranks: the rest of epoch %d is re-planned "
        "without the %d samples already trained",
        saved_world,
        world_size,
        state.epoch,
        len(done),
    )
    return ResumePlan(state=state, epoch_skip=sorted(done), rng="reseed", **common)


def lr_segments(plan: ResumePlan | None, total_steps: int) -> list[list[int]]:
    """The LR schedule's segments ([total, from_step], ...). A checkpoint of a run with another
    total (world size, epochs) keeps the LR curve continuous at the resume step instead of
    jumping to the new schedule's value there."""
    segments = [[total_steps, 0]]
    if plan is None:
        return segments
    meta = plan.meta
    saved = meta.get("lr_segments") or (
        [[meta["total_steps"], 0]] if meta.get("total_steps") else None
    )
    if saved:
        segments = [list(x) for x in saved]
        if int(segments[-1][0]) != total_steps:
            segments.append([total_steps, plan.state.step])
            log.info(
                "resuming at step %d of a %d-step schedule with %d steps in all now: "
                "the rest of the LR schedule is spread over the new remaining steps",
                plan.state.step,
                int(saved[-1][0]),
                total_steps,
            )
    return segments


def restore(
    plan: ResumePlan,
    *,
    drafter,
    optimizer,
    scheduler,
    generator,
    config: dict,
    stateful: dict | None = None,
) -> TrainState:
    """Load the checkpoint of `plan` into the built objects (`stateful`: _load_into); this
    rank's TrainState."""
    _load_into(
        plan.path,
        plan.meta,
        drafter=drafter,
        optimizer=optimizer,
        scheduler=scheduler,
        generator=generator,
        config=config,
        then=plan.apply_rng,
        stateful=stateful,
    )
    st = plan.state
    log.info(
        "resumed from %s at step %d (epoch %d, %d batches of it done)",
        plan.path,
        st.step,
        st.epoch,
        len(st.consumed),
    )
    return st
