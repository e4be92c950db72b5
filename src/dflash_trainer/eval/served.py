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

The train/serve parity gate that checks vLLM against the project's loop: eval/parity.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash_trainer.config import SamplingConfig
from dflash_trainer.decode.loop import GenResult
from dflash_trainer.eval.metrics import EvalSummary, summarize
from dflash_trainer.models.vllm_engine import VLLMEngine

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
    sampling: SamplingConfig | None = None,
) -> ServedEval:
    """The export served as vLLM's DFlash drafter on `prompts`, and vLLM's plain greedy
    decoding of the same prompts (`baseline`): the same EvalSummary as evaluate(). Where
    `sampling` samples (temperature > 0) vLLM samples (its own seed: one sample per prompt)
    and accepts the drafts by its rejection rule, which our loop's rule equals in law
    (tests/test_engine_rule.py): the acceptance compares, the tokens do not."""
    spec = engine.run(prompts, max_new_tokens, drafter_dir, block_size, stop_ids, sampling)
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
    sampling: SamplingConfig | None = None  # None = greedy
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
            # a sampled baseline proves nothing
            self.baseline and (self.sampling is None or self.sampling.greedy),
            self.sampling,
        )
        return self.last.summary

    def details(self) -> dict:
        """vLLM's own figures of the last decode (eval.json's `served`)."""
        return self.last.to_dict() if self.last is not None else {}
