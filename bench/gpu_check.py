"""GPU check for one H100 80 GB or one H200 141 GB (no downloads; some phases need 2 GPUs).

Time: the phases before issue 45 took 202 s on an H200 (bench/LOG.md); with the slow-stream and
80 GB runs about 5-6 minutes are expected, and about a minute more with two GPUs (estimates, not
yet measured), within gpu_check.sh's 480 s.

Random-initialised target of Qwen3-8B's shape, 5-layer drafter of its size (dflash-method.md §1.1),
synthetic token data of realistic lengths, target and drafter on one GPU (two CUDA streams).
Measures, in one run:
  - the device's bf16 matmul rate (8192^3), the ceiling MFU is read against
  - target forward tokens/s and MFU (tapped forward, bf16)
  - drafter step tokens/s and MFU (bf16 autocast, FlexAttention when available)
  - pipelined (target and drafter on two streams of one GPU) vs sequential schedule
  - observability on vs off (monitor, sinks, metrics ring, NVML telemetry vs none of it)
  - zero-sync check: the pipelined run under torch.cuda.set_sync_debug_mode("warn"), counting
    warnings raised from worker threads (must be 0)
  - memory peaks, and the memory plan made at start-up beside them (run/memory_plan.py)
  - per-step losses of the pipelined and the sequential schedule on the same batches (an unsafe
    hand-off between the streams shows as a difference or as skipped non-finite steps)
  - forced slow target stream: the pipelined run again with the target's work delayed on its
    CUDA stream before every tapped forward (torch.cuda._sleep, 1.2x a drafter micro-step, so the
    drafter waits for its features on every batch; the target's `features` is wrapped here, not
    in src/): per-step losses against the sequential run's, skipped steps
  - every run's skipped steps and CUDA caching-allocator retries and OOMs (memory_stats
    num_alloc_retries / num_ooms, read around each run)
  - a run capped at an H100's memory: torch.cuda.set_per_process_memory_fraction(79.2 GiB /
    total) on a larger card (none on an 80 GB card; the plan is told the cap), with the preset's
    [gpu_80gb] values, memory_plan=refuse: ran, or refused by the plan (which counts the
    co-located 16 GiB target; a valid, reported outcome), and then how the same run fares with
    memory_plan=warn; peak memory, the plan's figure, retries and OOMs
  - with 2 or more GPUs (bench/gpu_check_multi.py: a small model, split attention): the
    cross-device hand-off (two target workers on cuda:1, the drafter on cuda:0, the target's
    stream delayed), SIGTERM and exact resume in subprocesses with that layout, and torchrun
    --nproc-per-node=2 over NCCL with pipeline.split=1:1, each against a single-device run's
    per-step losses. With one GPU they are skipped, saying so
  - a verdict: FAIL where a run skipped a step, a per-step loss differs from its reference's by
    more than LOSS_RTOL (2e-2 relative; gpu_check_multi.py says why), a worker thread
    synchronised, a resume was not exact, a run the plan admitted ran out of memory, or a phase
    failed; else PASS. The exit status is 1 on FAIL.
Each phase is independent: one that fails records its traceback and the others still run, so a
device lease is never spent for nothing; a phase that would not finish within the time budget
(--budget-s, GPU_CHECK_TIMEOUT_S) is skipped, saying so, so the table is always printed. Results
are written after every phase to bench/out/gpu_check.json (and $OUT when set), with the pipelined
run's metrics.jsonl and the multi-process phases' logs (gpu_check_multi/) beside it. Rates are
tokens / TrainResult.train_s (the stages' running time); the final checkpoint (the drafter's fp32
state and Adam moments, ~12 GB at this size) and the export are skipped in this process: this
check measures training, not the disk. Only the pipelined run and the capped run make the memory
plan (~10 s of CPU each at this size).

`--tiny` runs the same phases on an 8-layer model on CPU (or --device) to check the script itself;
`--multi-cpu` runs the two-device phases on the CPU (target_devices=cpu,cpu; gloo).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import tomllib
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import dflash_trainer.run.memory_plan as memory_plan  # noqa: E402
import gpu_check_multi as multi  # noqa: E402
from bench_pipeline import synthetic_dataset  # noqa: E402
from dflash_trainer.bench_harness import QWEN3_8B_SHAPE  # noqa: E402
from dflash_trainer.config import PRESET_DIR  # noqa: E402
from dflash_trainer.config_io import GPU_80GB_TABLE, load_config  # noqa: E402
from dflash_trainer.errors import UserError  # noqa: E402
from dflash_trainer.models.target import TargetModel, tap_layer_ids  # noqa: E402
from dflash_trainer.observe.flops import peak_tflops  # noqa: E402
from dflash_trainer.observe.report import read_metrics  # noqa: E402
from dflash_trainer.run import train  # noqa: E402
from dflash_trainer.run.trainer import Trainer  # noqa: E402
from gpu_check_multi import (  # noqa: E402
    LOSS_RTOL,
    TINY,
    TINY_DRAFTER,
    alloc_counters,
    loss_gap,
    slow_target_stream,
    summarize,
)

# Training throughput, not disk: no final checkpoint, no export (see the module docstring).
# (The subprocesses of gpu_check_multi.py checkpoint: their resume needs it.)
Trainer.checkpoint_now = lambda self, background=False: None
Trainer._export_final = lambda self: None

QWEN3_8B = QWEN3_8B_SHAPE
GiB = 1 << 30
# What torch reports as an H100 80 GB's total memory (bench/LOG.md, the memory plan's table):
# the cap of the 80 GB run on a larger card.
H100_BYTES = int(79.19 * GiB)
CAPPED_STEPS = 6
MARGIN_S = 20.0  # left of the budget for the table


def random_target(shape: dict, device: str) -> TargetModel:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        **shape, max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False
    )
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    layers = shape["num_hidden_layers"]
    taps = tap_layer_ids(layers, 5 if layers > 8 else 2)
    return TargetModel.from_hf(model, None, taps, name=f"random-Qwen3-{layers}L")


def make_cfg(run_dir, schedule, steps, device, tiny, plan="off", extra=()):
    return load_config(
        "qwen3-8b",
        None,
        [
            f"--run_dir={run_dir}",
            f"--pipeline.target_devices={device}",
            f"--pipeline.drafter_device={device}",
            f"--pipeline.schedule={schedule}",
            f"--optim.max_steps={steps}",
            "--optim.epochs=100",
            "--metrics.wandb=off",
            "--metrics.tensorboard=false",
            "--metrics.console=false",
            "--metrics.log_every_s=2",
            "--data.max_length=3072",
            "--batching.max_tokens=16384",
            "--checkpoint.keep_last=1",
            "--objective.num_anchors=512",
            # target and drafter share the one GPU here: the plan (made by the pipelined and the
            # capped runs only: ~10 s each at this size) is recorded beside the allocator's peak
            # (a check of the plan on CUDA), not a reason to stop
            f"--pipeline.memory_plan={plan}",
            *(TINY_DRAFTER if tiny else []),
            *extra,
        ],
    )


def gpu_80gb_flags() -> list[str]:
    """The qwen3-8b preset's [gpu_80gb] table as flags (config_io applies it by itself only
    where the drafter's card has < 100 GiB)."""
    table = tomllib.loads((PRESET_DIR / "qwen3-8b.toml").read_text())[GPU_80GB_TABLE]

    def flat(d: dict, prefix: str = "") -> dict:
        out: dict = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out

    return [f"--{k}={v}" for k, v in flat(table).items()]


def cuda_mem_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def run(
    target, ds, schedule, steps, args, observe=True, sync_check=False, keep_dir=None, plan="off",
    extra=(),
):  # fmt: skip
    hits = []
    if sync_check:
        torch.cuda.set_sync_debug_mode("warn")
        orig = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            name = threading.current_thread().name
            if name.startswith(("target", "drafter", "sequential")):
                hits.append((name, str(message)[:200]))

        warnings.showwarning = record
        warnings.simplefilter("always")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    before = alloc_counters()
    try:
        with tempfile.TemporaryDirectory() as d:
            run_dir = keep_dir or d
            cfg = make_cfg(run_dir, schedule, steps, args.device, args.tiny, plan, extra)
            r = train(cfg, target=target, train_set=ds, observe=observe)
    finally:
        if sync_check:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = orig
    after = alloc_counters()
    row = {
        **summarize(r),
        "tok_s": r.tokens / r.train_s,
        "peak_mem_gib": cuda_mem_gib(),
        "alloc_retries": after[0] - before[0],
        "ooms": after[1] - before[1],
        "grad_accum": cfg.optim.grad_accum,
        "balance": r.balance,
        "metrics": {
            k: v
            for k, v in r.metrics.items()
            if k.startswith(("tput/", "mem/", "gpu", "queue", "drafter/"))
        },
    }
    return row, hits


def matmul_tflops(device: str) -> float:
    if not device.startswith("cuda"):
        return 0.0
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - t0) / 1e12


def window_means(jsonl: Path) -> dict[str, float]:
    """Mean of each metric over the run's full log windows: the last one (the drain, stages
    idling) is left out, so the rows describe the steady state, not the final snapshot."""
    if not jsonl.exists():
        return {}
    rows = read_metrics(jsonl)[0][:-1]
    sums: dict[str, list[float]] = {}
    for r in rows:
        for k, v in r.items():
            if isinstance(v, (int, float)):
                sums.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in sums.items()}


class Report:
    """Phase results, written after every phase (to bench/out and $OUT when set)."""

    def __init__(self, outs: list[Path], deadline: float):
        self.outs = outs
        self.deadline = deadline  # time.time() by which the table must be printed
        self.data: dict = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "phases": {},
            "errors": {},
            "skipped": {},
            "durations_s": {},
        }
        for o in outs:
            o.mkdir(parents=True, exist_ok=True)

    def left_s(self) -> float:
        return self.deadline - time.time()

    def skip(self, name: str, reason: str) -> None:
        self.data["skipped"][name] = reason
        print(f"[gpu_check] {name}: skipped: {reason}", flush=True)
        self.write()

    def phase(self, name: str, fn, need_s: float = 0.0):
        """Run `fn` as phase `name` (None when it fails or is skipped); skipped where fewer than
        `need_s` seconds (an estimate) are left of the budget."""
        if need_s and self.left_s() < need_s:
            self.skip(name, f"not enough time left ({self.left_s():.0f} s; needs ~{need_s:.0f})")
            return None
        t0 = time.time()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            self.data["phases"][name] = fn()
            print(f"[gpu_check] {name}: done in {time.time() - t0:.1f} s", flush=True)
        except Exception:
            tb = traceback.format_exc()
            self.data["errors"][name] = tb
            print(f"[gpu_check] {name}: FAILED after {time.time() - t0:.1f} s\n{tb}", flush=True)
        self.data["durations_s"][name] = round(time.time() - t0, 1)
        self.write()
        return self.data["phases"].get(name)

    def write(self):
        text = json.dumps(self.data, indent=2, default=str)
        for o in self.outs:
            (o / "gpu_check.json").write_text(text)


# ------------------------------------------------------------------------------- new phases
def slow_target_run(target, ds, args, pipe: dict | None) -> dict:
    """The pipelined run with the target's stream delayed before every tapped forward by 1.2x
    the pipelined run's time per micro-batch (0.05-1.5 s): the target stream falls behind the
    drafter's, which then waits on the hand-off event for every batch. A no-op on a CPU."""
    ga = make_cfg("unused", "pipelined", args.steps, args.device, args.tiny).optim.grad_accum
    micro = pipe["train_s"] / max(1, pipe["steps"] * ga) if pipe else 0.5
    delay = min(1.5, max(0.05, 1.2 * micro)) if args.device.startswith("cuda") else 0.0
    with slow_target_stream(target, delay) as cycles:
        row, _ = run(target, ds, "pipelined", args.steps, args)
    row.update(delay_ms=delay * 1e3, sleep_cycles=cycles)
    return row


def _out_of_memory(e: BaseException) -> bool:
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, torch.OutOfMemoryError) or "out of memory" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def capped_80gb(target, ds, args) -> dict:
    """A few steps with the preset's [gpu_80gb] values, the process capped at an H100's memory
    on a larger card; memory_plan=refuse first, then (when refused) memory_plan=warn."""
    out: dict = {"flags": gpu_80gb_flags(), "cap_gib": None, "attempts": []}
    cuda = args.device.startswith("cuda")
    dev = torch.device(args.device)
    cap = None
    if cuda:
        total = torch.cuda.get_device_properties(dev).total_memory
        out["total_gib"] = total / GiB
        if total / GiB >= 100:
            gc.collect()
            torch.cuda.empty_cache()  # the earlier runs' cached blocks would count against it
            cap = H100_BYTES
            out["fraction"] = cap / total
            torch.cuda.set_per_process_memory_fraction(cap / total, dev)
            out["cap_gib"] = cap / GiB
    plans: list = []
    orig_capacity, orig_check = memory_plan.device_capacity, memory_plan.MemoryPlan.check

    def capacity(device):  # the plan is told the cap (it reads the card's total otherwise)
        full = orig_capacity(device)
        return min(full, cap) if cap and device.type == "cuda" else full

    def check(self, mode):
        plans.append(self.total / GiB)
        return orig_check(self, mode)

    memory_plan.device_capacity, memory_plan.MemoryPlan.check = capacity, check
    try:
        for mode in ("refuse", "warn"):
            att: dict = {"memory_plan": mode}
            out["attempts"].append(att)
            gc.collect()  # the refused attempt's drafter and optimizer, held in reference cycles
            before, n_plans = alloc_counters(), len(plans)
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            try:
                row, _ = run(
                    target, ds, "pipelined", CAPPED_STEPS, args, plan=mode, extra=out["flags"]
                )
                att.update(outcome="ran", **row)
            except Exception as e:
                refused = isinstance(e, UserError) and "the run would need" in str(e)
                if not (refused or _out_of_memory(e)):
                    raise
                att["outcome"] = "refused by the memory plan" if refused else "out of memory"
                att["message"] = str(e)[:2000]
                after = alloc_counters()
                att.update(
                    peak_mem_gib=cuda_mem_gib(),
                    alloc_retries=after[0] - before[0],
                    ooms=after[1] - before[1],
                )
            att["plan_gib"] = plans[n_plans] if len(plans) > n_plans else None
            if att["outcome"] != "refused by the memory plan":
                break
    finally:
        memory_plan.device_capacity, memory_plan.MemoryPlan.check = orig_capacity, orig_check
        if cap:
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
            gc.collect()
            torch.cuda.empty_cache()
    return out


def multi_devices(args) -> tuple[str, str] | str:
    """(drafter device, target device) of the two-device phases, or why they do not run."""
    if args.multi_cpu:
        return "cpu", "cpu"
    if not args.device.startswith("cuda"):
        return "needs 2 GPUs (or --multi-cpu: the same phases on the CPU)"
    n = torch.cuda.device_count()
    if n < 2:
        return f"needs 2 GPUs ({n} visible)"
    first = torch.device(args.device).index or 0
    other = next(i for i in range(n) if i != first)
    return f"cuda:{first}", f"cuda:{other}"


MULTI = ("multi_reference", "multi_cross_device", "multi_sigterm_resume", "multi_split")


def _multi(rep: Report, args, outs: list[Path]) -> dict:
    devs = multi_devices(args)
    if isinstance(devs, str):
        for name in MULTI:
            rep.skip(name, devs)
        return {}
    dev0, dev1 = devs
    if torch.cuda.is_available():  # the blocks this process keeps cached: the children's room
        gc.collect()
        torch.cuda.empty_cache()
    base = outs[-1] / "gpu_check_multi"  # the children's logs and run directories
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    ref = rep.phase("multi_reference", lambda: multi.reference(base, dev0), need_s=30)
    return {
        "devices": devs,
        "ref": ref,
        "cross": rep.phase(
            "multi_cross_device", lambda: multi.cross_device(base, dev0, dev1, ref), need_s=30
        ),
        "resume": rep.phase(
            "multi_sigterm_resume",
            lambda: multi.sigterm_resume(base, dev0, dev1, ref),
            need_s=70,
        ),
        "split": rep.phase("multi_split", lambda: multi.split(base, dev0, ref), need_s=50),
    }


def _runs(rep: Report, target, ds, args, outs: list[Path]) -> dict:
    """The measured runs (each a phase of the report): sequential, pipelined (its run directory
    kept), the zero-sync check on CUDA, the slow target stream, the capped run, the two-device
    phases, observability off, pipelined again; the most telling first, should time run out."""
    n = args.steps
    keep = outs[0] / "gpu_pipelined_run"
    shutil.rmtree(keep, ignore_errors=True)
    r: dict = {"keep": keep, "sync": None}
    r["seq"] = rep.phase("sequential", lambda: run(target, ds, "sequential", n, args)[0])
    r["pipe"] = rep.phase(
        "pipelined", lambda: run(target, ds, "pipelined", n, args, keep_dir=keep, plan="warn")[0]
    )
    for o in outs[1:]:
        jl = keep / "metrics.jsonl"
        if jl.exists():
            shutil.copy(jl, o / "gpu_pipelined_metrics.jsonl")
    # a measured run's wall time (start-up included): what the time guards estimate from
    est = max((x or {}).get("wall_s", 0.0) for x in (r["seq"], r["pipe"])) or 60.0
    if args.device.startswith("cuda"):
        r["sync"] = rep.phase(
            "sync_check",
            lambda: dict(
                zip(("run", "hits"), run(target, ds, "pipelined", 6, args, sync_check=True))
            ),
            need_s=0.6 * est,
        )
    else:
        rep.skip("sync_check", "needs CUDA")
    r["slow"] = rep.phase(
        "slow_target_stream", lambda: slow_target_run(target, ds, args, r["pipe"]), need_s=2 * est
    )
    r["capped"] = rep.phase("capped_80gb", lambda: capped_80gb(target, ds, args), need_s=est + 30)
    r["multi"] = _multi(rep, args, outs)
    r["off"] = rep.phase(
        "pipelined_observe_off",
        lambda: run(target, ds, "pipelined", n, args, observe=False)[0],
        need_s=est,
    )
    r["pipe2"] = rep.phase(
        "pipelined_again", lambda: run(target, ds, "pipelined", n, args)[0], need_s=est
    )
    return r


# ------------------------------------------------------------------------------- the table
def _run_rows(rep: Report, r: dict) -> list[tuple[str, dict]]:
    """Every training run of the check that finished or was stopped, with its counters."""
    p = rep.data["phases"]
    rows = [(k, p.get(k)) for k in ("warmup", "sequential", "pipelined")]
    rows.append(("sync_check", (r.get("sync") or {}).get("run")))
    rows.append(("slow_target_stream", r.get("slow")))
    for att in (r.get("capped") or {}).get("attempts", []):
        rows.append((f"capped_80gb, memory_plan={att['memory_plan']}", att))
    m = r.get("multi") or {}
    rows += [("multi_reference", m.get("ref")), ("multi_cross_device", m.get("cross"))]
    res = m.get("resume") or {}
    rows += [("multi_sigterm_resume: interrupted", res.get("interrupted"))]
    rows += [("multi_sigterm_resume: resumed", res.get("resumed"))]
    sp = m.get("split") or {}
    rows += [("multi_split: drafter rank", sp.get("drafter_rank"))]
    rows += [("multi_split: target rank", sp.get("target_rank"))]
    rows += [("pipelined_observe_off", r.get("off")), ("pipelined_again", r.get("pipe2"))]
    return [(k, v) for k, v in rows if v and "steps" in v]


def _gaps(r: dict) -> list[tuple[str, float]]:
    """(what, largest relative per-step loss difference) of every comparison that ran."""
    out = []
    seq = r.get("seq")
    for key, what in (("pipe", "pipelined"), ("slow", "slow target stream"),
                      ("pipe2", "pipelined again")):  # fmt: skip
        if seq and r.get(key):
            out.append((f"{what} vs sequential", loss_gap(r[key]["losses"], seq["losses"])))
    m = r.get("multi") or {}
    for key, what in (("cross", "cross-device, 2 target workers"), ("resume", "SIGTERM + resume"),
                      ("split", "split 1:1 (torchrun)")):  # fmt: skip
        if m.get("ref") and m.get(key):
            out.append((f"{what} vs single-device sequential", m[key]["loss_gap"]))
    return out


def verdict(rep: Report, r: dict) -> list[str]:
    """Why the check fails (empty: PASS)."""
    fails = []
    if rep.data["errors"]:
        fails.append("failed phases: " + ", ".join(rep.data["errors"]))
    for name, row in _run_rows(rep, r):
        if row.get("skipped", 0) > 0:
            fails.append(f"{name} skipped {row['skipped']:.0f} steps")
    for what, gap in _gaps(r):
        if not gap <= LOSS_RTOL:  # nan (no common step) and inf (non-finite) fail too
            fails.append(f"loss difference {what}: {gap:.3g} > {LOSS_RTOL}")
    sync = r.get("sync")
    if sync and sync["hits"]:
        fails.append(f"{len(sync['hits'])} sync warnings from worker threads")
    for att in (r.get("capped") or {}).get("attempts", []):
        if att["memory_plan"] == "refuse" and att["outcome"] == "out of memory":
            fails.append("capped_80gb: the memory plan admitted a run that ran out of memory")
    m = r.get("multi") or {}
    res = m.get("resume")
    if res:
        for key in ("stopped_by_signal", "resumed_steps_ok", "ledger_exact"):
            if not res[key]:
                fails.append(f"multi_sigterm_resume: {key} is false")
    if m.get("split") and not m["split"]["finite"]:
        fails.append("multi_split: non-finite (or no) losses")
    return fails


def _fmt(v, digits=3) -> str:
    if v is None:
        return "n/a"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _table(rep: Report, r: dict, t_all: float) -> list[tuple]:
    """The report's table: one (metric, value) per row."""

    def get(row, key, default=float("nan")):
        return row.get(key, default) if row else default

    m = window_means(r["keep"] / "metrics.jsonl")
    pipe, seq, off, sync = r["pipe"], r["seq"], r["off"], r["sync"]
    pipes = [x["tok_s"] for x in (pipe, r["pipe2"]) if x]
    nan = float("nan")
    plans = (
        [
            json.loads(line)
            for line in (r["keep"] / "metrics.jsonl").read_text().splitlines()
            if "mem/plan_gib" in line
        ]
        if (r["keep"] / "metrics.jsonl").is_file()
        else []
    )
    pm = plans[0] if plans else {}
    runs = _run_rows(rep, r)
    skipped = max((row.get("skipped", 0.0) for _, row in runs), default=0.0)
    table = [
        ("device", rep.data["env"]["device"]),
        ("bf16 matmul 8192^3 TFLOP/s (measured)", get(rep.data["phases"], "matmul_bf16_tflops")),
        ("device peak TFLOP/s used for MFU", rep.data["peak_tflops_table"]),
        ("target tokens/s (pipelined, window mean)", m.get("tput/target_tok_s", nan)),
        ("target MFU % (pipelined, window mean)", m.get("tput/mfu_target", nan)),
        ("drafter tokens/s (pipelined, window mean)", m.get("tput/drafter_tok_s", nan)),
        ("drafter MFU % (pipelined, window mean)", m.get("tput/mfu_drafter", nan)),
        ("target busy (pipelined, window mean)", m.get("worker/target0/busy_frac", nan)),
        ("drafter busy (pipelined, window mean)", m.get("worker/drafter0/busy_frac", nan)),
        ("GPU util % (NVML, window mean)", m.get("gpu/0/util", nan)),
        ("pipelined tokens/s", get(pipe, "tok_s")),
        ("sequential tokens/s", get(seq, "tok_s")),
        ("pipelined / sequential", get(pipe, "tok_s") / get(seq, "tok_s")),
        (
            "observability on / off",
            (sum(pipes) / len(pipes) if pipes else nan) / get(off, "tok_s"),
        ),
        ("sync warnings from worker threads", len(sync["hits"]) if sync else "n/a"),
        ("peak memory GiB (pipelined)", get(pipe, "peak_mem_gib")),
        (
            "memory plan GiB (drafter + co-located target, at the largest batch)",
            pm.get("mem/plan_gib", nan),
        ),  # fmt: skip
        (
            "memory plan / allocator peak (pipelined)",
            pm.get("mem/plan_gib", nan) / (get(pipe, "peak_mem_gib") or nan),
        ),  # fmt: skip
        ("peak memory GiB (sequential)", get(seq, "peak_mem_gib")),
        ("balance (pipelined)", get(pipe, "balance", "")),
        ("mean sequence length", rep.data["mean_sequence_length"]),
    ]
    slow = r.get("slow")
    table.append(
        ("slow target stream: delay per tapped forward (ms; 0 on a CPU)", get(slow, "delay_ms"))
    )
    for what, gap in _gaps(r):
        table.append((f"per-step loss, {what}: largest relative difference", f"{gap:.2e}"))
    table.append(("skipped (non-finite) optimizer steps, any run: must be 0", int(skipped)))
    table += _capped_rows(r.get("capped"))
    table += _multi_rows(rep, r.get("multi") or {})
    return table + _closing_rows(rep, r, runs, t_all)


def _closing_rows(rep: Report, r: dict, runs: list, t_all: float) -> list[tuple]:
    """Per-run counters, the allocator's totals, failed and skipped phases, the verdict."""
    table = []
    for name, row in runs:
        table.append(
            (
                f"run {name}: steps / skipped / alloc retries / OOMs / peak GiB",
                f"{row['steps']} / {row.get('skipped', 0):.0f} / {row.get('alloc_retries', 0)} / "
                f"{row.get('ooms', 0)} / {_fmt(row.get('peak_mem_gib'), 1)}",
            )
        )
    retries, ooms = alloc_counters()
    table.append(("allocator retries / OOMs, whole check (every device)", f"{retries} / {ooms}"))
    table.append(("loss tolerance (relative, per step)", f"{LOSS_RTOL:g}"))
    table.append(("failed phases", ", ".join(rep.data["errors"]) or "none"))
    why: dict[str, list[str]] = {}  # reason -> the phases skipped for it
    for name, reason in rep.data["skipped"].items():
        why.setdefault(reason, []).append(name)
    table.append(
        ("skipped phases", "; ".join(f"{', '.join(n)}: {w}" for w, n in why.items()) or "none")
    )
    table.append(("wall time of this check (s)", time.time() - t_all))
    fails = verdict(rep, r)
    table.append(("VERDICT", "FAIL: " + "; ".join(fails) if fails else "PASS"))
    return table


def _capped_rows(c: dict | None) -> list[tuple]:
    if not c:
        return [("80 GB run", "did not run (see failed / skipped phases)")]
    if c.get("cap_gib"):
        cap = f"{c['cap_gib']:.1f} GiB of {c['total_gib']:.1f} (fraction {c['fraction']:.3f})"
    elif "total_gib" in c:
        cap = f"none: the card has {c['total_gib']:.1f} GiB"
    else:
        cap = "none (CPU)"
    rows = [("80 GB run: cap", cap), ("80 GB run: [gpu_80gb] values", " ".join(c["flags"]))]
    for att in c["attempts"]:
        rows.append(
            (
                f"80 GB run, memory_plan={att['memory_plan']}: outcome / plan GiB / peak GiB / "
                "alloc retries / OOMs",
                f"{att['outcome']} / {_fmt(att.get('plan_gib'), 1)} / "
                f"{_fmt(att.get('peak_mem_gib'), 1)} / {att.get('alloc_retries')} / "
                f"{att.get('ooms')}",
            )
        )
        if att.get("message"):
            first = att["message"].splitlines()[0]
            rows.append((f"80 GB run, memory_plan={att['memory_plan']}: message", first[:300]))
    return rows


def _multi_rows(rep: Report, m: dict) -> list[tuple]:
    if not m:
        why = rep.data["skipped"].get("multi_reference", "see failed phases")
        return [("two-device phases", f"skipped: {why}")]
    dev0, dev1 = m["devices"]
    rows = [("two-device phases: drafter / target device", f"{dev0} / {dev1}")]
    if m.get("cross"):
        c = m["cross"]
        rows.append(("cross-device: delay per tapped forward (ms; 0 on a CPU)", c["delay_ms"]))
    if m.get("resume"):
        x = m["resume"]
        rows.append(
            (
                "SIGTERM + resume: stopped at step / by signal / resumed steps exact / ledger "
                "exact / gap of the resumed steps",
                f"{x['stopped_at']} / {x['stopped_by_signal']} / {x['resumed_steps_ok']} / "
                f"{x['ledger_exact']} / {_fmt(x['loss_gap_resumed'], 6)}",
            )
        )
    if m.get("split"):
        s = m["split"]
        rows.append(
            (
                "split 1:1: backend / steps / losses finite",
                f"{s['backend']} / {s['drafter_rank']['steps']} / {s['finite']}",
            )
        )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="an 8-layer model: check the script")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--steps", type=int, default=16, help="optimizer steps per measured run")
    ap.add_argument(
        "--multi-cpu",
        action="store_true",
        help="run the two-device phases on the CPU (target_devices=cpu,cpu; gloo)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=float(os.environ.get("GPU_CHECK_TIMEOUT_S", 480)),
        help="the check's time limit (GPU_CHECK_TIMEOUT_S, else 480): phases that would not "
        "finish in it are skipped, so the table is printed",
    )
    args = ap.parse_args()
    # gpu_check.sh's timeout: stop here (a subprocess's group is killed on the way out); inside
    # a training run the trainer's own handler stops it gracefully first
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.device.startswith("cuda"):
        assert torch.cuda.is_available(), "gpu_check needs CUDA (or --tiny --device=cpu)"
    t_all = time.time()
    outs = [Path(__file__).parent / "out"] + (
        [Path(os.environ["OUT"])] if "OUT" in os.environ else []
    )
    rep = Report(outs, deadline=t_all + args.budget_s - MARGIN_S)
    multi.DEADLINE = rep.deadline
    import transformers

    rep.data["env"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cpu_count": os.cpu_count(),
    }
    print(rep.data["env"], flush=True)
    rep.phase("matmul_bf16_tflops", lambda: matmul_tflops(args.device))
    target = rep.phase(
        "build_target", lambda: random_target(TINY if args.tiny else QWEN3_8B, args.device)
    )
    if target is None:
        return
    rep.data["phases"]["build_target"] = target.name  # not JSON
    ds = synthetic_dataset(3000, target.vocab_size)
    rep.data["mean_sequence_length"] = float(np.asarray(ds.lengths).mean())
    rep.data["peak_tflops_table"] = peak_tflops(torch.device(args.device))
    # warm-up: flex attention compiles, cuBLAS heuristics, the allocator's pools
    rep.phase("warmup", lambda: run(target, ds, "pipelined", 3, args)[0])
    table = _table(rep, _runs(rep, target, ds, args, outs), t_all)
    rep.data["table"] = table
    rep.data["verdict"] = table[-1][1]
    rep.write()
    print(f"\n## gpu_check {rep.data['date']} on {rep.data['env']['device']}\n")
    print("| metric | value |\n|---|---|")
    for k, v in table:
        print(f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |")
    print(f"\ngpu_check: {rep.data['verdict']}", flush=True)
    if rep.data["verdict"] != "PASS":
        sys.exit(1)


if __name__ == "__main__":
    main()
