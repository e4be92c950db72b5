"""`dflash-trainer bench` / `make bench`: every benchmark under the checkout's bench/, one table
(bench/out/results.md and results.json)."""

from __future__ import annotations

import json
import time

from dflash_trainer.bench_harness import SCRIPTS, find_bench_dir, machine, run_all, to_markdown
from dflash_trainer.config import Config


def run(cfg: Config, args) -> int:
    """Runs the scripts one by one; results.json/.md are rewritten after each, so an interrupted
    run keeps what finished. `--bench.only=S` reruns some scripts and keeps the other rows."""
    bdir = find_bench_dir()
    out = bdir / "out"
    out.mkdir(parents=True, exist_ok=True)
    only = list(cfg.bench.only)
    prev = out / "results.json"
    kept = []
    if only and prev.is_file():
        kept = [r for r in json.loads(prev.read_text())["rows"] if r.get("script") not in only]
    rows: list[dict] = []
    for script in SCRIPTS:
        if only and script not in only:
            continue
        rows.extend(run_all(bdir, quick=cfg.bench.quick, only=[script]))
        allr = kept + rows
        header = f"Benchmarks, {time.strftime('%Y-%m-%d')}, {machine()}"
        (out / "results.md").write_text(to_markdown(allr, header))
        (out / "results.json").write_text(
            json.dumps({"machine": machine(), "rows": allr}, indent=2)
        )
    print((out / "results.md").read_text())
    return 0
