"""Acceptance and speed metrics over many generations (pure Python; no torch).

Conventions (method doc §3, z-lab benchmark):
- acceptance length of a cycle = tokens it committed, bonus included (1..block_size), clipped where
  the token limit or a stop id cut the cycle short;
- tau = mean over responses of each response's mean acceptance length (responses with no cycle are
  skipped); `tau_token_weighted` = all committed tokens / all cycles;
- speedup = mean time-per-output-token of the AR baseline / mean TPOT with the drafter, prefill
  excluded on both sides;
- lossless: spec outputs equal plain greedy ones. In bf16/fp16 the batched verify pass and the
  one-token steps round differently, so the target's own argmax can flip where two logits nearly
  tie; such a divergence is reported with the logit gap at its first divergent position
  ("identical except bf16 near-ties: N of M, largest logit gap G"), never as a bare False.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash_trainer.precision import SHORT_NAMES


@dataclass
class EvalSummary:
    block_size: int
    num_responses: int
    num_cycles: int
    num_tokens: int
    tau: float
    tau_token_weighted: float
    histogram: list[float]  # [k-1] = share of cycles that committed k tokens
    position_acceptance: list[float]  # [i-1] = share of cycles that accepted draft slot i
    tpot: float  # seconds/token with the drafter (mean over responses)
    draft_share: float  # drafter time / (drafter + verify) time
    ar_tpot: float | None = None  # seconds/token, AR baseline
    speedup: float | None = None
    outputs_match: float | None = None  # share of responses where spec == AR tokens
    decode_dtype: str = "float32"  # the dtype target and drafter decoded in
    tie_gaps: list[float] = field(default_factory=list)  # per divergent response: logit gap
    # between the two choices at its first divergent position
    spec_results: list[Any] = field(default_factory=list, repr=False)
    ar_results: list[Any] = field(default_factory=list, repr=False)
    # the token ids each response answered, when the caller kept them (run_conversations): what
    # another engine must decode to be compared response by response (eval/served.py)
    prompts: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.tpot if self.tpot > 0 else float("inf")

    @property
    def lossless(self) -> bool | None:
        return None if self.outputs_match is None else self.outputs_match == 1.0

    @property
    def num_divergent(self) -> int:
        if self.outputs_match is None:
            return 0
        return sum(a.tokens != b.tokens for a, b in zip(self.spec_results, self.ar_results))

    @property
    def near_ties_only(self) -> bool:
        """Every divergence is a rounding near-tie of a reduced-precision decode."""
        return (
            self.decode_dtype != "float32"
            and len(self.tie_gaps) == self.num_divergent
            and all(g <= NEAR_TIE_LOGIT_GAP for g in self.tie_gaps)
        )

    def lossless_line(self) -> str:
        """What a user reads about losslessness (vs plain greedy decoding)."""
        if self.outputs_match is None:
            return "not checked (no baseline run)"
        m, n = self.num_responses, self.num_divergent
        if n == 0:
            return f"identical to plain greedy decoding on {m} of {m} ({self.decode_dtype})"
        gap = f"{max(self.tie_gaps):.3g}" if self.tie_gaps else "?"
        if self.near_ties_only:
            short = SHORT_NAMES.get(self.decode_dtype, self.decode_dtype)
            return (
                f"identical except {short} near-ties: {n} of {m}, largest logit gap {gap} "
                "(decode in float32, eval.dtype=float32, for an exact check)"
            )
        return (
            f"DIFFERS from plain greedy decoding on {n} of {m} ({self.decode_dtype}; largest logit "
            f"gap at the first divergence {gap}): a bug, not rounding"
        )

    def to_dict(self) -> dict:
        d = {
            k: getattr(self, k)
            for k in (
                "block_size",
                "num_responses",
                "num_cycles",
                "num_tokens",
                "tau",
                "tau_token_weighted",
                "histogram",
                "position_acceptance",
                "tpot",
                "draft_share",
                "ar_tpot",
                "speedup",
                "outputs_match",
                "tokens_per_s",
                "lossless",
                "decode_dtype",
                "tie_gaps",
                "num_divergent",
            )
        }
        d["lossless_line"] = self.lossless_line()
        d["acceptance_lengths"] = [r.acceptance_lengths for r in self.spec_results]
        return d


# A divergence whose two candidate logits were within this many logits of each other is a
# reduced-precision near-tie (bf16 keeps 8 mantissa bits: ~0.125 resolution at logits of 16-32).
NEAR_TIE_LOGIT_GAP = 1.0


# Context-length buckets (tokens before a cycle's block): acceptance past the lengths a drafter
# trained on is where drafters are known to fall off.
CONTEXT_EDGES = (512, 1024, 2048, 4096, 8192)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 else str(n)


def context_bucket(n: int) -> str:
    """The bucket of a context of `n` tokens: "0-512", "512-1K", ..., "8K+"."""
    lo = 0
    for hi in CONTEXT_EDGES:
        if n < hi:
            return f"{_k(lo)}-{_k(hi)}"
        lo = hi
    return f"{_k(lo)}+"


def tau_by_context(
    per_response: Sequence[Sequence[float]],
    prompt_lens: Sequence[int],
    advances: Sequence[Sequence[int]] | None = None,
) -> dict[str, tuple[float, int]]:
    """Per context bucket: (mean tokens committed per cycle, cycles), over the cycles whose
    block starts after a context of that length (the prompt and every token committed before
    the cycle). Cycle-weighted: a long response's late cycles are what fall in the long buckets.
    Buckets without a cycle are left out. `advances`: per response, per cycle, the tokens the
    cycle moves the context by where that is not its value (tau_sim at temperature > 0: the
    value is an expectation, the cycles advance by the greedy replay's tokens)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    steps = per_response if advances is None else advances
    for lens, moves, p in zip(per_response, steps, prompt_lens):
        ctx = int(p)
        for n, move in zip(lens, moves, strict=True):
            b = context_bucket(ctx)
            sums[b], counts[b] = sums.get(b, 0.0) + n, counts.get(b, 0) + 1
            ctx += int(move)
    order = [context_bucket(0)] + [context_bucket(e) for e in CONTEXT_EDGES]
    return {b: (sums[b] / counts[b], counts[b]) for b in order if b in counts}


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def position_acceptance(
    accepted: Sequence[int], block_sizes: Sequence[int], block_size: int
) -> list[float]:
    """Per draft slot i (1..block_size-1): accepted in what share of the cycles that drafted it."""
    hits = [0] * (block_size - 1)
    seen = [0] * (block_size - 1)
    for a, q in zip(accepted, block_sizes):
        for i in range(1, q):
            seen[i - 1] += 1
            hits[i - 1] += a >= i
    return [h / s if s else 0.0 for h, s in zip(hits, seen)]


def summarize(spec: Sequence[Any], ar: Sequence[Any] | None, block_size: int) -> EvalSummary:
    """Aggregate GenResults of the drafter runs (and, optionally, the matching AR runs)."""
    lengths = [n for r in spec for n in r.acceptance_lengths]
    per_response = [_mean(r.acceptance_lengths) for r in spec if r.acceptance_lengths]
    hist = [0] * block_size
    for n in lengths:
        hist[n - 1] += 1
    accepted = [a for r in spec for a in r.accepted_drafts]
    sizes = [q for r in spec for q in r.block_sizes]
    draft_t = sum(r.draft_time for r in spec)
    verify_t = sum(r.verify_time for r in spec)
    s = EvalSummary(
        block_size=block_size,
        num_responses=len(spec),
        num_cycles=len(lengths),
        num_tokens=sum(r.num_tokens for r in spec),
        tau=_mean(per_response) if per_response else 1.0,
        tau_token_weighted=sum(lengths) / len(lengths) if lengths else 1.0,
        histogram=[h / len(lengths) if lengths else 0.0 for h in hist],
        position_acceptance=position_acceptance(accepted, sizes, block_size),
        tpot=_mean([r.tpot for r in spec]),
        draft_share=draft_t / (draft_t + verify_t) if draft_t + verify_t > 0 else 0.0,
        spec_results=list(spec),
    )
    if ar:
        if len(ar) != len(spec):
            raise ValueError(f"{len(ar)} AR results for {len(spec)} spec results")
        s.ar_results = list(ar)
        s.ar_tpot = _mean([r.tpot for r in ar])
        s.speedup = s.ar_tpot / s.tpot if s.tpot > 0 else None
        s.outputs_match = _mean([float(a.tokens == b.tokens) for a, b in zip(spec, ar)])
    return s


def format_table(results: dict[str, EvalSummary]) -> str:
    """One line per dataset: tau, speedup, tokens/s, n."""
    head = (
        f"{'dataset':<24}{'n':>5}{'tau':>7}{'tau_tok':>9}{'speedup':>9}{'tok/s':>9}"
        f"{'AR tok/s':>10}{'match':>7}"
    )
    rows = [head, "-" * len(head)]
    for name, s in results.items():
        sp = f"{s.speedup:.2f}x" if s.speedup is not None else "-"
        ar = f"{1 / s.ar_tpot:.1f}" if s.ar_tpot else "-"
        m = f"{s.outputs_match:.2f}" if s.outputs_match is not None else "-"
        rows.append(
            f"{name[:23]:<24}{s.num_responses:>5}{s.tau:>7.2f}{s.tau_token_weighted:>9.2f}"
            f"{sp:>9}{s.tokens_per_s:>9.1f}{ar:>10}{m:>7}"
        )
    for name, s in results.items():
        if s.outputs_match is not None:
            rows.append(f"{name}: {s.lossless_line()}")
    return "\n".join(rows)
