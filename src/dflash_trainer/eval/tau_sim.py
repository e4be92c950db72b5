"""`eval/tau_sim`: acceptance length predicted from the held-out responses, without the target's
verify passes.

The held-out responses were written by the target itself (greedy), so along a response the
draft-verify loop of decode/loop.py would see exactly these tokens: the target's greedy
choice at position p is the data token at p. Replaying the loop on the data gives the loop's
acceptance with no target forward beyond one tapped pass over each held-out sequence (computed
once, then cached):

    pos = P (the first response token: the prefill's output, slot 0 of the first block)
    each cycle: block [ids[pos], MASK x q-1], q = min(block_size, tokens left + 1), over the
                context features < pos; drafts d_1..d_q-1 (argmax, as the decode loop drafts);
                a = leading k with d_k == ids[pos+k]; produced = min(a + 1, tokens left),
                cut after a stop id among the produced tokens; pos += produced

Per response tau = mean produced per cycle; the figure is the mean over responses with at least
one cycle: the aggregation of measured tau (eval/metrics.py), with the same max_new_tokens
clipping and stop ids. It differs from measured tau only where the data are not the target's
greedy output in the evaluation dtype (text re-tokenised, another dtype at generation time,
responses cut at data.max_length or the generation limit: a response that runs out of data ends
at its last known token).

At temperature T > 0 (eval.sampling; `TauSim(..., sampling=)`) a cycle's value is what a serving
engine's rule produces in expectation instead. vLLM (rejection_sampler.py, draft_sample_method
"greedy") and the project's loop (tests/test_engine_rule.py) accept the argmax draft d_j with
probability p_j(d_j), the target's sampled distribution at slot j (decode/sampler.py
`sampled_logits`: tempered, top-k and top-p filtered) given the accepted prefix, so

    value = E[min(A + 1, C)] = 1 + sum_{k < C} [no stop id among d_1..d_k] prod_{j<=k} p_j(d_j)

with A the accepted drafts and C the tokens the cycle may produce (tokens left, and the data
left after pos: the greedy replay's caps). The p_j come from the target's final normed hidden
states of the data, cached beside the features from the same one pass per sequence, through its
LM head per cycle (a few rows; no vocabulary x positions tensor is kept). Two choices, stated
because they shape the figure:
- the trajectory is the greedy one: the cycles start where the greedy replay starts them (pos
  advances by the greedy `produced`, kept in `SimResult.committed`), not along a sampled
  response; the value is the engine's expectation at those positions. Measured tau at T > 0
  decodes sampled responses, whose anchors and contexts differ;
- the product stops at the first draft that differs from the data token. Up to that slot the
  accepted prefix is the data, so p_j is exact; that slot's own p_j (its context is still the
  data) is counted, and later slots, whose context holds a draft the data do not, would need a
  target forward: they count 0. In that respect the value is a lower bound of the engine's
  expectation at the cycle.
As T -> 0, p_j(d_j) -> 1 where d_j is the data token and 0 elsewhere: the greedy value.

Unlike `drafter/accept_len` (an average over anchor positions of the last training batch, in
sample after the first epoch), this is measured on held-out responses and aggregated per cycle,
then per response, so it predicts what serving measures.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dflash_trainer.config import SamplingConfig
from dflash_trainer.decode.draft import Drafter, accepted, commit, draft_block
from dflash_trainer.decode.sampler import sampled_logits
from dflash_trainer.models.packed_linear import packed_linears
from dflash_trainer.models.target import TargetModel
from dflash_trainer.observe.progress import showing_progress
from dflash_trainer.precision import module_dtype


@dataclass
class SimResult:
    tau: float  # mean over responses of mean tokens per cycle
    per_response: list[float]  # per response with at least one cycle
    # per response, per cycle: tokens committed (greedy), or the engine rule's expected tokens
    # (temperature > 0)
    acceptance_lengths: list[Sequence[float]]
    cycles: int
    keys: list[str]  # per response: its example key (acceptance_lengths' order)
    # per response, per cycle: tokens the greedy replay committed, i.e. where the next cycle
    # starts (acceptance_lengths itself when greedy)
    committed: list[list[int]]


def mean_tau(acceptance_lengths: Sequence[Sequence[float]]) -> float:
    """Mean over responses with at least one cycle of mean tokens per cycle (1.0 if none): the
    aggregation of measured tau (eval/metrics.py)."""
    per = [sum(x) / len(x) for x in acceptance_lengths if x]
    return sum(per) / len(per) if per else 1.0


@dataclass
class Cycle:
    """One cycle of the greedy replay."""

    pos: int  # the anchor's position (its token is committed; the drafts follow it)
    drafts: list[int]  # d_1 .. d_q-1
    accepted: int  # a: leading drafts equal to the data's tokens
    committed: int  # what the greedy replay records: tokens committed (clipped, cut at a stop)
    cap: int  # tokens the cycle may produce: max_new_tokens left, and data left after pos


def replay_cycles(
    drafter: Drafter,
    embed_weight: torch.Tensor,
    lm_head: nn.Module,
    features: torch.Tensor,
    ids: Sequence[int],
    prompt_len: int,
    max_new_tokens: int,
    block_size: int,
    stop_ids: Sequence[int] = (),
) -> Iterator[Cycle]:
    """The greedy replay's cycles along one response. `features` [1, S, n*H] are the tapped
    target features of `ids` (length S); `ids[prompt_len:]` is the response. Each cycle is the
    decode loop's draft-and-accept step (decode/draft.py) with the data as the target's
    choices."""
    stop = set(int(s) for s in stop_ids)
    end = len(ids)
    if prompt_len >= end or max_new_tokens <= 0 or ids[prompt_len] in stop:
        return  # the decode loop: the prefill's token ends it, no cycle runs
    cache = drafter.new_cache()
    pos, committed = prompt_len, 1
    while committed < max_new_tokens:
        remaining = max_new_tokens - committed
        q = min(block_size, remaining + 1)
        a, drafts = 0, []
        if q > 1:
            last = torch.tensor([int(ids[pos])], device=features.device)
            ctx = features[:, cache.length : pos]
            block = draft_block(drafter, embed_weight, lm_head, last, pos, ctx, cache, q, q - 1)
            drafts = block[0, 1:].tolist()
            a = accepted(drafts, list(ids[pos + 1 : pos + q]))
        cap = min(remaining, end - 1 - pos)
        if pos + 1 + a >= end:  # the data end here: no label for the bonus token
            if min(a, remaining) > 0:
                yield Cycle(pos, drafts, a, min(a, remaining), cap)
            return
        new, stopped = commit(list(ids[pos + 1 : pos + 2 + a]), remaining, stop)
        yield Cycle(pos, drafts, a, len(new), cap)
        committed += len(new)
        pos += len(new)
        if stopped:
            return


def acceptance_probabilities(
    lm_head: nn.Module,
    final_hidden: torch.Tensor,
    pos: int,
    drafts: Sequence[int],
    sampling: SamplingConfig,
) -> list[float]:
    """p_j(d_j), j = 1..len(drafts): the target's sampled probability of the draft at position
    pos + j given the data before it. `final_hidden` [1, S, H]: the target's final normed hidden
    states of the data; row pos + j - 1 is what the LM head predicts position pos + j from."""
    n = len(drafts)
    if n == 0:
        return []
    hidden = final_hidden[0, pos : pos + n]
    logits = lm_head(hidden.to(module_dtype(lm_head, hidden.dtype)))
    probs = torch.softmax(sampled_logits(sampling, logits), dim=-1)
    index = torch.tensor(list(drafts), dtype=torch.long, device=probs.device)
    return probs.gather(-1, index[:, None])[:, 0].tolist()


def expected_produced(
    p_accept: Sequence[float], drafts: Sequence[int], cap: int, stop: set[int]
) -> float:
    """E[min(A + 1, cap)], cut after a stop id: the tokens a cycle produces by the engine's rule,
    where draft k is accepted (given drafts 1..k-1 were) with probability p_accept[k-1]. The
    (k+1)-th token exists when drafts 1..k are accepted and none of them is a stop id; drafts
    past p_accept count as rejected (their probabilities are not known)."""
    expected, reach = 1.0, 1.0  # the first token (a draft or the bonus) is always produced
    for k, (p, draft) in enumerate(zip(p_accept, drafts), start=1):
        if k >= cap or draft in stop:
            break
        reach *= p  # P(drafts 1..k accepted)
        expected += reach
    return expected


def expected_tokens(
    cycle: Cycle,
    lm_head: nn.Module,
    final_hidden: torch.Tensor,
    sampling: SamplingConfig,
    stop: set[int],
) -> float:
    """A cycle's value at temperature > 0 (module docstring): the engine rule's expected tokens,
    with the acceptance probabilities of the drafts whose context the data give: those up to
    and including the first that differs from the data token."""
    known = min(cycle.accepted + 1, len(cycle.drafts), cycle.cap - 1)
    drafts = cycle.drafts[: max(known, 0)]
    p_accept = acceptance_probabilities(lm_head, final_hidden, cycle.pos, drafts, sampling)
    return expected_produced(p_accept, drafts, cycle.cap, stop)


class TauSim:
    """tau_sim over a fixed set of held-out sequences; target features computed once, cached.

    `target`: the TargetModel evaluation decodes with (its dtype is the features').
    `examples`: (key, full token ids, prompt length) per held-out response.
    `sampling`: the evaluation's (eval.sampling); at temperature > 0 each cycle's value is the
    engine rule's expected tokens (module docstring), and the target's final normed hidden
    states are cached beside the features.
    `packed`: the replay's float32 CPU linear layers (the LM head, the drafter's) run oneDNN's
    prepacked GEMM, as measured decoding does (target.packed_linear; models/packed_linear.py):
    the drafts are the decode loop's, and a 16-row LM head costs a third (2-core AVX2 EPYC).
    Only those two: the replay runs no target forward beyond the features, which keep the
    target's own kernels.
    """

    def __init__(
        self,
        target: TargetModel,
        examples: Sequence[tuple[str, Sequence[int], int]],
        sampling: SamplingConfig | None = None,
        packed: bool = True,
    ):
        self.target, self.packed = target, packed
        self.examples = [(k, list(map(int, ids)), int(p)) for k, ids, p in examples]
        self.sampling = None if sampling is None or sampling.greedy else sampling
        self._features: dict[str, torch.Tensor] = {}
        self._final: dict[str, torch.Tensor] = {}  # sampled only: [1, S, H] per key

    def _store(self, t: torch.Tensor) -> torch.Tensor:
        """Cached in host memory on GPU (a long held-out set of a large target would not fit
        beside it), on the device otherwise."""
        return t.cpu() if self.target.device.type == "cuda" else t

    def _compute(self, key: str, ids: list[int]) -> None:
        """One pass over the sequence: its tapped features, and at temperature > 0 its final
        normed hidden states (the same forward run to its end)."""
        t = torch.tensor([ids], dtype=torch.long, device=self.target.device)
        if self.sampling is None:
            self._features[key] = self._store(self.target.features(t))
            return
        features, final = self.target.features(t, final=True)
        self._features[key], self._final[key] = self._store(features), self._store(final)

    def features(self, key: str, ids: list[int]) -> torch.Tensor:
        """[1, S, n*H] on the target's device."""
        if key not in self._features:
            self._compute(key, ids)
        return self._features[key].to(self.target.device, non_blocking=True)

    def final_hidden(self, key: str, ids: list[int]) -> torch.Tensor:
        """[1, S, H] on the target's device: what the LM head reads (temperature > 0 only)."""
        if key not in self._final:
            self._compute(key, ids)
        return self._final[key].to(self.target.device, non_blocking=True)

    def _replay(
        self, drafter, key: str, ids: list[int], prompt_len: int, max_new: int, block: int
    ) -> tuple[Sequence[float], list[int]]:
        """One response: (per cycle value, per cycle tokens the greedy replay committed)."""
        t = self.target
        cycles = list(
            replay_cycles(
                drafter,
                t.embed_weight,
                t.lm_head,
                self.features(key, ids),
                ids,
                prompt_len,
                max_new,
                block,
                t.eos_token_ids,
            )
        )
        committed = [c.committed for c in cycles]
        if self.sampling is None:
            return committed, committed
        final, stop = self.final_hidden(key, ids), set(t.eos_token_ids)
        values = [expected_tokens(c, t.lm_head, final, self.sampling, stop) for c in cycles]
        return values, committed

    @torch.no_grad()
    def run(
        self,
        drafter,
        max_new_tokens: int,
        block_size: int,
        keys: Sequence[str] | None = None,
        progress: bool = True,
    ) -> SimResult:
        """Replay every example (those in `keys` when given). `progress`: a bar over the
        replayed prompts (observe/progress.py; drawn only when stderr is a terminal)."""
        drafter = getattr(drafter, "module", drafter)
        wanted = None if keys is None else set(keys)
        todo = [e for e in self.examples if wanted is None or e[0] in wanted]
        was = drafter.training
        drafter.eval()
        try:
            lens: list[Sequence[float]] = []
            committed: list[list[int]] = []
            with (
                packed_linears(self.target.lm_head, drafter, enabled=self.packed),
                showing_progress(len(todo), desc="tau_sim", unit="prompt", enabled=progress) as bar,
            ):
                for key, ids, p in todo:
                    values, steps = self._replay(drafter, key, ids, p, max_new_tokens, block_size)
                    lens.append(values)
                    committed.append(steps)
                    bar.update(1)
        finally:
            drafter.train(was)
        return SimResult(
            tau=mean_tau(lens),
            per_response=[sum(x) / len(x) for x in lens if x],
            acceptance_lengths=lens,
            cycles=sum(len(x) for x in lens),
            keys=[key for key, _, _ in todo],
            committed=committed,
        )
