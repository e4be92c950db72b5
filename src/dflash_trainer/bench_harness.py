"""`dflash-trainer bench` / `make bench`: every benchmark under bench/, one table.

Each bench script prints a JSON summary as its last stdout line; its own `bench_rows` (beside the
script, in bench/) turns it into rows of (work, compared, ratio, min, max, note). Ratios are
always measured side by side in one run of one script (this machine is shared and noisy);
absolute figures are context only.
Writes `bench/out/results.md` and `bench/out/results.json`.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from dflash_trainer.errors import UserError
from dflash_trainer.pipeline.cores import usable_cpus
from dflash_trainer.precision import cpu_kind


def find_bench_dir(start: Path | None = None) -> Path:
    """The checkout's bench/ (its scripts are not part of the installed package): in `start`
    (default: the working directory) or the nearest parent that has one."""
    start = (start or Path.cwd()).resolve()
    for d in (start, *start.parents):
        if (d / "bench" / "bench_pipeline.py").is_file():
            return d / "bench"
    raise UserError(
        f"no bench/ directory with the benchmark scripts at or above {start}; run from the "
        "repository checkout (e.g. `make bench`)."
    )


def row(work, a, b, ratio, lo=None, hi=None, note=""):
    """One table row: `ratio` of `a` over `b` (median; min/max over repeats where given)."""
    return {
        "work": work,
        "compared": f"{a} vs {b}",
        "ratio": ratio,
        "min": ratio if lo is None else lo,
        "max": ratio if hi is None else hi,
        "note": note,
    }


def memory_read_gb_s(mib: int = 1024, reps: int = 5) -> float:
    """Measured read bandwidth of this process's threads: the best of `reps` sums over `mib` MiB
    of fp32 (far beyond any cache). What a decode step that reads every weight once is bound by."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def matmul_gflops(dtype: torch.dtype = torch.float32, n: int = 1024, reps: int = 8) -> float:
    """Measured matmul throughput of this process's threads in `dtype` (GFLOP/s, best of
    `reps`): the arithmetic bound of a step whose cost is its matmuls."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


# The scripts `dflash-trainer bench` runs, in table order. Each defines BENCH_ARGS (its arguments
# for a full and a --bench.quick run; the full ones keep the bench within about 20 minutes on 2
# cores where the script's own defaults size a longer study, bench/LOG.md) and bench_rows
# (its JSON summary, the last stdout line, as table rows: `row`).
# Qwen3-8B's shape (its config.json), for the benches that build a target of that size with no
# download: random weights (bench/gpu_check.py) or none at all (bench/bench_memory_plan.py).
QWEN3_8B_SHAPE = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)

# The smollm2-cpu preset's drafter step, as the bench scripts that time it run it: SmolLM2-135M's
# shapes (hidden 576, 9 heads / 3 KV heads, 2 layers, the 49,152-way LM head, 5 taps), block 16,
# 512-token batches of 2 x 256 tokens whose second half is the answer.
DEMO_HIDDEN, DEMO_VOCAB, DEMO_BLOCK, DEMO_TAPS, DEMO_ROWS, DEMO_SEQ = 576, 49152, 16, 5, 2, 256


def demo_drafter():
    """A randomly initialised drafter of the demo's shape (seeded: the same one every call)."""
    from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter

    torch.manual_seed(0)
    return DFlashDrafter(
        DFlashConfig(
            hidden_size=DEMO_HIDDEN,
            num_layers=2,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            intermediate_size=1536,
            block_size=DEMO_BLOCK,
            target_layer_ids=[1, 8, 14, 20, 27],
            num_target_layers=30,
            mask_token_id=0,
            vocab_size=DEMO_VOCAB,
            attention="split",
        )
    )


def demo_batch(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch `i` of the demo's shape: (ids, loss mask, tapped features), seeded by `i`."""
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(100, DEMO_VOCAB - 1, (DEMO_ROWS, DEMO_SEQ), generator=g)
    mask = torch.zeros(DEMO_ROWS, DEMO_SEQ, dtype=torch.bool)
    mask[:, DEMO_SEQ // 2 :] = True
    feats = torch.randn(DEMO_ROWS, DEMO_SEQ, DEMO_TAPS * DEMO_HIDDEN, generator=g)
    return ids, mask, feats


def max_rel_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest |got - want| of paired tensors, each relative to its `want`'s largest |value|."""
    return max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(got, want)
    )


@dataclass
class StepWay:
    """One side of an A/B of the demo's drafter step: its objective, what to set before each
    step (untimed: e.g. which kernels the loss takes), and whether the forward runs under CPU
    bf16 autocast."""

    objective: Any
    before: Callable[[], None] = lambda: None
    autocast: bool = False


@dataclass
class StepComparison:
    ms: dict[str, float]  # per way: mean ms per step (forward + backward + AdamW)
    worst_loss: float  # the largest relative loss difference of the first two ways
    worst_grad: float  # and of their gradients (max_rel_diff)
    steps: int  # measured steps each way

    def record(self) -> dict[str, Any]:
        """The JSON summary's shared fields: `<way>_ms` per way, speedup = the second way's ms
        over the first's, the differences, threads and steps."""
        first, second = list(self.ms)[:2]
        return {
            "threads": torch.get_num_threads(),
            "steps": self.steps,
            **{f"{w}_ms": v for w, v in self.ms.items()},
            "speedup": self.ms[second] / self.ms[first],
            "max_loss_rel_diff": self.worst_loss,
            "max_grad_rel_diff": self.worst_grad,
        }


def compare_drafter_steps(
    ways: dict[str, StepWay], embed: torch.Tensor, head: torch.nn.Module, steps: int
) -> StepComparison:
    """The demo's drafter step (demo_drafter, demo_batch) each way on the same batches and
    seeds, interleaved step by step so machine drift hits every way; two warm-up steps first."""
    names = list(ways)
    drafters = {w: demo_drafter() for w in names}
    opts = {w: torch.optim.AdamW(d.parameters(), lr=1e-4) for w, d in drafters.items()}
    secs = dict.fromkeys(names, 0.0)
    worst_loss = worst_grad = 0.0
    for i in range(steps + 2):
        ids, mask, feats = demo_batch(i)
        loss, grads = {}, {}
        for w, way in ways.items():
            way.before()
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=way.autocast):
                out = way.objective(
                    drafters[w], embed, head, feats, ids, mask, torch.Generator().manual_seed(i)
                )
            out.loss.backward()
            grads[w] = [p.grad.clone() for p in drafters[w].parameters()]
            opts[w].step()
            opts[w].zero_grad(set_to_none=True)
            if i >= 2:
                secs[w] += time.perf_counter() - t0
            loss[w] = float(out.loss.detach())
        a, b = names[0], names[1]
        worst_loss = max(worst_loss, abs(loss[a] - loss[b]) / abs(loss[b]))
        worst_grad = max(worst_grad, max_rel_diff(grads[a], grads[b]))
    ms = {w: 1e3 * s / steps for w, s in secs.items()}
    return StepComparison(ms, worst_loss, worst_grad, steps)


SCRIPTS = [
    "bench_batching.py",
    "bench_attention.py",
    "bench_taps.py",
    "bench_flops.py",
    "bench_pipeline.py",
    "bench_checkpoint.py",
    "bench_dtype.py",
    "bench_kd.py",
    "bench_generate.py",
    "bench_capture.py",
    "bench_decode.py",
    "bench_memory_plan.py",
    "bench_anchors.py",
    "bench_read_slots.py",
    "bench_frozen_head.py",
]


def load_script(path: Path) -> ModuleType:
    """A bench script as a module (its main() runs only as __main__): BENCH_ARGS, bench_rows."""
    spec = importlib.util.spec_from_file_location(f"dflash_bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def machine() -> str:
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu_kind()}, {usable_cpus()} CPU threads, {dev}, torch {torch.__version__}"


def run_all(bdir: Path, quick: bool = False, only: list[str] | None = None) -> list[dict]:
    rows: list[dict] = []
    for script in SCRIPTS:
        if only and script not in only:
            continue
        path = bdir / script
        if not path.is_file():
            print(f"bench: {script} missing, skipped", file=sys.stderr)
            continue
        module = load_script(path)
        cmd = [sys.executable, str(path), *module.BENCH_ARGS["quick" if quick else "full"]]
        print(f"bench: running {script} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True)
        took = time.monotonic() - t0
        if p.returncode:
            print(f"bench: {script} failed ({p.returncode}):\n{p.stderr[-2000:]}", file=sys.stderr)
            failed = row(script, "-", "-", float("nan"), note=f"FAILED rc={p.returncode}")
            failed["script"], failed["seconds"] = script, round(took, 1)  # --bench.only replaces it
            rows.append(failed)
            continue
        summary = json.loads(p.stdout.strip().splitlines()[-1])
        for r in module.bench_rows(summary):
            r["script"], r["seconds"] = script, round(took, 1)
            rows.append(r)
    return rows


def to_markdown(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| work | compared | ratio (median) | min-max | note |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['work']} | {r['compared']} | {r['ratio']:.3f} | "
            f"{r['min']:.3f}-{r['max']:.3f} | {r['note']} |"
        )
    return "\n".join(lines) + "\n"
