"""Served acceptance: the export decoded by a serving engine (vLLM) as its DFlash drafter.

One more implementation of the evaluation interface (eval/engines.py; here `ServedLoop`):
`served_evaluate` takes the same prompts (token ids, rendered as in training), block size, token
limit and stop ids as `evaluate` and returns the same `EvalSummary`, its `spec_results` being
vLLM's generations with the drafter and its `ar_results` vLLM's plain greedy ones (so
`outputs_match`/`lossless_line` is the identity of vLLM's spec output against vLLM's own greedy
output).

vLLM lives in its own venv (`make vllm` builds `.venv-vllm` with vLLM's CPU build; GPU users
`pip install vllm` into any venv) because it pins transformers<5.20: the engine runs as a
subprocess of that venv's python (models/vllm_worker.py, which imports only vllm and the standard
library), one process per engine (drafter / no drafter), prompts one at a time (batch 1, like our
loop).

How vLLM's counters become our metrics (v1/core/sched/scheduler.py, v1/spec_decode/metrics.py):
vLLM counts per draft step (cycle) the drafts proposed (always num_speculative_tokens) and the
drafts accepted, before the token limit or a stop id truncates the output. The worker reads the
engine's cumulative counters before and after each prompt, so each prompt has: cycles, accepted
drafts and accepted-per-position counts. From those:
- tau per prompt = (generated tokens - 1) / cycles: the first token comes from prefill, every
  other from a cycle, so this is exactly our convention (the mean of each cycle's committed
  tokens, clipped at the limit/stop id), no ordering needed;
- vLLM's own "mean acceptance length" = 1 + accepted / cycles (unclipped, over all prompts);
- the per-cycle multiset of accepted drafts is recovered exactly from the per-position counts
  (cycles accepting >= i drafts = accepted_per_pos[i-1]); the clipping at the end is applied to
  the longest cycle (vLLM does not say which cycle was last), which affects the histogram only.

The parity gate (`parity_problems`, `check_parity`): the project's loop and the served engine on
the same prompts must agree: same greedy tokens, tau within a stated tolerance; a failure names
what diverged (target, slot, setting).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trainer.config import Config
from dflash_trainer.decode.loop import GenResult
from dflash_trainer.errors import UserError
from dflash_trainer.eval.evaluation import divergence_gap, evaluate
from dflash_trainer.eval.metrics import EvalSummary, summarize
from dflash_trainer.models.vllm_engine import (  # noqa: F401  (re-exported for callers and tests)
    VLLMEngine,
    engine_for_config,
    engine_target,
    find_vllm_python,
    vllm_unavailable,
)

log = logging.getLogger(__name__)


def served_result(r: dict, block_size: int) -> GenResult:
    """One prompt of the worker's result as a GenResult (module docstring: how)."""
    tokens = [int(t) for t in r["tokens"]]
    res = GenResult(tokens=tokens, acceptance_lengths=[], accepted_drafts=[], block_sizes=[])
    res.decode_time = float(r.get("seconds", 0.0))
    res.stopped = False
    cycles = int(r.get("drafts", 0))
    if block_size <= 1 or cycles == 0:
        return res
    k = block_size - 1
    per_pos = (list(r.get("per_pos") or []) + [0] * k)[:k]
    ge = [cycles] + per_pos  # ge[i] = cycles that accepted >= i drafts
    accepted = []
    for i in range(k + 1):
        nxt = ge[i + 1] if i < k else 0
        accepted += [i] * (ge[i] - nxt)
    lengths = [a + 1 for a in accepted]
    excess = sum(lengths) - max(0, len(tokens) - 1)
    for j in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        if excess <= 0:
            break
        cut = min(excess, lengths[j] - 1)
        lengths[j] -= cut
        excess -= cut
    res.accepted_drafts = accepted
    res.acceptance_lengths = lengths
    res.block_sizes = [block_size] * cycles
    return res


@dataclass
class ServedEval:
    summary: EvalSummary  # spec = vLLM with the drafter, ar = vLLM plain greedy
    mean_acceptance_length: float  # vLLM's own: 1 + accepted / cycles over all prompts
    taus: list[float]  # per prompt, our convention (clipped)
    vllm_version: str
    startup_s: float
    wall_s: float

    def to_dict(self) -> dict:
        d = self.summary.to_dict()
        d.update(
            engine="vllm",
            vllm_version=self.vllm_version,
            vllm_mean_acceptance_length=self.mean_acceptance_length,
            tau_per_prompt=self.taus,
            engine_startup_s=self.startup_s,
            engine_wall_s=self.wall_s,
        )
        return d


def served_evaluate(
    engine: VLLMEngine,
    drafter_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    block_size: int,
    stop_ids: Sequence[int] = (),
    baseline: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> ServedEval:
    """The export served as vLLM's DFlash drafter on `prompts`, and vLLM's plain greedy
    decoding of the same prompts (`baseline`): the same EvalSummary as evaluate(). At
    `temperature` > 0 vLLM samples (its own seed: one sample per prompt) and accepts the drafts
    by its rejection rule, which our loop's rule equals in law (tests/test_engine_rule.py): the
    acceptance compares, the tokens do not."""
    spec = engine.run(
        prompts, max_new_tokens, drafter_dir, block_size, stop_ids, temperature, top_p
    )
    results = [served_result(r, block_size) for r in spec["results"]]
    ar = None
    wall = spec["wall_s"]
    if baseline:
        plain = engine.run(prompts, max_new_tokens, None, 1, stop_ids)
        ar = [served_result(r, 1) for r in plain["results"]]
        wall += plain["wall_s"]
    s = summarize(results, ar, block_size)
    s.decode_dtype = engine.dtype
    cycles = sum(int(r.get("drafts", 0)) for r in spec["results"])
    acc = sum(int(r.get("accepted", 0)) for r in spec["results"])
    return ServedEval(
        summary=s,
        mean_acceptance_length=1 + acc / cycles if cycles else 1.0,
        taus=[r.tau for r in results],
        vllm_version=str(spec.get("vllm_version")),
        startup_s=float(spec.get("startup_s", 0.0)),
        wall_s=wall,
    )


@dataclass
class ServedLoop:
    """vLLM serving the export in `export_dir` as a DecodeEngine (eval/engines.py): greedy, with
    vLLM's plain greedy decoding of the same prompts as the baseline (`baseline`). `last`: the
    most recent decode's vLLM figures (mean acceptance length, version, timings)."""

    engine: VLLMEngine
    export_dir: str | Path
    stop_ids: Sequence[int] = ()
    baseline: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    name: str = "vllm"
    same_clock: bool = False  # vLLM's clock: its speedup is against its own plain greedy
    last: ServedEval | None = None

    def decode(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int
    ) -> EvalSummary:
        self.last = served_evaluate(
            self.engine,
            self.export_dir,
            prompts,
            max_new_tokens,
            block_size,
            self.stop_ids,
            self.baseline and self.temperature <= 0,  # a sampled baseline proves nothing
            self.temperature,
            self.top_p,
        )
        return self.last.summary

    def details(self) -> dict:
        """vLLM's own figures of the last decode (eval.json's `served`)."""
        return self.last.to_dict() if self.last is not None else {}


# --------------------------------------------------------------------------------------------
# The train/serve parity gate
# --------------------------------------------------------------------------------------------

# Relative tolerance on tau (served vs ours). Greedy, float32 on both sides: every cycle's
# acceptance is a function of argmaxes only, so the served tau equals ours exactly unless a
# kernel's rounding flips a near-tie between two candidates (measured: the memorised drafter,
# exact on 6 of 6 prompts; the demo's export 1.111 vs 1.112, a 0.1% gap). A real train/serve
# mismatch (taps off by one layer, a scaled embedding, another RoPE base, another target) drops
# served acceptance towards 1, i.e. loses most of tau - 1: 5% stays far below that for any
# drafter worth serving and far above rounding.
PARITY_TOLERANCE = 0.05
# Two engines' float32 kernels (vLLM's C++ CPU kernels vs PyTorch's) round differently, and over
# 100+ greedy tokens that could flip an argmax where two logits nearly tie (not observed so far:
# identical on 6 of 6 memorised prompts x 24 tokens, 6 of 6 of the demo's MT-Bench prompts x 128,
# 64 of 64 regenerated answers x 192). A larger gap is a real mismatch: another model, or the same
# one in another dtype (the demo's bf16-loaded target upcast to float32 against vLLM's float32
# load diverged on 1 of 6).
SERVED_NEAR_TIE_LOGIT_GAP = 0.05


def parity_problems(
    ours: EvalSummary,
    served: ServedEval | EvalSummary,
    drafter_cfg: Any,
    target: str,
    tolerance: float = PARITY_TOLERANCE,
    gap: Callable[[int, Any, Any], float] | None = None,
) -> list[str]:
    """What diverged between our loop (`ours`, greedy, with its spec_results) and the served
    engine on the same prompts; [] when they agree. Each line names a slot or a setting.

    `gap(i, a, b)`: the logit gap at the first position where generations a and b of prompt i
    differ, under our target (evaluation.divergence_gap). Given, a divergence whose gap is at most
    SERVED_NEAR_TIE_LOGIT_GAP is a rounding near-tie between two engines' kernels, not a
    mismatch, and is not reported; without it every divergence is."""

    def real(pairs) -> tuple[int, float]:
        """(divergences that are no near-tie, the largest gap among all divergences)."""
        bad, worst = 0, 0.0
        for i, (a, b) in pairs:
            if a.tokens == b.tokens:
                continue
            g = gap(i, a, b) if gap is not None else float("inf")
            worst = max(worst, g)
            bad += g > SERVED_NEAR_TIE_LOGIT_GAP
        return bad, worst

    s = served.summary if isinstance(served, ServedEval) else served
    out = []
    m = len(ours.spec_results)
    if s.ar_results:
        n, worst = real(enumerate(zip(ours.spec_results, s.ar_results)))
        if n:
            out.append(
                f"target: vLLM's plain greedy output differs from ours on {n} of {m} prompts "
                f"before any drafting (largest logit gap at a first divergence {worst:.3g}): the "
                f"served target ('{target}', {s.decode_dtype}) is not the model trained against "
                "(serve the directory training.json names, in the same dtype)"
            )
        n, worst = real(enumerate(zip(s.spec_results, s.ar_results)))
        if n:
            out.append(
                f"lossless: vLLM with the drafter differs from vLLM's plain greedy on {n} of {m} "
                f"prompts (largest logit gap {worst:.3g}; an engine problem, not the drafter's)"
            )
    rel = abs(s.tau - ours.tau) / max(ours.tau, 1e-9)
    if rel > tolerance:
        slot = next(
            (
                i + 1
                for i, (a, b) in enumerate(zip(ours.position_acceptance, s.position_acceptance))
                if abs(a - b) > tolerance
            ),
            None,
        )
        k = getattr(drafter_cfg, "block_size", 0) - 1
        settings = (
            f"served with num_speculative_tokens={k} (block_size - 1), method dflash; check "
            f"dflash_config.target_layer_ids {list(getattr(drafter_cfg, 'target_layer_ids', []))} "
            f"(vLLM taps the output of decoder layer id, HF hidden_states[id + 1]), "
            f"rope_theta {getattr(drafter_cfg, 'rope_theta', '?')}, mask_token_id "
            f"{getattr(drafter_cfg, 'mask_token_id', '?')}, the embedding scale (raw table, scale "
            "1) and that the engine shares the target's lm_head"
        )
        where = (
            f"first at draft slot {slot} (ours {ours.position_acceptance[slot - 1]:.3f}, vLLM "
            f"{s.position_acceptance[slot - 1]:.3f})"
            if slot
            else "spread over the slots"
        )
        out.append(
            f"tau: vLLM {s.tau:.3f} vs ours {ours.tau:.3f} ({rel:.1%} > {tolerance:.0%}), "
            f"per-position acceptance diverging {where}; {settings}"
        )
    return out


def logit_gap(target: Any, prompts: Sequence[Sequence[int]]) -> Callable[[int, Any, Any], float]:
    """parity_problems' `gap`: evaluation.divergence_gap under `target` (a TargetModel)."""
    import torch

    device = next(target.model.parameters()).device

    def gap(i: int, a: Any, b: Any) -> float:
        ids = torch.tensor([list(prompts[i])], dtype=torch.long, device=device)
        with torch.inference_mode():
            return divergence_gap(target.model, ids, a, b)

    return gap


def check_parity(
    ours: EvalSummary,
    served: ServedEval,
    drafter_cfg: Any,
    target: str,
    tolerance: float = PARITY_TOLERANCE,
    gap: Callable[[int, Any, Any], float] | None = None,
) -> None:
    """parity_problems, raised as a UserError naming every divergence."""
    problems = parity_problems(ours, served, drafter_cfg, target, tolerance, gap)
    if problems:
        raise UserError(
            "train/serve parity failed (vLLM serving the export disagrees with the project's "
            "loop on the same prompts):\n  - " + "\n  - ".join(problems)
        )


def parity_gate(
    cfg: Config,
    target: Any,
    drafter: Any,
    export_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    dtype: str,
) -> dict | None:
    """The train/serve parity gate (eval.parity): our loop (`target`, `drafter` = the export as
    loaded, both in `dtype`) and vLLM serving `export_dir` on the pinned `prompts`, greedy.
    Returns the figures (None when skipped); raises a UserError naming what diverged."""
    mode = cfg.eval.parity
    if mode == "off" or not prompts:
        return None
    needed = "vLLM is needed here but cannot run" if mode == "on" else ""
    engine, why = engine_for_config(cfg, dtype, required=needed)
    if engine is None:
        log.warning("vLLM not available, served evaluation skipped: %s", why)
        return None
    block = cfg.eval.block_size or drafter.config.block_size
    n = cfg.eval.max_new_tokens
    stop = list(target.eos_token_ids)
    t0 = time.perf_counter()
    ours = evaluate(target, drafter, prompts, n, block, warmup=False, progress=False)
    served = served_evaluate(engine, export_dir, prompts, n, block, stop)
    out = {
        "parity/prompts": len(prompts),
        "parity/tau": ours.tau,
        "parity/tau_served": served.summary.tau,
        "parity/served_mean_acceptance_length": served.mean_acceptance_length,
        "parity/identical_to_ours": sum(
            a.tokens == b.tokens for a, b in zip(served.summary.spec_results, ours.spec_results)
        ),
        "parity/served_lossless": bool(served.summary.lossless),
        "parity/seconds": time.perf_counter() - t0,
    }
    log.info(
        "train/serve parity on %d pinned prompts x %d tokens (%s): vLLM %s tau %.3f (mean "
        "acceptance length %.3f), ours %.3f; vLLM output identical to ours on %d, %s",
        len(prompts),
        n,
        dtype,
        served.vllm_version,
        served.summary.tau,
        served.mean_acceptance_length,
        ours.tau,
        out["parity/identical_to_ours"],
        served.summary.lossless_line(),
    )
    check_parity(
        ours,
        served,
        drafter.config,
        engine.target,
        cfg.eval.parity_tolerance,
        logit_gap(target, prompts),
    )
    return out


def read_export_config(export_dir: str | Path) -> Any:
    """The export's drafter settings the parity messages name (config.json)."""
    from types import SimpleNamespace

    d = json.loads((Path(export_dir) / "config.json").read_text(encoding="utf-8"))
    dc = d.get("dflash_config", {})
    return SimpleNamespace(
        block_size=d.get("block_size"),
        target_layer_ids=dc.get("target_layer_ids", []),
        mask_token_id=dc.get("mask_token_id"),
        rope_theta=d.get("rope_theta"),
    )
