"""Decode loops against their references, and where a draft-verify cycle's time goes, this CPU.

  draft-verify  ours (decode/loop.py `decode`) vs the published reference loop
                (`dflash_generate` of the `dflash` package) on the same exported drafter
  plain greedy  ours (`decode`, the same loop with block 1) vs transformers' `generate`

Kernels: ours run as the product decodes on CPU (target.packed_linear, `TargetModel.decoding`):
the target's forward as one lean pass over stacked, prepacked weights (models/lean_forward.py),
the drafter's linear layers on oneDNN's prepacked GEMM (models/packed_linear.py); --kernels=default
for transformers' forward on PyTorch's kernels. The references run on a copy of the target with
PyTorch's default kernels, as they ship.

Same prompts (held-out-style MT-Bench and HumanEval user turns, rendered by the target's chat
template), same max_new_tokens, stop ids and threads, fp32 (the CPU eval default): tokens/s of
each (wall time of the whole call, prefill included, so both sides pay the same), the ratios, and
whether the tokens are identical. The runs alternate per prompt so machine drift hits both.

The cycle profile splits our draft-verify time into the drafter pass (+ its argmax), the target's
verify pass (+ acceptance and cache crop) and the rest, against one plain greedy step. A cycle
costs about the same whatever is accepted (the block is always verified whole), so
`projected speedup at k tokens per cycle = k x (greedy step) / (cycle)`: what a drafter that
commits k tokens per cycle would give here. The drafter is the preset's, initialised from the
target and untrained (acceptance ~1), unless --drafter names an export.

At a controlled acceptance: the same real drafter pass runs every cycle, then its first
--oracle-drafts drafts are replaced by the target's own greedy tokens and the rest by wrong ones,
so every cycle commits exactly oracle-drafts + 1 tokens: the measured speedup at 3 tokens per
cycle (the default), for both verify policies (eval.verify: full = the published loop's whole
block; adaptive = as many drafts as the drafter reached lately).

Run: .venv/bin/python bench/bench_decode.py [--prompts 4] [--max-new-tokens 64]
     [--drafter DIR] [--oracle-drafts 2] [--kernels packed|default] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dflash_trainer import bench_harness
from dflash_trainer.config_io import load_config
from dflash_trainer.data import embedded
from dflash_trainer.data.chat import Rendering
from dflash_trainer.decode import loop as decode_loop
from dflash_trainer.models.export import export_drafter, load_drafter
from dflash_trainer.models.target import TargetModel
from dflash_trainer.precision import cpu_kind
from dflash_trainer.run.build import build_drafter


def _prompts(tokenizer, n: int) -> list[list[int]]:
    """n prompts, alternating MT-Bench and HumanEval (first user turn)."""
    mt, he = embedded.mtbench_prompts(), embedded.humaneval_prompts()
    convs = [c for pair in zip(mt, he) for c in pair][:n]
    return [Rendering().prompt_ids(tokenizer, c.messages[:1]) for c in convs]


def _hf_greedy(model, ids, max_new, stop):
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=stop,
        pad_token_id=stop[0],
    )
    toks = out[0, ids.shape[1] :].tolist()
    for i, t in enumerate(toks):
        if t in stop:
            return toks[: i + 1]
    return toks


def _oracle(greedy: list[int], prompt_len: int, right: int):
    """A `draft_block` (decode/draft.py) that pays for the real drafter pass, then drafts `right`
    correct tokens (the target's greedy continuation) and wrong ones after them."""
    real = decode_loop.draft_block

    def draft(drafter, embed_weight, lm_head, last, start, ctx, dcache, q, k):
        block = real(drafter, embed_weight, lm_head, last, start, ctx, dcache, q, k)
        for i in range(1, block.shape[1]):
            j = start + i - prompt_len
            true = greedy[j] if j < len(greedy) else 0
            block[0, i] = true if i <= right else (true + 1) % embed_weight.shape[0]
        return block

    return draft


def _timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def _args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafter", default="", help="an exported drafter (default: untrained)")
    ap.add_argument("--oracle-drafts", type=int, default=2)
    ap.add_argument(
        "--kernels",
        choices=("packed", "default"),
        default="packed",
        help="our loops' kernels: packed = TargetModel.decoding's, as the product decodes "
        "(the references always run PyTorch's default)",
    )
    ap.add_argument("--json", default="")
    return ap.parse_args()


def _rig(args, ref, tmp: str) -> SimpleNamespace:
    """The target, our drafter and the reference's copy of it (the same export), the prompts,
    and `spec(x, verify)`: our draft-verify loop on one prompt."""
    cfg = load_config("smollm2-cpu", None, ["--target.dtype=float32"])
    torch.set_num_threads(cfg.pipeline.cpu_threads or torch.get_num_threads())
    target = TargetModel.load(cfg.target, "cpu")
    if args.drafter:
        drafter, export = load_drafter(args.drafter, device="cpu"), args.drafter
    else:
        drafter = build_drafter(cfg, target, "cpu").float()
        export = str(export_drafter(drafter, Path(tmp) / "drafter", torch.float32))
    drafter.eval()
    r = SimpleNamespace(target=target, drafter=drafter, model=target.model, n=args.max_new_tokens)
    r.ref_drafter = ref.DFlashDraftModel.from_pretrained(export, dtype=torch.float32).eval()
    r.block, r.stop = drafter.config.block_size, list(target.eos_token_ids)
    # the references' own copy, never packed: they run as they ship
    r.base = copy.deepcopy(r.model) if args.kernels == "packed" else r.model
    r.prompts = _prompts(target.tokenizer, args.prompts)

    def spec(x, verify="full"):
        return decode_loop.decode(
            r.target, x.tolist(), r.n, stop_ids=r.stop, drafter=r.drafter, block_size=r.block,
            verify=verify,
        )[0]  # fmt: skip

    def greedy(x):
        return decode_loop.decode(r.target, x.tolist(), r.n, stop_ids=r.stop)[0]

    r.spec, r.greedy = spec, greedy
    return r


def _against_references(r: SimpleNamespace, ref) -> SimpleNamespace:
    """Ours vs the reference loop and vs HF generate, alternating which runs first per prompt:
    seconds and tokens per side, identical outputs, our cycle profile."""
    m = SimpleNamespace(t={k: [] for k in ("spec", "ref", "ar", "hf")}, same={"spec": 0, "ar": 0})
    m.tokens = {k: 0 for k in m.t}
    m.cycles = m.draft_s = m.verify_s = 0.0
    m.committed = 0
    m.read_gb_s = []  # measured before each prompt's runs: this host's bandwidth drifts
    for i, p in enumerate(r.prompts):
        x = torch.tensor([p])
        m.read_gb_s.append(bench_harness.memory_read_gb_s(reps=3))
        # alternate which side runs first
        order = ("spec", "ref", "ar", "hf") if i % 2 == 0 else ("ref", "spec", "hf", "ar")
        out = {}
        for k in order:
            if k == "spec":
                res, s = _timed(r.spec, x)
                out[k] = res.tokens
                m.cycles += len(res.acceptance_lengths)
                m.committed += sum(res.acceptance_lengths)
                m.draft_s += res.draft_time
                m.verify_s += res.verify_time
            elif k == "ref":
                res, s = _timed(
                    ref.dflash_generate, r.ref_drafter, r.base, x, r.n, r.stop,
                    block_size=r.block, return_stats=True,
                )  # fmt: skip
                out[k] = res.output_ids[0, x.shape[1] :].tolist()
            elif k == "ar":
                res, s = _timed(r.greedy, x)
                out[k] = res.tokens
            else:
                out[k], s = _timed(_hf_greedy, r.base, x, r.n, r.stop)
            m.t[k].append(s)
            m.tokens[k] += len(out[k])
        m.same["spec"] += out["spec"] == out["ref"][: len(out["spec"])]
        m.same["ar"] += out["ar"] == out["hf"]
        print(f"prompt {i}: " + ", ".join(f"{k} {len(out[k])} tok" for k in order))
    return m


def _at_oracle(r: SimpleNamespace, drafts: int) -> dict:
    """Controlled acceptance: `drafts` + 1 tokens per cycle, full vs adaptive verify, each
    against plain greedy timed again beside it."""
    # per policy: seconds, tokens, cycles, drafter seconds, verify seconds
    oracle = {"full": [0.0, 0, 0, 0.0, 0.0], "adaptive": [0.0, 0, 0, 0.0, 0.0]}
    greedy_s, greedy_n = 0.0, 0
    for i, p in enumerate(r.prompts):
        x = torch.tensor([p])
        g, s_ar = _timed(r.greedy, x)
        greedy_s, greedy_n = greedy_s + s_ar, greedy_n + len(g.tokens)
        saved = decode_loop.draft_block
        decode_loop.draft_block = _oracle(g.tokens, x.shape[1], drafts)
        try:
            for how in ("full", "adaptive") if i % 2 == 0 else ("adaptive", "full"):
                res, s_spec = _timed(r.spec, x, how)
                assert res.tokens == g.tokens, "oracle run not lossless"
                for j, v in enumerate(
                    (s_spec, len(res.tokens), len(res.block_sizes), res.draft_time, res.verify_time)
                ):
                    oracle[how][j] += v
        finally:
            decode_loop.draft_block = saved
    return {
        how: {
            "tokens_per_cycle": o[1] / o[2],
            "speedup": (o[1] / o[0]) / (greedy_n / greedy_s),
            "cycle_ms": 1e3 * o[0] / o[2],
            "draft_ms": 1e3 * o[3] / o[2],
            "verify_ms": 1e3 * o[4] / o[2],
            "greedy_step_ms": 1e3 * greedy_s / greedy_n,
        }
        for how, o in oracle.items()
    }


def _result(args, r: SimpleNamespace, m: SimpleNamespace, at_k: dict) -> dict:
    rate = {k: m.tokens[k] / sum(v) for k, v in m.t.items()}
    ar_step = sum(m.t["ar"]) / m.tokens["ar"]
    cycle = sum(m.t["spec"]) / m.cycles  # prefill included: conservative
    bw = statistics.median(m.read_gb_s)
    target_gb = _weight_bytes(r.model) / 1e9
    drafter_gb = _weight_bytes(r.drafter) / 1e9
    per_cycle = m.committed / m.cycles
    # A plain step reads every target weight once; a cycle reads the drafter's and the target's.
    bound = {"ar": bw / target_gb, "spec": per_cycle * bw / (target_gb + drafter_gb)}
    return {
        "machine": cpu_kind(),
        "kernels": args.kernels,
        "read_gb_s": bw,
        "read_gb_s_range": [min(m.read_gb_s), max(m.read_gb_s)],
        "weights_gb": {"target": target_gb, "drafter": drafter_gb},
        "bound_tok_s": bound,
        "vs_bound": {k: rate[k] / bound[k] for k in bound},
        "prompts": len(r.prompts),
        "max_new_tokens": r.n,
        "tokens_per_s": rate,
        "spec_vs_reference": rate["spec"] / rate["ref"],
        "ar_vs_hf_generate": rate["ar"] / rate["hf"],
        "identical_spec": f"{m.same['spec']}/{len(r.prompts)}",
        "identical_ar": f"{m.same['ar']}/{len(r.prompts)}",
        "tokens_per_cycle": m.committed / m.cycles,
        "cycle_ms": 1e3 * cycle,
        "cycle_draft_ms": 1e3 * m.draft_s / m.cycles,
        "cycle_verify_ms": 1e3 * m.verify_s / m.cycles,
        "greedy_step_ms": 1e3 * ar_step,
        "cycle_over_greedy_step": cycle / ar_step,
        "projected_speedup": {k: k * ar_step / cycle for k in (2, 3, 4)},
        "speedup_measured": rate["spec"] / rate["ar"],
        "oracle_drafts": args.oracle_drafts,
        "speedup_at_oracle": at_k,
    }


def _weight_bytes(model) -> int:
    """Bytes a forward reads of `model`'s weights (shared tensors once; an embedding table is
    read row by row, so only a tied one, read whole as the LM head, counts)."""
    seen, total = set(), 0
    embeds = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = getattr(model, "lm_head", None)
    tied = {id(head.weight)} if head is not None else set()
    for p in model.parameters():
        if id(p) in seen or (id(p) in embeds and id(p) not in tied):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def _print(result: dict) -> None:
    rate = result["tokens_per_s"]
    print(
        f"\n{result['machine']}, our kernels {result['kernels']}: draft-verify ours "
        f"{rate['spec']:.1f} vs reference "
        f"{rate['ref']:.1f} tok/s ({result['spec_vs_reference']:.3f}x, identical "
        f"{result['identical_spec']}); greedy ours {rate['ar']:.1f} vs HF generate "
        f"{rate['hf']:.1f} ({result['ar_vs_hf_generate']:.3f}x, identical "
        f"{result['identical_ar']})\ncycle {result['cycle_ms']:.0f} ms = drafter "
        f"{result['cycle_draft_ms']:.0f} + verify {result['cycle_verify_ms']:.0f} + rest; "
        f"greedy step {result['greedy_step_ms']:.0f} ms ({result['cycle_over_greedy_step']:.2f} "
        f"steps per cycle); projected speedup at 2/3/4 tokens per cycle: "
        + "/".join(f"{v:.2f}" for v in result["projected_speedup"].values())
        + f"; measured at {result['tokens_per_cycle']:.2f}: {result['speedup_measured']:.2f}x"
        + f"\nagainst the bandwidth bound ({result['read_gb_s']:.1f} GB/s read, the median of "
        f"{'-'.join(f'{v:.1f}' for v in result['read_gb_s_range'])} measured beside the "
        f"prompts; target "
        f"{result['weights_gb']['target']:.3f} GB, drafter {result['weights_gb']['drafter']:.3f} "
        "GB of weights per forward): "
        + ", ".join(
            f"{k} {rate[k]:.1f} of {v:.1f} tok/s ({result['vs_bound'][k]:.2f})"
            for k, v in result["bound_tok_s"].items()
        )
        + "\nat a controlled acceptance: "
        + "; ".join(
            f"{how} verify {v['tokens_per_cycle']:.2f} tokens per cycle, speedup "
            f"{v['speedup']:.2f}x (cycle {v['cycle_ms']:.0f} ms: drafter {v['draft_ms']:.0f}, "
            f"verify {v['verify_ms']:.0f}; greedy step {v['greedy_step_ms']:.0f})"
            for how, v in result["speedup_at_oracle"].items()
        )
    )


def main() -> None:
    args = _args()
    from dflash import model as ref

    from dflash_trainer.eval.reference import _cpu_clock

    with tempfile.TemporaryDirectory() as tmp:
        r = _rig(args, ref, tmp)
        packing = (
            r.target.decoding(r.drafter) if args.kernels == "packed" else contextlib.nullcontext()
        )
        with torch.inference_mode(), _cpu_clock(ref), packing:
            m = _against_references(r, ref)
            at_k = _at_oracle(r, args.oracle_drafts)
    result = _result(args, r, m, at_k)
    _print(result)
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


# `dflash-trainer bench` (src/dflash_trainer/bench_harness.py) runs this script with these
# arguments (full run, --bench.quick) and turns its summary into rows with bench_rows.
BENCH_ARGS = {"full": [], "quick": []}


def bench_rows(s: dict) -> list[dict]:
    """This script's JSON summary as rows of the `dflash-trainer bench` table."""
    kernels = f"; ours on {s.get('kernels', 'default')} linear kernels"
    out = [
        bench_harness.row(
            "draft-verify decode (tokens/s)",
            "ours",
            "reference dflash_generate",
            s["spec_vs_reference"],
            note=f"identical tokens {s['identical_spec']}{kernels}",
        ),
        bench_harness.row(
            "greedy decode (tokens/s)",
            "ours",
            "HF generate",
            s["ar_vs_hf_generate"],
            note=f"identical tokens {s['identical_ar']}{kernels}",
        ),
        bench_harness.row(
            "draft-verify cycle",
            "cycle",
            "greedy step",
            s["cycle_over_greedy_step"],
            note=f"{s['cycle_ms']:.0f} ms = drafter {s['cycle_draft_ms']:.0f} + verify "
            f"{s['cycle_verify_ms']:.0f} + rest",
        ),
    ]
    labels = {"ar": "greedy decode (tokens/s)", "spec": "draft-verify decode (tokens/s)"}
    for k, label in labels.items():
        if "vs_bound" in s:
            out.append(
                bench_harness.row(
                    label,
                    "ours",
                    "the bandwidth bound (weights read per forward / measured read GB/s)",
                    s["vs_bound"][k],
                    note=f"{s['tokens_per_s'][k]:.1f} of {s['bound_tok_s'][k]:.1f} tok/s at "
                    f"{s['read_gb_s']:.1f} GB/s",
                )
            )
    for how, v in s["speedup_at_oracle"].items():
        out.append(
            bench_harness.row(
                f"speedup at {v['tokens_per_cycle']:.2f} tokens per cycle",
                f"{how} verify",
                "greedy",
                v["speedup"],
                note=f"cycle {v['cycle_ms']:.0f} ms, greedy step {v['greedy_step_ms']:.0f} ms",
            )
        )
    return out


if __name__ == "__main__":
    main()
