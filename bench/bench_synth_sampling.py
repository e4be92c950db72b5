"""How prompt synthesis samples on vLLM's CPU build: top-p against top-k, this CPU.

The `synth` data source (data/synthesize.py) samples user turns from the embedded target's chat
template. vLLM's CPU build pays for top-p with a sort of the whole 49,152-way vocabulary per
row and step; top-k (and plain temperature sampling) avoid it. This script samples the same
turns with the product's sampling call (data/synthesize.sample_turns on vLLM: one request per
setting, its decode seconds without the engine's start) under each setting and prints
tokens/s, the turns cut at the length limit, and each setting's speed relative to top-p 0.95
(the synth default before top-k), measured in one run. (Greedy has no place here: vLLM
refuses n > 1 samples of one greedy prompt, and they would all be the same.)

Needs vLLM (`make vllm`, DFLASH_VLLM_PYTHON). Run:
  .venv/bin/python bench/bench_synth_sampling.py [--turns 512] [--max-tokens 96] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from dflash_trainer.config import SamplingConfig
from dflash_trainer.config_io import load_config
from dflash_trainer.data.chat import Rendering
from dflash_trainer.data.generate import choose_engine
from dflash_trainer.data.synthesize import pre_query_ids, sample_turns
from dflash_trainer.models.target import TargetModel
from dflash_trainer.precision import cpu_kind

# (label, temperature, top_p, top_k)
SETTINGS = [
    ("top-p 0.95", 1.0, 0.95, 0),
    ("top-k 50", 1.0, 1.0, 50),
    ("temperature only", 1.0, 1.0, 0),
]


class _DecodeSeconds:
    """The engine with its last request's decode seconds kept (`run_s`: without the start),
    which sample_turns does not return."""

    def __init__(self, engine):
        self.engine, self.run_s = engine, 0.0

    def run(self, *args, **kwargs) -> dict:
        res = self.engine.run(*args, **kwargs)
        self.run_s = res["run_s"]
        return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--turns", type=int, default=512, help="user turns sampled per setting")
    ap.add_argument("--max-tokens", type=int, default=96, help="length limit of a turn (tokens)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    cfg = load_config(preset="smollm2-quality")
    target = TargetModel.load(cfg.target, cfg.pipeline.target_devices[0])
    _, engine = choose_engine(cfg, "vllm", args.turns * args.max_tokens)
    vllm = _DecodeSeconds(engine)
    row = pre_query_ids(target.tokenizer, Rendering.from_config(cfg), "", "")
    out: dict = {"cpu": cpu_kind(), "turns": args.turns, "max_tokens": args.max_tokens}
    for label, temperature, top_p, top_k in SETTINGS:
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
        s = replace(cfg.synth, sampling=sampling, max_tokens=args.max_tokens)
        (turns,) = sample_turns(target, [row], args.turns, s, "vllm", vllm, seed=0)
        tokens = sum(len(t) + ended for t, ended in turns)  # a turn's stop token is decoded too
        cut = sum(not ended for _, ended in turns)
        out[label] = {"tokens": tokens, "cut": cut, "decode_s": round(vllm.run_s, 1)}
        out[label]["tok_s"] = round(tokens / vllm.run_s, 1)
    base = out["top-p 0.95"]["tok_s"]
    for label, *_ in SETTINGS:
        r = out[label]
        r["vs_top_p"] = round(r["tok_s"] / base, 2)
        print(
            f"{label:17s} {r['tokens']:6d} tokens in {r['decode_s']:6.1f} s = {r['tok_s']:6.1f} "
            f"tok/s ({r['vs_top_p']}x top-p 0.95), {r['cut']} of {args.turns} cut"
        )
    print(f"CPU: {out['cpu']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
