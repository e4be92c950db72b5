"""GPU check sized for one H200 (about 4 minutes, no downloads).

Random-initialised target of Qwen3-8B's shape, 5-layer drafter of its size (dflash-method.md §1.1),
synthetic token data of realistic lengths. Measures, in one run:
  - the device's bf16 matmul rate (8192^3), the ceiling MFU is read against
  - target forward tokens/s and MFU (tapped forward, bf16)
  - drafter step tokens/s and MFU (bf16 autocast, FlexAttention when available)
  - pipelined (target and drafter on two streams of one GPU) vs sequential schedule
  - observability on vs off (monitor, sinks, metrics ring, NVML telemetry vs none of it)
  - zero-sync check: the pipelined run under torch.cuda.set_sync_debug_mode("warn"), counting
    warnings raised from worker threads (must be 0)
  - memory peaks, and the memory plan made at start-up beside them (run/memory_plan.py)
  - per-step losses of the pipelined and the sequential schedule on the same batches (an unsafe
    hand-off between the streams shows as a difference or as skipped non-finite steps; any skip
    is a failure)
Each phase is independent: one that fails records its traceback and the others still run, so a
device lease is never spent for nothing. Results are written after every phase to
bench/out/gpu_check.json (and $OUT when set), with the pipelined run's metrics.jsonl beside it.
Rates are tokens / TrainResult.train_s (the stages' running time); the final checkpoint (the
drafter's fp32 state and Adam moments, ~12 GB at this size) and the export are skipped: this
check measures training, not the disk.

`--tiny` runs the same phases on a 2-layer model on CPU (or --device) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_pipeline import synthetic_dataset  # noqa: E402
from dflash_trainer.bench_harness import QWEN3_8B_SHAPE  # noqa: E402
from dflash_trainer.config_io import load_config  # noqa: E402
from dflash_trainer.models.target import TargetModel, tap_layer_ids  # noqa: E402
from dflash_trainer.observe.flops import peak_tflops  # noqa: E402
from dflash_trainer.observe.report import read_metrics  # noqa: E402
from dflash_trainer.run import train  # noqa: E402
from dflash_trainer.run.trainer import Trainer  # noqa: E402

# Training throughput, not disk: no final checkpoint, no export (see the module docstring).
Trainer.checkpoint_now = lambda self, background=False: None
Trainer._export_final = lambda self: None

QWEN3_8B = QWEN3_8B_SHAPE
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
TINY_DRAFTER = [
    "--drafter.num_layers=1",
    "--drafter.num_heads=4",
    "--drafter.num_kv_heads=2",
    "--drafter.head_dim=16",
    "--drafter.intermediate_size=128",
    "--objective.num_anchors=8",
    "--target.num_taps=2",
]


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


def make_cfg(run_dir, schedule, steps, device, tiny):
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
            # target and drafter share the one GPU here: the plan is recorded beside the
            # allocator's peak (a check of the plan on CUDA), not a reason to stop
            "--pipeline.memory_plan=warn",
            *(TINY_DRAFTER if tiny else []),
        ],
    )


def cuda_mem_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def run(target, ds, schedule, steps, args, observe=True, sync_check=False, keep_dir=None):
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
    try:
        with tempfile.TemporaryDirectory() as d:
            run_dir = keep_dir or d
            cfg = make_cfg(run_dir, schedule, steps, args.device, args.tiny)
            r = train(cfg, target=target, train_set=ds, observe=observe)
    finally:
        if sync_check:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = orig
    row = {
        "tok_s": r.tokens / r.train_s,
        "steps": r.steps,
        "tokens": r.tokens,
        "train_s": r.train_s,
        "wall_s": r.wall_s,
        "peak_mem_gib": cuda_mem_gib(),
        "balance": r.balance,
        "metrics": {
            k: v
            for k, v in r.metrics.items()
            if k.startswith(("tput/", "mem/", "gpu", "queue", "drafter/"))
        },
        "losses": {int(step): float(m["loss"]) for step, m in r.history if "loss" in m},
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

    def __init__(self, outs: list[Path]):
        self.outs = outs
        self.data: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "phases": {}, "errors": {}}
        for o in outs:
            o.mkdir(parents=True, exist_ok=True)

    def phase(self, name: str, fn):
        t0 = time.time()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            self.data["phases"][name] = fn()
            print(f"[gpu_check] {name}: done in {time.time() - t0:.1f} s", flush=True)
        except Exception:
            tb = traceback.format_exc()
            self.data["errors"][name] = tb
            print(f"[gpu_check] {name}: FAILED after {time.time() - t0:.1f} s\n{tb}", flush=True)
        self.write()
        return self.data["phases"].get(name)

    def write(self):
        text = json.dumps(self.data, indent=2, default=str)
        for o in self.outs:
            (o / "gpu_check.json").write_text(text)


def _runs(rep: Report, target, ds, args, outs: list[Path]) -> dict:
    """The measured runs (each a phase of the report): sequential, pipelined (its run directory
    kept), the zero-sync check on CUDA, observability off, pipelined again."""
    n = args.steps
    keep = outs[0] / "gpu_pipelined_run"
    shutil.rmtree(keep, ignore_errors=True)
    r = {"keep": keep, "sync": None}
    r["seq"] = rep.phase("sequential", lambda: run(target, ds, "sequential", n, args)[0])
    r["pipe"] = rep.phase(
        "pipelined", lambda: run(target, ds, "pipelined", n, args, keep_dir=keep)[0]
    )
    for o in outs[1:]:
        jl = keep / "metrics.jsonl"
        if jl.exists():
            shutil.copy(jl, o / "gpu_pipelined_metrics.jsonl")
    if args.device.startswith("cuda"):
        r["sync"] = rep.phase(
            "sync_check",
            lambda: dict(
                zip(("run", "hits"), run(target, ds, "pipelined", 6, args, sync_check=True))
            ),
        )
    r["off"] = rep.phase(
        "pipelined_observe_off", lambda: run(target, ds, "pipelined", n, args, observe=False)[0]
    )
    r["pipe2"] = rep.phase("pipelined_again", lambda: run(target, ds, "pipelined", n, args)[0])
    return r


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
    skipped = max((get(x, "metrics", {}) or {}).get("drafter/skipped_total", 0.0)
                  for x in (pipe, seq, off, r["pipe2"]))  # fmt: skip
    la, lb = get(pipe, "losses", {}) or {}, get(seq, "losses", {}) or {}
    common = sorted(set(la) & set(lb))
    loss_gap = max((abs(la[k] - lb[k]) / max(abs(lb[k]), 1e-9) for k in common), default=nan)
    return [
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
        ("per-step loss, pipelined vs sequential: largest relative difference", loss_gap),
        ("skipped (non-finite) optimizer steps, any run: must be 0", skipped),
        ("peak memory GiB (sequential)", get(seq, "peak_mem_gib")),
        ("balance (pipelined)", get(pipe, "balance", "")),
        ("mean sequence length", rep.data["mean_sequence_length"]),
        ("failed phases", ", ".join(rep.data["errors"]) or "none"),
        ("wall time of this check (s)", time.time() - t_all),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="an 8-layer model: check the script")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--steps", type=int, default=16, help="optimizer steps per measured run")
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        assert torch.cuda.is_available(), "gpu_check needs CUDA (or --tiny --device=cpu)"
    t_all = time.time()
    outs = [Path(__file__).parent / "out"] + (
        [Path(os.environ["OUT"])] if "OUT" in os.environ else []
    )
    rep = Report(outs)
    import transformers

    rep.data["env"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
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
    rep.write()
    print(f"\n## gpu_check {rep.data['date']} on {rep.data['env']['device']}\n")
    print("| metric | value |\n|---|---|")
    for k, v in table:
        print(f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |")


if __name__ == "__main__":
    main()
