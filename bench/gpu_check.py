"""GPU check sized for one H200 (< 8 minutes, no downloads).

Random-initialised target of Qwen3-8B's shape, 5-layer drafter of its size (dflash-method.md §1.1),
synthetic token data of realistic lengths. Measures, in one run:
  - target forward tokens/s and MFU (tapped forward, bf16)
  - drafter step tokens/s and MFU (bf16 autocast, FlexAttention when available)
  - pipelined (target and drafter on two streams of one GPU) vs sequential schedule
  - zero-sync check: the pipelined run under torch.cuda.set_sync_debug_mode("warn"), counting
    warnings raised from worker threads (must be 0)
  - memory peaks
Prints one table last and writes bench/out/gpu_check.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_pipeline import synthetic_dataset  # noqa: E402
from dflash_trainer.config import load_config  # noqa: E402
from dflash_trainer.models.target import TargetModel, tap_layer_ids  # noqa: E402
from dflash_trainer.observe.flops import peak_tflops  # noqa: E402
from dflash_trainer.run import train  # noqa: E402


def qwen3_8b_target(layers: int = 36) -> TargetModel:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1e6,
        tie_word_embeddings=False,
    )
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return TargetModel.from_hf(model, None, tap_layer_ids(layers, 5), name="random-Qwen3-8B")


def cfg_for(run_dir, schedule, steps):
    return load_config(
        "qwen3-8b",
        None,
        [
            f"--run_dir={run_dir}",
            "--pipeline.target_devices=cuda:0",
            "--pipeline.drafter_device=cuda:0",
            f"--pipeline.schedule={schedule}",
            f"--optim.max_steps={steps}",
            "--optim.epochs=100",
            "--metrics.wandb=off",
            "--metrics.tensorboard=false",
            "--metrics.console=false",
            "--data.max_length=3072",
            "--batching.max_tokens=16384",
            "--checkpoint.keep_last=1",
            "--drafter.num_anchors=512",
        ],
    )


def run(target, ds, schedule, steps, sync_check=False):
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
    torch.cuda.reset_peak_memory_stats()
    try:
        with tempfile.TemporaryDirectory() as d:
            r = train(cfg_for(d, schedule, steps), target=target, train_set=ds)
    finally:
        if sync_check:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = orig
    return r, hits, torch.cuda.max_memory_allocated() / 2**30


def main():
    assert torch.cuda.is_available(), "gpu_check needs CUDA"
    t_all = time.time()
    target = qwen3_8b_target()
    ds = synthetic_dataset(3000, target.vocab_size)
    ds_lengths = np.asarray(ds.lengths)
    peak = peak_tflops(torch.device("cuda:0"))
    # warm-up (compile flex attention, cuBLAS heuristics)
    run(target, ds, "pipelined", 3)
    res = {}
    for sched in ("sequential", "pipelined"):
        r, _, mem = run(target, ds, sched, 20)
        res[sched] = {
            "tok_s": r.tokens / r.wall_s,
            "steps": r.steps,
            "wall_s": r.wall_s,
            "peak_mem_gib": mem,
            "metrics": {k: v for k, v in r.metrics.items() if k.startswith(("tput/", "mem/"))},
        }
    r, hits, mem = run(target, ds, "pipelined", 8, sync_check=True)
    m = res["pipelined"]["metrics"]
    table = [
        ("target tokens/s (pipelined)", m.get("tput/target_tok_s", float("nan"))),
        ("target MFU % (pipelined)", m.get("tput/mfu_target", float("nan"))),
        ("drafter tokens/s (pipelined)", m.get("tput/drafter_tok_s", float("nan"))),
        ("drafter MFU % (pipelined)", m.get("tput/mfu_drafter", float("nan"))),
        ("pipelined tokens/s", res["pipelined"]["tok_s"]),
        ("sequential tokens/s", res["sequential"]["tok_s"]),
        ("pipelined / sequential", res["pipelined"]["tok_s"] / res["sequential"]["tok_s"]),
        ("sync warnings from worker threads", len(hits)),
        ("peak memory GiB (pipelined)", res["pipelined"]["peak_mem_gib"]),
        ("peak memory GiB (sequential)", res["sequential"]["peak_mem_gib"]),
        ("mean sequence length", float(ds_lengths.mean())),
        ("device peak TFLOP/s used for MFU", peak),
        ("wall time of this check (s)", time.time() - t_all),
    ]
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    payload = {
        "device": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d"),
        "results": res,
        "sync_hits": hits[:20],
        "table": table,
    }
    (out / "gpu_check.json").write_text(json.dumps(payload, indent=2, default=str))
    print(f"\n## gpu_check {payload['date']} on {payload['device']}\n")
    print("| metric | value |\n|---|---|")
    for k, v in table:
        print(f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |")


if __name__ == "__main__":
    main()
