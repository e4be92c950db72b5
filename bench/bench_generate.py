"""Data generation speed: the embedded target answering embedded prompts, three ways, this CPU.

  one at a time   decode_batch on one prompt per call (no padding, no batching)
  HF generate     transformers' generate on left-padded batches (what `generate` used before):
                  every row stays in the batch until the longest one ends
  ours            decode_batch (data/generate.py): the same left-padded prefill, then rows
                  leave the batch as they end, so their compute is not spent on padding
  ours, cat cache the same as ours with transformers' DynamicCache, which grows by concatenation
                  (every step rereads and rewrites the whole cache) instead of ours
                  (models/kv_cache.py), which writes each step's keys into preallocated buffers
  ours packed     the same, inside `TargetModel.decoding` (target.packed_linear): what `generate`
                  runs on a float32 CPU target, here the lean forward over stacked, prepacked
                  weights (models/lean_forward.py); the packing itself (once per call) is inside
                  the timed span

Greedy, fp32, the same prompts (a seeded sample of the embedded set, mixed lengths) and
max_new_tokens for all three; tokens counted up to and including the stop id. Prints tokens/s of
each and the ratios, measured in one run. Outputs are compared: greedy answers must agree
(rare argmax ties between batched and unbatched float math aside, which are counted).

With --sweep 64,128 ours also runs at those batch sizes (tokens/s and the ratio to --batch-size):
on a CPU a decode step of a small target costs about the same for 8 rows as for 32 (weights
read, Python per layer), so bigger batches mean fewer steps.

Run: .venv/bin/python bench/bench_generate.py [--prompts 32] [--max-new-tokens 96]
     [--batch-size 32] [--sweep 64,128] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from dflash_trainer import bench_harness
from dflash_trainer.config_io import load_config
from dflash_trainer.data import embedded
from dflash_trainer.data.chat import Rendering, prompt_messages
from dflash_trainer.data.generate import decode_batch
from dflash_trainer.decode import loop
from dflash_trainer.models.target import TargetModel
from dflash_trainer.precision import cpu_kind


def _hf_generate(target, rows, max_new, pad_id):
    from transformers import GenerationConfig

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    cfg = GenerationConfig(
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=list(target.eos_token_ids),
        pad_token_id=pad_id,
    )
    with torch.no_grad():
        out = target.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    res = []
    for row in out[:, width:].tolist():
        toks = []
        for t in row:
            if t in target.eos_token_ids:
                res.append((toks, True))
                break
            toks.append(t)
        else:
            res.append((toks, False))
    return res


def _greedy(target, rows, n, pad):
    """decode_batch greedily (the target's eos ids stop a row)."""
    return decode_batch(target, rows, n, None, [0] * len(rows), pad)  # None: greedy


def _with_cat_cache(fn, model, *args):
    """fn with transformers' own DynamicCache in place of models/kv_cache.py's."""
    from transformers import DynamicCache

    saved = loop.new_kv_cache
    loop.new_kv_cache = lambda m: DynamicCache(config=m.config)
    try:
        return fn(model, *args)
    finally:
        loop.new_kv_cache = saved


def _count(results) -> int:
    return sum(len(t) + int(stopped) for t, stopped in results)


def _arithmetic_bound(target, rows: list[list[int]], new_tokens: int) -> dict:
    """The tokens/s generation would reach if its matmuls ran at this machine's measured fp32
    matmul rate and nothing else cost time: every prompt and new token through the decoder
    layers' weights, every new token through the LM head (attention and padding left out, so the
    bound is generous)."""
    layers = sum(p.numel() for p in target.layers.parameters() if p.dim() == 2)
    head = target.lm_head.weight.numel()
    flops = 2 * layers * (sum(map(len, rows)) + new_tokens) + 2 * head * new_tokens
    gflops = bench_harness.matmul_gflops(torch.float32)
    return {"gflops": gflops, "tok_s": new_tokens / (flops / (gflops * 1e9))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--sweep", default="", help="more batch sizes for ours, e.g. 64,128")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    cfg = load_config(preset="smollm2-cpu", overrides=["--target.dtype=float32"])
    target = TargetModel.load(cfg.target, "cpu")
    tok = target.tokenizer
    prompts = embedded.embedded_prompts()
    random.Random(0).shuffle(prompts)
    rendering = Rendering.from_config(cfg)
    rows = [rendering.prompt_ids(tok, prompt_messages(p.messages)) for p in prompts[: args.prompts]]
    rows.sort(key=len)  # as generate_responses batches them
    pad = tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0]
    n, bsz = args.max_new_tokens, args.batch_size
    _greedy(target, rows[:2], 4, pad)  # warm-up
    runs = {}
    t0 = time.perf_counter()
    runs["one_at_a_time"] = [_greedy(target, [r], n, pad)[0] for r in rows]
    times = {"one_at_a_time": time.perf_counter() - t0}
    for name, fn in (
        ("hf_generate", lambda b: _hf_generate(target, b, n, pad)),
        ("ours", lambda b: _greedy(target, b, n, pad)),
        ("ours_cat_cache", lambda b: _with_cat_cache(_greedy, target, b, n, pad)),
        ("ours_packed", lambda b: _greedy(target, b, n, pad)),
    ):
        t0 = time.perf_counter()
        with target.decoding(packed=name == "ours_packed"):
            runs[name] = [r for i in range(0, len(rows), bsz) for r in fn(rows[i : i + bsz])]
        times[name] = time.perf_counter() - t0
    for b in [int(x) for x in args.sweep.split(",") if x]:
        t0 = time.perf_counter()
        runs[f"ours_batch{b}"] = [
            r for i in range(0, len(rows), b) for r in _greedy(target, rows[i : i + b], n, pad)
        ]
        times[f"ours_batch{b}"] = time.perf_counter() - t0
    rate = {k: _count(runs["one_at_a_time"]) / v for k, v in times.items()}
    bound = _arithmetic_bound(target, rows, _count(runs["one_at_a_time"]))
    differ = {
        k: sum(a != b for a, b in zip(runs["one_at_a_time"], v))
        for k, v in runs.items()
        if k != "one_at_a_time"
    }
    out = {
        "cpu": cpu_kind(),
        "prompts": len(rows),
        "max_new_tokens": n,
        "batch_size": bsz,
        "new_tokens": _count(runs["one_at_a_time"]),
        "tok_s": {k: round(v, 1) for k, v in rate.items()},
        "ours_vs_one_at_a_time": round(rate["ours"] / rate["one_at_a_time"], 3),
        "ours_vs_hf_generate": round(rate["ours"] / rate["hf_generate"], 3),
        "packed_vs_ours": round(rate["ours_packed"] / rate["ours"], 3),
        "ours_vs_cat_cache": round(rate["ours"] / rate["ours_cat_cache"], 3),
        "answers_differing_from_one_at_a_time": differ,
        "gflops": round(bound["gflops"], 1),
        "bound_tok_s": round(bound["tok_s"], 1),
        "ours_vs_bound": round(rate["ours"] / bound["tok_s"], 3),
        "sweep_vs_ours": {
            k: round(v / rate["ours"], 3) for k, v in rate.items() if k.startswith("ours_batch")
        },
    }
    print(
        f"generation, {len(rows)} prompts x <= {n} tokens, batch {bsz}: "
        + ", ".join(f"{k} {v} tok/s" for k, v in out["tok_s"].items())
        + f"; ours/one-at-a-time {out['ours_vs_one_at_a_time']}, ours/HF generate "
        f"{out['ours_vs_hf_generate']}, packed/ours {out['packed_vs_ours']}, "
        f"ours/cat cache {out['ours_vs_cat_cache']}; arithmetic bound {out['bound_tok_s']} "
        f"tok/s ({out['gflops']} GFLOP/s measured), ours at {out['ours_vs_bound']} of it; "
        f"answers differing: {differ}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


# `dflash-trainer bench` (src/dflash_trainer/bench_harness.py) runs this script with these
# arguments (full run, --bench.quick) and turns its summary into rows with bench_rows.
BENCH_ARGS = {
    "full": ["--prompts", "16", "--max-new-tokens", "48"],
    "quick": ["--prompts", "8", "--max-new-tokens", "32"],
}


def bench_rows(s: dict) -> list[dict]:
    """This script's JSON summary as rows of the `dflash-trainer bench` table."""
    note = (
        f"{s['tok_s']['ours']} vs {s['tok_s']['hf_generate']} (HF generate) vs "
        f"{s['tok_s']['one_at_a_time']} (one at a time) tok/s; {s['prompts']} prompts x <= "
        f"{s['max_new_tokens']} tokens, batch {s['batch_size']}"
    )
    out = (
        [
            bench_harness.row(
                "answer generation, embedded target",
                f"ours (batch {s['batch_size']})",
                "the arithmetic bound (measured fp32 matmul rate)",
                s["ours_vs_bound"],
                note=f"{s['tok_s']['ours']} of {s['bound_tok_s']} tok/s at {s['gflops']} GFLOP/s",
            )
        ]
        if "ours_vs_bound" in s
        else []
    )
    out += [
        bench_harness.row(
            "answer generation, embedded target",
            "ours",
            "one at a time",
            s["ours_vs_one_at_a_time"],
            note=note,
        ),
        bench_harness.row(
            "answer generation, embedded target",
            "ours",
            "HF generate",
            s["ours_vs_hf_generate"],
            note=note,
        ),
        bench_harness.row(
            "answer generation, embedded target",
            "ours, TargetModel.decoding (the decode loops' CPU fp32 path: lean forward, packed)",
            "ours, default kernels",
            s["packed_vs_ours"],
            note=f"{s['tok_s']['ours_packed']} vs {s['tok_s']['ours']} tok/s, packing included",
        ),
    ]
    if "ours_vs_cat_cache" in s:  # older results lack it
        out.append(
            bench_harness.row(
                "answer generation, embedded target",
                "ours, KV cache written in place",
                "ours, transformers' DynamicCache (grows by cat)",
                s["ours_vs_cat_cache"],
                note=f"{s['tok_s']['ours']} vs {s['tok_s']['ours_cat_cache']} tok/s",
            )
        )
    return out


if __name__ == "__main__":
    main()
