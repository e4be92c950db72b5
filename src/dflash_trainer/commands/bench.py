"""`dflash-trainer bench` / `make bench`: every benchmark under the checkout's bench/, one table
(bench/out/results.md and results.json)."""

from __future__ import annotations

import json
import sys
import time

from dflash_trainer.bench_harness import SCRIPTS, find_bench_dir, machine, run_all, to_markdown
from dflash_trainer.bench_plan import BenchPlan
from dflash_trainer.config import Config


def run(cfg: Config, args) -> int:
    """Runs the scripts one by one, each in full or quick as the time budget allows
    (bench_plan.py); results.json/.md are rewritten after each, so an interrupted run keeps
    what finished. `--bench.only=S` reruns some scripts and keeps the other rows."""
    bdir = find_bench_dir()
    out = bdir / "out"
    out.mkdir(parents=True, exist_ok=True)
    only = list(cfg.bench.only)
    prev = out / "results.json"
    kept = []
    if only and prev.is_file():
        kept = [r for r in json.loads(prev.read_text())["rows"] if r.get("script") not in only]
    todo = [s for s in SCRIPTS if not only or s in only]
    plan = BenchPlan(cfg.bench.time_budget_s, quick=cfg.bench.quick)
    rows: list[dict] = []
    for i, script in enumerate(todo):
        mode = plan.mode(script, todo[i + 1 :])
        if mode == "quick" and not cfg.bench.quick:
            print(
                f"bench: {script} quick (fewer repeats): in full it would not fit "
                f"bench.time_budget_s={cfg.bench.time_budget_s:.0f} here "
                f"({plan.slowness:.2f}x the reference machine so far)",
                file=sys.stderr,
                flush=True,
            )
        t0 = time.monotonic()
        done = run_all(bdir, quick=mode == "quick", only=[script])
        plan.done(script, mode, time.monotonic() - t0)
        for r in done:
            r["mode"] = mode
        rows.extend(done)
        allr = kept + rows
        header = f"Benchmarks, {time.strftime('%Y-%m-%d')}, {machine()}"
        quick = [r["script"] for r in allr if r.get("mode") == "quick"]
        if quick:
            header += "; quick (fewer repeats): " + ", ".join(dict.fromkeys(quick))
        (out / "results.md").write_text(to_markdown(allr, header))
        (out / "results.json").write_text(
            json.dumps({"machine": machine(), "rows": allr}, indent=2)
        )
    print((out / "results.md").read_text())
    print(f"bench: {time.monotonic() - plan.t0:.0f} s in all", file=sys.stderr)
    return 0
