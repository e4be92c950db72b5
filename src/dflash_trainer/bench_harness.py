"""`dflash-trainer bench` / `make bench`: every benchmark under bench/, one table.

Each bench script prints a JSON summary as its last stdout line; an adapter here turns it into rows
of (work, compared, ratio, min, max, note). Ratios are always measured side by side in one run of
one script (this machine is shared and noisy); absolute figures are context only.
Writes `bench/out/results.md` and `bench/out/results.json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from dflash_trainer.errors import UserError
from dflash_trainer.models.precision import cpu_kind


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


def _row(work, a, b, ratio, lo=None, hi=None, note=""):
    return {
        "work": work,
        "compared": f"{a} vs {b}",
        "ratio": ratio,
        "min": ratio if lo is None else lo,
        "max": ratio if hi is None else hi,
        "note": note,
    }


def rows_batching(s):
    out = []
    for budget in sorted({k.split("@")[1] for k in s if "@" in k}, key=int):
        ours = s[f"ours@{budget}"]
        for base in ("random_bs8", "random_bs1"):
            b = s[f"{base}@{budget}"]
            out.append(
                _row(
                    f"padding efficiency, max_tokens {budget}",
                    "ours",
                    base,
                    ours["padding_eff"] / b["padding_eff"],
                    note=f"ours {ours['padding_eff']:.3f}, {base} {b['padding_eff']:.3f}",
                )
            )
            out.append(
                _row(
                    f"bucket entropy (window 64), max_tokens {budget}",
                    "ours",
                    base,
                    ours["bucket_entropy"] / b["bucket_entropy"],
                    note=f"ours {ours['bucket_entropy']:.3f}, {base} {b['bucket_entropy']:.3f}",
                )
            )
    return out


def rows_attention(s):
    return [
        _row(
            "drafter train step (fwd+bwd), time",
            "split",
            "dense",
            s["speedup_split_vs_dense"],
            note="speedup of split over dense",
        ),
        _row(
            "drafter train step, peak step memory",
            "dense",
            "split",
            s["step_mem_ratio_dense_over_split"],
            note="dense / split",
        ),
    ]


def rows_taps(s):
    return [
        _row(
            "target forward, forward memory",
            "output_hidden_states",
            "tapped hooks",
            s["fwd_mem_ratio_hs_over_tapped"],
            note="how much more the HF way needs",
        ),
        _row(
            "target forward, time",
            "tapped hooks",
            "output_hidden_states",
            s["speedup_tapped_vs_hs"],
            note="speedup",
        ),
    ]


def rows_pipeline(s):
    out = []
    steady, whole = "training throughput (steady tokens/s)", "training throughput (tokens/s)"
    for key, work, a, b in (
        ("pipelined_vs_fixed_split", steady, "shared cores", "fixed 50/50 split"),
        ("drafter_bound_shared_vs_fixed", steady, "shared cores, drafter-bound", "fixed split"),
        ("pipelined_vs_sequential", steady, "pipelined", "sequential"),
        (
            "pipelined_vs_sequential_fill_and_drain_in",
            whole,
            "pipelined, fill and drain in",
            "sequential",
        ),
        ("pipelined_vs_colocated", steady, "pipelined", "plain colocated loop"),
        ("observability_on_vs_off", steady, "observability on", "off"),
    ):
        v = s.get(key)
        if v is not None:  # results of an older bench_pipeline lack the newer rows
            out.append(_row(work, a, b, v["median"], v["min"], v["max"]))
    if "process_cpu_over_wall" in s:
        out.append(
            _row(
                "training, pipelined",
                "process CPU time",
                "wall time",
                s["process_cpu_over_wall"],
                note="cores kept busy",
            )
        )
    out.append(
        _row(
            "training throughput",
            "pipelined",
            "bound of isolated stages",
            s["pipelined_vs_stage_bound"],
            note=f"target alone {s['isolated_target_tok_s']:.0f} tok/s, drafter alone "
            f"{s['isolated_drafter_tok_s']:.0f} tok/s",
        )
    )
    sb = s.get("schedule_bound")
    if sb is not None:  # older results lack it
        out.append(
            _row(
                "training throughput, stages alone",
                "balanced pipeline",
                "sequential",
                sb["bound"],
                note="the most any pipeline can gain over sequential on these cores: "
                f"{sb['balanced_pipeline_tok_s']:.0f} vs {sb['sequential_tok_s']:.0f} tok/s",
            )
        )
    return out


def rows_decode(s):
    kernels = f"; ours on {s.get('kernels', 'default')} linear kernels"
    out = [
        _row(
            "draft-verify decode (tokens/s)",
            "ours",
            "reference dflash_generate",
            s["spec_vs_reference"],
            note=f"identical tokens {s['identical_spec']}{kernels}",
        ),
        _row(
            "greedy decode (tokens/s)",
            "ours",
            "HF generate",
            s["ar_vs_hf_generate"],
            note=f"identical tokens {s['identical_ar']}{kernels}",
        ),
        _row(
            "draft-verify cycle",
            "cycle",
            "greedy step",
            s["cycle_over_greedy_step"],
            note=f"{s['cycle_ms']:.0f} ms = drafter {s['cycle_draft_ms']:.0f} + verify "
            f"{s['cycle_verify_ms']:.0f} + rest",
        ),
    ]
    for how, v in s["speedup_at_oracle"].items():
        out.append(
            _row(
                f"speedup at {v['tokens_per_cycle']:.2f} tokens per cycle",
                f"{how} verify",
                "greedy",
                v["speedup"],
                note=f"cycle {v['cycle_ms']:.0f} ms, greedy step {v['greedy_step_ms']:.0f} ms",
            )
        )
    return out


def rows_flops(s):
    return [
        _row(
            f"{k} achieved FLOP/s",
            k,
            f"measured {v['dtype']} matmul peak",
            v["achieved_tflops"] / v["peak_tflops"],
            note=f"{v['achieved_tflops'] * 1e3:.1f} of {v['peak_tflops'] * 1e3:.1f} GFLOP/s",
        )
        for k, v in s["stages"].items()
    ]


def rows_checkpoint(s):
    return [
        _row(
            "training stall per checkpoint",
            "synchronous write",
            "background write",
            s["stall_ratio_sync_over_async"],
            note=f"{s['bytes_gb']:.2f} GB: {s['sync_stall_s']:.2f} s vs "
            f"{s['async_stall_s']:.2f} s blocked",
        )
    ]


def rows_dtype(s):
    return [
        _row(
            "tapped target forward (4 x 512), embedded target",
            "bf16",
            "fp32",
            s["bf16_vs_fp32"],
            note=f"{s['bf16_tok_s']} vs {s['fp32_tok_s']} tok/s; native bf16 "
            f"{s['native_bf16']}: dtype=auto picks {s['auto_picks']}",
        )
    ]


def rows_generate(s):
    note = (
        f"{s['tok_s']['ours']} vs {s['tok_s']['hf_generate']} (HF generate) vs "
        f"{s['tok_s']['one_at_a_time']} (one at a time) tok/s; {s['prompts']} prompts x <= "
        f"{s['max_new_tokens']} tokens, batch {s['batch_size']}"
    )
    out = [
        _row(
            "answer generation, embedded target",
            "ours",
            "one at a time",
            s["ours_vs_one_at_a_time"],
            note=note,
        ),
        _row(
            "answer generation, embedded target",
            "ours",
            "HF generate",
            s["ours_vs_hf_generate"],
            note=note,
        ),
        _row(
            "answer generation, embedded target",
            "ours, packed linears (the decode loops' CPU fp32 path)",
            "ours, default kernels",
            s["packed_vs_ours"],
            note=f"{s['tok_s']['ours_packed']} vs {s['tok_s']['ours']} tok/s, packing included",
        ),
    ]
    if "ours_vs_cat_cache" in s:  # older results lack it
        out.append(
            _row(
                "answer generation, embedded target",
                "ours, KV cache written in place",
                "ours, transformers' DynamicCache (grows by cat)",
                s["ours_vs_cat_cache"],
                note=f"{s['tok_s']['ours']} vs {s['tok_s']['ours_cat_cache']} tok/s",
            )
        )
    return out


def rows_kd(s):
    shape = f"{s['rows']} x {s['seq']}, {s['anchors']} anchors/row"
    return [
        _row(
            f"target stage, logit distillation ({shape})",
            "KD",
            "CE",
            s["target_kd_vs_ce"],
            note=f"{s['target_tok_s']['kd']} vs {s['target_tok_s']['ce']} tok/s",
        ),
        _row(
            f"drafter step, logit distillation ({shape})",
            "KD",
            "CE",
            s["drafter_kd_vs_ce"],
            note=f"{s['drafter_tok_s']['kd']} vs {s['drafter_tok_s']['ce']} tok/s",
        ),
    ]


# Full-run arguments of scripts whose own defaults size a longer study (bench/RESULTS.md): the
# bench keeps within about 20 minutes on 2 cores.
SIZED = {"bench_generate.py": ["--prompts", "16", "--max-new-tokens", "48"]}

ADAPTERS = {
    "bench_batching.py": (rows_batching, []),
    "bench_attention.py": (rows_attention, ["--quick"]),
    "bench_taps.py": (rows_taps, ["--quick"]),
    "bench_flops.py": (rows_flops, []),
    "bench_pipeline.py": (rows_pipeline, []),
    "bench_checkpoint.py": (rows_checkpoint, ["--params-m", "25"]),
    "bench_dtype.py": (rows_dtype, ["--repeats", "2"]),
    "bench_kd.py": (rows_kd, ["--repeats", "1", "--seq", "256"]),
    "bench_generate.py": (rows_generate, ["--prompts", "8", "--max-new-tokens", "32"]),
    "bench_decode.py": (rows_decode, []),
}


def machine() -> str:
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu_kind()}, {os.cpu_count()} CPU threads, {dev}, torch {torch.__version__}"


def run_all(bdir: Path, quick: bool = False, only: list[str] | None = None) -> list[dict]:
    rows: list[dict] = []
    for script, (adapter, quick_args) in ADAPTERS.items():
        if only and script not in only:
            continue
        path = bdir / script
        if not path.is_file():
            print(f"bench: {script} missing, skipped", file=sys.stderr)
            continue
        cmd = [sys.executable, str(path)] + (quick_args if quick else SIZED.get(script, []))
        if quick and script == "bench_pipeline.py":
            cmd.append("--quick")
        print(f"bench: running {script} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True)
        took = time.monotonic() - t0
        if p.returncode:
            print(f"bench: {script} failed ({p.returncode}):\n{p.stderr[-2000:]}", file=sys.stderr)
            row = _row(script, "-", "-", float("nan"), note=f"FAILED rc={p.returncode}")
            row["script"], row["seconds"] = script, round(took, 1)  # `--only` replaces it
            rows.append(row)
            continue
        summary = json.loads(p.stdout.strip().splitlines()[-1])
        for r in adapter(summary):
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
