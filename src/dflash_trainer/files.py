"""Atomic replacement of a file or a directory: a reader (or a crash) sees the old content or the
new one, never a mix. The one helper for what the run writes in place (split files, `latest`,
the export)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file in the same directory and one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def replace_dir(tmp: Path, dest: Path) -> None:
    """The finished directory `tmp` becomes `dest`, replacing what was there (a directory cannot
    be renamed over a non-empty one: the old one is removed first)."""
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
