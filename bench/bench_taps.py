"""Target feature extraction: tapped forward (hooks, early stop) vs output_hidden_states=True.

Usage: .venv/bin/python bench/bench_taps.py [--quick] [--batch 8] [--seq 512] [--dtype float32]
                                             [--threads T] [--device cpu|cuda]

On the embedded target (SmolLM2-135M, 30 layers, taps [1, 8, 14, 20, 27]). Variants:
  tapped          TargetModel.features: hooks on 5 layers, stops after layer 27, no logits
  hidden_states   model(..., output_hidden_states=True) then cat(hs[id+1]): the naive way
  hs_backbone     model.model(..., output_hidden_states=True): all hidden states, no LM head

Each variant runs in a fresh subprocess. Memory: CPU "peak_fwd_mib" is the peak RSS during the
forward minus the RSS right before it (the model already loaded); the peak is read from VmHWM after
resetting it through /proc/self/clear_refs, else from ru_maxrss. On CUDA it is
max_memory_allocated above the allocated memory before the forward.
The last line printed is one JSON object with every variant and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from dflash_trainer import bench_harness
from dflash_trainer.pipeline.cores import usable_cpus

VARIANTS = ("tapped", "hidden_states", "hs_backbone")


def _status_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def run_variant(variant: str, a) -> dict:
    import torch

    from dflash_trainer.config import TargetConfig
    from dflash_trainer.models.target import TargetModel

    torch.set_num_threads(a.threads)
    target = TargetModel.load(TargetConfig(dtype=a.dtype), a.device)
    model, ids_ = target.model, target.layer_ids
    dev = torch.device(a.device)

    def forward(x):
        if variant == "tapped":
            return target.features(x)
        with torch.no_grad():
            if variant == "hidden_states":
                hs = model(input_ids=x, output_hidden_states=True).hidden_states
            else:
                hs = model.model(input_ids=x, output_hidden_states=True).hidden_states
            return torch.cat([hs[i + 1] for i in ids_], dim=-1)

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, target.vocab_size, (a.batch, a.seq), generator=g).to(dev)
    forward(x[:1, :16])  # warm-up: lazy init, tiny
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = _status_mib("VmRSS") or 0.0
        hwm_ok = _reset_peak()
    times, checksum = [], 0.0
    for _ in range(a.steps):
        t0 = time.perf_counter()
        feats = forward(x)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        checksum = float(feats.float().abs().mean())  # bench only: one sync per step
        del feats
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
        method = "cuda_max_allocated"
    elif hwm_ok and _status_mib("VmHWM") is not None:
        peak, method = _status_mib("VmHWM"), "VmHWM"
    else:
        peak, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "ru_maxrss"
    step_s = min(times)
    return {
        "variant": variant,
        "step_s": step_s,
        "tokens_per_s": a.batch * a.seq / step_s,
        "peak_mib": peak,
        "peak_fwd_mib": peak - base,
        "mem_method": method,
        "checksum": checksum,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one timed forward per variant")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2, help="timed forwards (after a tiny warm-up)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=min(2, usable_cpus()))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # child-process mode
    a = ap.parse_args()
    if a.quick:
        a.steps = 1
    if a.variant:
        print(json.dumps(run_variant(a.variant, a)))
        return
    res = {}
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    for v in VARIANTS:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--variant",
            v,
            "--batch",
            str(a.batch),
            "--seq",
            str(a.seq),
            "--steps",
            str(a.steps),
            "--dtype",
            a.dtype,
            "--threads",
            str(a.threads),
            "--device",
            a.device,
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode:
            sys.exit(f"variant {v} failed:\n{p.stderr}")
        r = res[v] = json.loads(p.stdout.strip().splitlines()[-1])
        print(
            f"{v:14s} {r['step_s']:.2f} s/forward  {r['tokens_per_s']:.0f} tok/s  "
            f"peak {r['peak_mib']:.0f} MiB (+{r['peak_fwd_mib']:.0f} MiB in the forward, "
            f"{r['mem_method']})",
            flush=True,
        )
    t, h, b = res["tapped"], res["hidden_states"], res["hs_backbone"]
    summary = {
        "bench": "taps",
        "batch": a.batch,
        "seq": a.seq,
        "dtype": a.dtype,
        "device": a.device,
        "threads": a.threads,
        **res,
        "fwd_mem_ratio_hs_over_tapped": h["peak_fwd_mib"] / max(t["peak_fwd_mib"], 1.0),
        "fwd_mem_ratio_backbone_over_tapped": b["peak_fwd_mib"] / max(t["peak_fwd_mib"], 1.0),
        "peak_ratio_hs_over_tapped": h["peak_mib"] / t["peak_mib"],
        "speedup_tapped_vs_hs": h["step_s"] / t["step_s"],
        "speedup_tapped_vs_backbone": b["step_s"] / t["step_s"],
        "checksum_equal": abs(t["checksum"] - h["checksum"]) <= 1e-6 * max(abs(h["checksum"]), 1),
    }
    print(
        f"tapped vs output_hidden_states: {summary['fwd_mem_ratio_hs_over_tapped']:.1f}x less "
        f"forward memory ({summary['peak_ratio_hs_over_tapped']:.2f}x less total peak), "
        f"{summary['speedup_tapped_vs_hs']:.2f}x faster; vs backbone-only hidden states: "
        f"{summary['fwd_mem_ratio_backbone_over_tapped']:.1f}x less memory, "
        f"{summary['speedup_tapped_vs_backbone']:.2f}x faster"
    )
    print(json.dumps(summary))


# `dflash-trainer bench` (src/dflash_trainer/bench_harness.py) runs this script with these
# arguments (full run, --bench.quick) and turns its summary into rows with bench_rows.
BENCH_ARGS = {"full": [], "quick": ["--quick"]}


def bench_rows(s: dict) -> list[dict]:
    """This script's JSON summary as rows of the `dflash-trainer bench` table."""
    return [
        bench_harness.row(
            "target forward, forward memory",
            "output_hidden_states",
            "tapped hooks",
            s["fwd_mem_ratio_hs_over_tapped"],
            note="how much more the HF way needs",
        ),
        bench_harness.row(
            "target forward, time",
            "tapped hooks",
            "output_hidden_states",
            s["speedup_tapped_vs_hs"],
            note="speedup",
        ),
    ]


if __name__ == "__main__":
    main()
