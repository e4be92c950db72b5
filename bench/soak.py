"""Soak: run the pipeline for a long time with faults injected at random, resuming after each.

Each cycle resumes the same run dir with a random fault (an exception in a random stage, a
SIGTERM, or none) at a random step. At the end it reports: faults injected, faults survived (the
run resumed afterwards), samples lost or trained twice per completed epoch (from the sample ledger;
must be 0), checkpoints that failed to load (must be 0), and peak RSS growth after the first cycle
after warm-up (the first 5 cycles; a leak shows as growth; target < 5%).

Run: .venv/bin/python bench/soak.py --minutes 30 [--embedded]
(`--embedded` uses SmolLM2 as the target; the default is a tiny random target, which cycles
faster and exercises the same control paths.)
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dflash_trainer.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from dflash_trainer.pipeline.runtime import StageError  # noqa: E402
from dflash_trainer.run import train  # noqa: E402
from dflash_trainer.run.build import build_drafter  # noqa: E402


def rss_mib() -> float:
    """Current resident set size (not the peak: a leak shows as steady growth)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _setup(embedded: bool):
    """The target and dataset: the tiny test model, or (--embedded) SmolLM2 on synthetic data."""
    from tiny import tiny_dataset, tiny_target

    if not embedded:
        return tiny_target(), tiny_dataset(n=40)
    from bench_pipeline import synthetic_dataset
    from dflash_trainer.config_io import load_config
    from dflash_trainer.models.target import TargetModel

    target = TargetModel.load(load_config("smollm2-cpu").target, "cpu")
    return target, synthetic_dataset(60, target.vocab_size)


def _cycle_config(run: Path, fault: str, embedded: bool):
    from tiny import tiny_config

    over = {
        "optim.epochs": 300,  # more than a soak reaches; the clock ends it
        "checkpoint.every_steps": 4,
        "checkpoint.resume": True,
        "pipeline.fault": fault,
        "optim.max_steps": 0,
        "optim.lr": 1e-3,
    }
    cfg = tiny_config(run, **over)
    if embedded:
        from dflash_trainer.config_io import set_value

        for k, v in (
            ("drafter.num_heads", 9),
            ("drafter.num_kv_heads", 3),
            ("drafter.head_dim", 64),
            ("drafter.intermediate_size", 256),
            ("target.num_taps", 5),
            ("batching.max_tokens", 1024),
        ):
            set_value(cfg, k, v)
    return cfg


def _checkpoint_loads(cfg, target) -> bool:
    """Whether the run's latest checkpoint (if any) loads whole into a fresh drafter."""
    ck = latest_checkpoint(cfg.run_dir)
    if ck is None:
        return True
    try:
        d = build_drafter(cfg, target, "cpu")
        import torch

        opt = torch.optim.AdamW(d.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        load_checkpoint(
            ck,
            drafter=d,
            optimizer=opt,
            scheduler=sched,
            generator=torch.Generator(),
            config=json.loads((ck / "state.json").read_text())["config"],
        )
        return True
    except Exception as e:  # counted: that is what the soak measures
        print(f"checkpoint {ck} failed to load: {e}", file=sys.stderr)
        return False


def _ledger_check(run: Path, n_samples: int) -> tuple[int, int, int]:
    """Every completed epoch has each sample exactly once: (epochs, samples lost, trained twice)."""
    rows = [json.loads(line) for line in (run / "run" / "ledger.jsonl").read_text().splitlines()]
    per_epoch: dict[int, Counter] = {}
    for r in rows:
        per_epoch.setdefault(r["epoch"], Counter()).update(r["samples"])
    last = max(per_epoch)
    lost = twice = 0
    for e, c in per_epoch.items():
        if e == last:  # the epoch in progress: no duplicates allowed, gaps are fine
            twice += sum(v - 1 for v in c.values() if v > 1)
            continue
        lost += sum(1 for i in range(n_samples) if c[i] == 0)
        twice += sum(v - 1 for v in c.values() if v > 1)
    return len(per_epoch) - 1, lost, twice


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--embedded", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    target, ds = _setup(a.embedded)
    run = Path(tempfile.mkdtemp(prefix="soak-"))
    deadline = time.monotonic() + 60 * a.minutes
    stats: Counter = Counter()
    rss_after_first = None
    while time.monotonic() < deadline:
        kind = rng.choice(["none", "prefetch", "target", "drafter", "sigterm"])
        step = rng.randint(1, 12)
        fault = {"none": "", "sigterm": f"drafter:{step}:sigterm"}.get(kind, f"{kind}:{step}")
        cfg = _cycle_config(run, fault, a.embedded)
        stats["cycles"] += 1
        if fault:
            stats["faults_injected"] += 1
        try:
            if kind == "none":
                # no fault: stop it with a SIGTERM after a while, like a preemption
                cfg.pipeline.fault = f"drafter:{rng.randint(8, 30)}:sigterm"
            train(cfg, target=target, train_set=ds)
        except StageError:
            pass
        if fault:
            stats["faults_survived"] += 1  # we are still here and will resume from it
        if not _checkpoint_loads(cfg, target):
            stats["checkpoints_corrupted"] += 1
        print(
            f"cycle {stats['cycles']}: fault {fault or '-'}, rss {rss_mib():.0f} MiB",
            file=sys.stderr,
            flush=True,
        )
        if stats["cycles"] == 5:  # after warm-up (imports, allocator pools)
            rss_after_first = rss_mib()
    epochs, lost, twice = _ledger_check(run, len(ds))
    growth = (rss_mib() / rss_after_first - 1.0) if rss_after_first else 0.0
    result = {
        "minutes": a.minutes,
        "cycles": stats["cycles"],
        "faults_injected": stats["faults_injected"],
        "faults_survived": stats["faults_survived"],
        "epochs_completed": epochs,
        "samples_lost": lost,
        "samples_trained_twice": twice,
        "checkpoints_corrupted": stats["checkpoints_corrupted"],
        "rss_growth_after_warmup": growth,
        "rss_mib": rss_mib(),
    }
    for k, v in result.items():
        print(f"{k:24s} {v}")
    print(json.dumps({"bench": "soak", **result}))


if __name__ == "__main__":
    main()
