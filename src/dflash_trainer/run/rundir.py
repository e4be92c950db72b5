"""One run per run directory: a new run never appends to, or prunes, an earlier one.

A run directory holds one run: its checkpoints, `metrics.jsonl`, `ledger.jsonl`, `export/` and
`best/`. Before anything is written, the mode says what happens to an earlier run found there:

    new        (default)              refuse, naming the three ways forward
    resume     --checkpoint.resume    continue it from its latest checkpoint; an earlier attempt
                                      that never wrote a checkpoint is moved aside, the run starts
                                      at step 0
    overwrite  --overwrite            move it aside to RUN_DIR.old-<timestamp>, start afresh

`--resume-from PATH` (`checkpoint.resume_from`) starts from any checkpoint directory: the run
directory's own latest one (the same as resume), or one elsewhere, into a run directory that
holds no other run (or one `--overwrite` moves aside).

Nothing is ever deleted: moved-aside runs keep every file. Under torchrun only rank 0 applies
the policy (commands/train.py, before any rank writes there).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_trainer import checkpoint as ckpt
from dflash_trainer.config import Config
from dflash_trainer.errors import UserError
from dflash_trainer.layout import RunLayout

log = logging.getLogger(__name__)

MODES = ("new", "resume", "overwrite")


class RunDirInUse(UserError):
    """run_dir holds another run. Its traceback is not appended to that run's train.log."""

    keep_out_of_run_dir = True


def earlier_run(run_dir) -> list[str]:
    """What in `run_dir` belongs to an earlier run, in words ([]: nothing)."""
    d = Path(run_dir)
    if not d.is_dir():
        return []
    found = []
    steps = [ckpt.step_of(p) for p in ckpt.list_checkpoints(d)]
    if steps:
        found.append(
            f"checkpoints at step {steps[0]}"
            if len(steps) == 1
            else f"checkpoints at steps {steps[0]}..{steps[-1]}"
        )
    elif (ckpt.ckpt_root(d) / "latest").exists():
        found.append("checkpoints/latest")
    # logs, held-out prompt files and the W&B/TensorBoard folders come with a run and are moved
    # with it, but alone they are no run
    for p in RunLayout(d).run_files:
        if p.exists() and not (p.is_file() and p.stat().st_size == 0):
            found.append(p.name + ("/" if p.is_dir() else ""))
    return found


def aside_path(run_dir) -> Path:
    """A free `RUN_DIR.old-YYYYmmdd-HHMMSS` (with `-2`, `-3`, ... when taken)."""
    d = Path(run_dir)
    base = d.with_name(f"{d.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def move_aside(run_dir) -> Path:
    """Rename the whole of `run_dir` to a free RUN_DIR.old-<timestamp>; return where it went."""
    d = Path(run_dir)
    dest = aside_path(d)
    os.replace(d, dest)
    return dest


def refusal(run_dir, found: list[str]) -> str:
    return (
        f"run_dir {run_dir} already holds a run ({', '.join(found)}); a new run there would mix "
        "with it. Continue that run with --checkpoint.resume=true, start this one elsewhere "
        f"with --run_dir=NEW_DIR, or move the earlier run aside to {Path(run_dir).name}.old-"
        "<timestamp> with --overwrite."
    )


def prepare(run_dir, mode: str = "new") -> str:
    """Make `run_dir` ready for a run in `mode` (see the module docstring). Returns what was
    done, in one line ('' when the directory held no earlier run or the run resumes); raises
    UserError when `mode` is "new" and an earlier run is there."""
    return _prepare(run_dir, mode)[0]


def _prepare(run_dir, mode: str) -> tuple[str, Path | None]:
    """(message, where the earlier run went or None)."""
    if mode not in MODES:
        raise ValueError(f"run directory mode {mode!r} is not one of {MODES}")
    found = earlier_run(run_dir)
    if not found:
        return "", None
    if mode == "resume":
        if ckpt.latest_checkpoint(run_dir) is not None:
            return "", None
        dest = move_aside(run_dir)
        msg = (
            f"{run_dir} held an earlier attempt with no checkpoint to resume from "
            f"({', '.join(found)}): moved it aside to {dest}; starting at step 0"
        )
    elif mode == "overwrite":
        dest = move_aside(run_dir)
        msg = f"moved the earlier run in {run_dir} ({', '.join(found)}) aside to {dest}"
    else:
        raise RunDirInUse(refusal(run_dir, found))
    log.info("%s", msg)
    return msg, dest


@dataclass
class Claim:
    """The outcome of `claim`: what was done (one line or ''), and the checkpoint the run
    starts from (None: latest of run_dir when resuming, else a fresh start)."""

    message: str
    resume_from: Path | None


def mode_of(cfg: Config) -> str:
    if cfg.overwrite:
        return "overwrite"
    return "resume" if cfg.checkpoint.resume else "new"


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def claim(cfg: Config, mode: str | None = None) -> Claim:
    """Apply the run-directory policy for `cfg` (rank 0 only) in `mode` (None: the one cfg asks
    for, mode_of; the demo always overwrites). With checkpoint.resume_from the checkpoint is
    resolved first; when it lies in a run directory that is moved aside, the returned path is
    where it is now."""
    run_dir = Path(cfg.run_dir)
    mode = mode or mode_of(cfg)
    if not cfg.checkpoint.resume_from:
        return Claim(prepare(run_dir, mode), None)
    src = ckpt.checkpoint_dir(cfg.checkpoint.resume_from)
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is not None and src.resolve() == latest.resolve():
        return Claim("", latest)  # the run directory's own latest: a plain resume
    found = earlier_run(run_dir)
    if found and mode != "overwrite":
        raise RunDirInUse(
            f"--resume-from {src}: run_dir {run_dir} already holds another run "
            f"({', '.join(found)}); starting from {src.name} there would mix the two. Write the "
            "new run elsewhere with --run_dir=NEW_DIR, or move the earlier run aside with "
            "--overwrite."
        )
    rel = src.resolve().relative_to(run_dir.resolve()) if _inside(src, run_dir) else None
    msg, dest = _prepare(run_dir, "overwrite") if found else ("", None)
    if rel is not None and dest is not None:
        src = dest / rel  # the checkpoint moved aside with the earlier run
    return Claim(msg, src)
