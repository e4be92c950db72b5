"""Where files go and how they are replaced: the one cache root every cache lives under, and
atomic replacement of a file or a directory (a reader, or a crash, sees the old content or the
new one, never a mix; for what is written in place: split files, `latest`, the tokenized cache,
exports, best/)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

CACHE_ENV = "DFLASH_TRAINER_CACHE"


def cache_root(cache_dir: str = "") -> Path:
    """The root of every cache (converted targets, target-written answers, synthesised prompts,
    tokenized data, the last error's log): explicit `cache_dir` (target.cache_dir), else
    $DFLASH_TRAINER_CACHE, else ~/.cache/dflash-trainer."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dflash-trainer"


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file to write `path`'s new content into: a temporary file in the same directory,
    renamed onto `path` when the block ends, removed when it raises."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file in the same directory and one rename."""
    with atomic_file(path) as f:
        f.write(text.encode("utf-8"))


def replace_dir(tmp: Path, dest: Path) -> None:
    """The finished directory `tmp` becomes `dest`, replacing what was there. A directory cannot
    be renamed over a non-empty one: the old one is renamed aside first and removed after, so
    `dest` is missing only between two renames (a crash there leaves it as `.NAME.old-PID`)."""
    old = None
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
