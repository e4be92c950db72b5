"""What `dtype=auto` decides: the embedded target's tapped forward in bf16 vs fp32, this CPU.

Interleaved repeats of the same forward (4 x 512 tokens, the training path's tapped forward
with its 4-D causal mask; 1 x 128 where bf16 is emulated) in each dtype; prints tokens/s of
both and the ratio, and what `auto` picks here. On CPUs without native bf16 matmuls
(AVX2-only) bf16 is emulated and slower.

Run: .venv/bin/python bench/bench_dtype.py [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dflash_trainer import bench_harness
from dflash_trainer.config_io import load_config
from dflash_trainer.models.target import TargetModel
from dflash_trainer.precision import cpu_has_native_bf16, cpu_kind, dtype_name


def _causal(S: int, dtype) -> torch.Tensor:
    return torch.full((S, S), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not cpu_has_native_bf16():
        # Emulated bf16 runs 10-50x slower than fp32: a short forward shows the ratio `auto`
        # acts on without spending most of `make bench` on the dtype it never picks here.
        args.rows, args.seq = 1, min(args.seq, 128)
    targets = {}
    for name in ("float32", "bfloat16"):
        cfg = load_config(preset="smollm2-cpu")
        cfg.target.dtype = name
        targets[name] = TargetModel.load(cfg.target, "cpu")
    ids = torch.randint(100, 20000, (args.rows, args.seq))
    times: dict[str, list[float]] = {k: [] for k in targets}
    with torch.no_grad():
        for t in targets.values():  # warm-up
            t.features(ids[:, :64], _causal(64, t.dtype))
        for _ in range(args.repeats):
            for name, t in targets.items():
                mask = _causal(args.seq, t.dtype)
                t0 = time.perf_counter()
                t.features(ids, mask)
                times[name].append(time.perf_counter() - t0)
    tok = args.rows * args.seq
    rate = {k: tok / statistics.median(v) for k, v in times.items()}
    out = {
        "cpu": cpu_kind(),
        "native_bf16": cpu_has_native_bf16(),
        "auto_picks": dtype_name("auto", "cpu"),
        "fp32_tok_s": round(rate["float32"], 1),
        "bf16_tok_s": round(rate["bfloat16"], 1),
        "bf16_vs_fp32": round(rate["bfloat16"] / rate["float32"], 3),
        "tokens": f"{args.rows} x {args.seq}",
    }
    print(
        f"tapped target forward, {args.rows} x {args.seq}: fp32 {out['fp32_tok_s']} tok/s, "
        f"bf16 {out['bf16_tok_s']} tok/s (bf16/fp32 {out['bf16_vs_fp32']}); native bf16: "
        f"{out['native_bf16']}; auto picks {out['auto_picks']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


# `dflash-trainer bench` (src/dflash_trainer/bench_harness.py) runs this script with these
# arguments (full run, --bench.quick) and turns its summary into rows with bench_rows.
BENCH_ARGS = {"full": [], "quick": ["--repeats", "2"]}


def bench_rows(s: dict) -> list[dict]:
    """This script's JSON summary as rows of the `dflash-trainer bench` table."""
    return [
        bench_harness.row(
            "tapped target forward (4 x 512), embedded target",
            "bf16",
            "fp32",
            s["bf16_vs_fp32"],
            note=f"{s['bf16_tok_s']} vs {s['fp32_tok_s']} tok/s; native bf16 "
            f"{s['native_bf16']}: dtype=auto picks {s['auto_picks']}",
        )
    ]


if __name__ == "__main__":
    main()
