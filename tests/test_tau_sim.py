"""eval/tau_sim predicts measured tau: the draft-verify loop replayed on the target's own greedy
responses, aggregated like tau (per response, then over responses)."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch
from torch import nn

from dflash_trainer.config import SamplingConfig
from dflash_trainer.decode.draft import accepted, draft_block
from dflash_trainer.decode.loop import decode
from dflash_trainer.eval.evaluation import evaluate
from dflash_trainer.eval.tau_sim import TauSim, expected_produced, replay_cycles
from test_specdecode import (
    LAYER_IDS,
    H,
    StubCache,
    V,
    _trained_drafter,
    ar_generate,
    full_taps,
    random_prompt,
    side,
    tiny_target,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _setup(n_new=24, seed=3):
    """A tiny target, a drafter trained on its greedy answers to 3 prompts (shared by the
    tests: training it takes a few seconds)."""
    model = tiny_target("llama", seed=seed)
    g = torch.Generator().manual_seed(7)
    prompts = [random_prompt(g, 6, 12) for _ in range(3)]
    drafter = _trained_drafter(model, prompts, block_size=8, steps=400)
    target = side(model)
    assert target.eos_token_ids == []
    seqs = []
    for i, p in enumerate(prompts):
        resp = ar_generate(model, p, n_new).tokens  # the target's own greedy answer
        seqs.append((f"r{i}", p[0].tolist() + resp, p.shape[1]))
    return target, drafter, prompts, seqs


def test_tau_sim_equals_measured_tau_on_the_targets_greedy_outputs():
    target, drafter, prompts, seqs = _setup()
    for max_new in (24, 17):
        measured = evaluate(target, drafter, prompts, max_new, 8, baseline=False, warmup=False)
        sim = TauSim(target, seqs).run(drafter, max_new, 8)
        assert measured.tau > 2.0, measured.tau  # a drafter that accepts long drafts
        # fp32, data = the target's greedy output: the replay is the loop itself
        print(f"max_new {max_new}: tau {measured.tau:.3f}, tau_sim {sim.tau:.3f}")
        assert sim.tau == pytest.approx(measured.tau, rel=0.1)
        assert sim.acceptance_lengths == [r.acceptance_lengths for r in measured.spec_results]


def test_tau_sim_stops_where_the_loop_stops():
    target, drafter, prompts, seqs = _setup()
    key, ids, p = seqs[0]
    stop = ids[p + 5]
    measured = evaluate(
        target, drafter, prompts[:1], 24, 8, stop_ids=[stop], baseline=False, warmup=False
    )
    stopping = side(target.model)
    stopping.eos_token_ids = [stop]
    sim = TauSim(stopping, [seqs[0]])
    got = sim.run(drafter, 24, 8)
    assert got.acceptance_lengths[0] == measured.spec_results[0].acceptance_lengths
    assert sum(got.acceptance_lengths[0]) + 1 == len(measured.spec_results[0].tokens)
    # the first response token is a stop id: no cycle, like spec_generate
    feats = sim.features(key, ids)
    assert list(replay_cycles(drafter, *_heads(target), feats, ids, p, 24, 8, [ids[p]])) == []


def _heads(target):
    return target.embed_weight, target.lm_head


# ------------------------------------------------------------------ temperature > 0


@functools.cache
def _partial_setup():
    """The tiny target and a drafter trained for fewer steps on its greedy answers: cycles that
    accept some drafts and reject the rest."""
    model = tiny_target("llama", seed=3)
    g = torch.Generator().manual_seed(7)
    prompts = [random_prompt(g, 6, 12) for _ in range(3)]
    drafter = _trained_drafter(model, prompts, block_size=8, steps=200)
    seqs = [
        (f"r{i}", p[0].tolist() + ar_generate(model, p, 24).tokens, p.shape[1])
        for i, p in enumerate(prompts)
    ]
    return side(model), drafter, seqs


class ScriptedDrafter(nn.Module):
    """Drafts `tokens[position]` at each slot, whatever the context (a cycle's drafts depend on
    its start only)."""

    def __init__(self, tokens: dict[int, int], block_size: int = 8):
        super().__init__()
        self.tokens, self.start = tokens, 0
        self.config = SimpleNamespace(
            block_size=block_size, mask_token_id=V - 1, target_layer_ids=list(LAYER_IDS)
        )

    def new_cache(self):
        return StubCache()

    def forward_infer(self, block_embeds, new_features, cache, start):
        cache.length += new_features.shape[1]
        self.start = start
        return torch.zeros(1, block_embeds.shape[1], H)

    def propose(self, hidden, lm_head, anchor_ids):
        slots = range(self.start + 1, self.start + 1 + hidden.shape[1])
        return torch.tensor([[self.tokens.get(t, 0) for t in slots]])


@torch.no_grad()
def _second_choice_drafter(target, ids, p, every):
    """Drafts the data's tokens, except at every `every`-th response position (from the first
    draft on) the target's second most likely token there, given the data: a draft that differs
    from the data and that the target often accepts at T = 0.7, so that the slots after it see a
    context the data do not hold."""
    logits = target.model(torch.tensor([ids])).logits[0]
    tokens = {t: ids[t] for t in range(p + 1, len(ids))}
    for t in range(p + 1, len(ids), every):
        tokens[t] = int(logits[t - 1].topk(2).indices[1])
    return ScriptedDrafter(tokens)


def _naive_filter(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Tempered logits, -inf outside the top-k (by hand: the reference does not use the
    sampler's own filter)."""
    scaled = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = scaled.sort(-1, descending=True).values[..., sampling.top_k - 1 : sampling.top_k]
        scaled = torch.where(scaled >= kth, scaled, torch.full_like(scaled, float("-inf")))
    return scaled


class NaiveCycle(NamedTuple):
    exact: float  # the engine rule's expected tokens, every slot in its accepted-prefix context
    truncated: float  # the product stopped after the first draft that differs from the data
    data_only: float  # stopped before it (that slot's own probability left out)
    a: int  # leading drafts equal to the data
    q: int  # the block
    produced: int  # tokens the greedy replay commits


@torch.no_grad()
def _naive_cycles(target, drafter, ids, p, max_new, block, sampling) -> list[NaiveCycle]:
    """The greedy replay's cycles, each from scratch: the context features by a full tapped
    forward, the drafts from a fresh drafter cache, and every slot's acceptance probability from
    a full target forward over the anchor and the drafts before it (the engine's accepted-prefix
    context). No stop ids."""
    model = target.model
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    out, pos, committed, end = [], p, 1, len(ids)
    while committed < max_new:
        remaining = max_new - committed
        q, cap = min(block, remaining + 1), min(remaining, end - 1 - pos)
        if cap < 1:
            break
        ctx = full_taps(model, torch.tensor([ids[:pos]]))
        last = torch.tensor([ids[pos]])
        drafts = draft_block(drafter, emb, head, last, pos, ctx, drafter.new_cache(), q, q - 1)
        drafts = drafts[0, 1:].tolist()
        a = accepted(drafts, ids[pos + 1 : pos + q])
        logits = model(torch.tensor([ids[: pos + 1] + drafts])).logits[0, pos : pos + q - 1]
        probs = torch.softmax(_naive_filter(logits, sampling), -1)
        reach = torch.cumprod(probs.gather(-1, torch.tensor(drafts)[:, None])[:, 0], 0).tolist()
        terms = reach[: cap - 1]  # the k-th draft adds the (k+1)-th token, under the cap
        produced = min(a + 1, cap)
        out.append(
            NaiveCycle(
                1.0 + sum(terms), 1.0 + sum(terms[: a + 1]), 1.0 + sum(terms[:a]), a, q, produced
            )
        )
        committed, pos = committed + produced, pos + produced
    return out


def _against_naive(
    target, drafter, seqs, sampling, max_new=24
) -> tuple[list[float], list[NaiveCycle]]:
    """tau_sim's per-cycle values at `sampling` and the naive cycles, checked equal where they
    must be: the greedy trajectory, each value the naive truncated one, tau their aggregation,
    and never above the engine's exact expectation."""
    got = TauSim(target, seqs, sampling).run(drafter, max_new, 8, progress=False)
    naive = [_naive_cycles(target, drafter, ids, p, max_new, 8, sampling) for _, ids, p in seqs]
    assert got.committed == [[c.produced for c in r] for r in naive]
    values = [v for r in got.acceptance_lengths for v in r]
    cycles = [c for r in naive for c in r]
    torch.testing.assert_close(values, [c.truncated for c in cycles], rtol=1e-4, atol=1e-5)
    per = [sum(c.truncated for c in r) / len(r) for r in naive if r]
    assert got.tau == pytest.approx(sum(per) / len(per), rel=1e-4)
    assert all(v <= c.exact + 1e-5 for v, c in zip(values, cycles))  # a lower bound
    return values, cycles


@pytest.mark.parametrize("temperature, top_k", [(0.4, 0), (1.0, 4)])
def test_sampled_tau_sim_is_the_engine_rule_on_the_data_context(temperature, top_k):
    """At T > 0 a cycle's value is 1 + sum_k prod_{j<=k} p_j(d_j) with the target's sampled
    probabilities (tempered, top-k filtered), the product stopped after the first draft that
    differs from the data: a naive reference that runs the target's full forward at every cycle
    gives the same, and its exact expectation is never below it. A trained drafter; the
    responses (24 tokens) clipped by max_new_tokens (17) or running out first (40)."""
    target, drafter, seqs = _partial_setup()
    sampling = SamplingConfig(temperature=temperature, top_k=top_k)
    for max_new in (17, 40):
        _against_naive(target, drafter, seqs, sampling, max_new)
    values, cycles = _against_naive(target, drafter, seqs, sampling)
    # cycles that accept some drafts and reject others, and values that are no integers
    assert any(0 < c.a < c.q - 1 for c in cycles)
    assert any(1.05 < v < 7.5 and abs(v - round(v)) > 0.05 for v in values)


def test_sampled_tau_sim_ends_with_the_data():
    """A response that runs out of data ends at its last known token, at T > 0 too: a drafter
    that drafts the data (but the first draft) reaches the data's end in a cycle with fewer
    data tokens left than drafts; that cycle produces at most the tokens left."""
    target, _, seqs = _partial_setup()
    for key, ids, p in seqs:
        drafter = _second_choice_drafter(target, ids, p, every=len(ids))
        values, cycles = _against_naive(
            target, drafter, [(key, ids, p)], SamplingConfig(temperature=0.4), 40
        )
        last = cycles[-1]  # every data token left accepted, fewer than the drafts
        assert last.a == last.produced == len(ids) - 1 - p - sum(c.produced for c in cycles[:-1])
        assert last.a < last.q - 1
        assert 1.5 < values[-1] < last.produced


@pytest.mark.parametrize("every, counted, dropped", [(1, 0.2, 0.02), (2, 0.1, 5e-4)])
def test_sampled_tau_sim_counts_the_first_differing_draft_and_stops_there(every, counted, dropped):
    """Drafts that differ from the data where the target often accepts them (its second choice,
    T = 0.7): that slot's probability (its context is still the data) is in the value (it adds
    more than `counted` somewhere), the later slots' (their context holds the draft) are not,
    and the engine's exact expectation, which counts them, is above it (by more than `dropped`
    somewhere)."""
    target, _, seqs = _partial_setup()
    sampling = SamplingConfig(temperature=0.7)
    for key, ids, p in seqs:
        drafter = _second_choice_drafter(target, ids, p, every)
        values, cycles = _against_naive(target, drafter, [(key, ids, p)], sampling)
        assert max(c.truncated - c.data_only for c in cycles) > counted
        assert max(c.exact - v for v, c in zip(values, cycles)) > dropped


def test_sampled_tau_sim_tends_to_the_greedy_one():
    """T -> 0: each draft's probability tends to 1 where it is the data token (the target's
    argmax) and to 0 elsewhere, so the expected tokens are the greedy replay's."""
    target, drafter, seqs = _partial_setup()
    greedy = TauSim(target, seqs).run(drafter, 24, 8, progress=False)
    cold = TauSim(target, seqs, SamplingConfig(temperature=1e-4)).run(
        drafter, 24, 8, progress=False
    )
    assert any(1 < n < 8 for r in greedy.acceptance_lengths for n in r)  # partial acceptances
    assert cold.committed == greedy.acceptance_lengths
    for c, g in zip(cold.acceptance_lengths, greedy.acceptance_lengths):
        torch.testing.assert_close(list(c), [float(n) for n in g], rtol=0, atol=1e-6)
    assert cold.tau == pytest.approx(greedy.tau, abs=1e-6)


def test_expected_produced_caps_and_stops_like_the_loop():
    """By hand: drafts accepted with probability 1/2 each (given the ones before)."""
    half = [0.5, 0.5, 0.5]
    assert expected_produced(half, [5, 6, 7], 8, set()) == 1 + 0.5 + 0.25 + 0.125
    assert expected_produced(half, [5, 6, 7], 3, set()) == 1 + 0.5 + 0.25  # at most 3 tokens
    assert expected_produced(half, [5, 6, 7], 1, set()) == 1.0
    # an accepted stop id ends the cycle: no token after it
    assert expected_produced(half, [5, 6, 7], 8, {6}) == 1 + 0.5
    assert expected_produced(half, [6, 5, 7], 8, {6}) == 1.0


def test_sampled_tau_sim_predicts_the_loops_sampled_first_cycle():
    """The loop at T = 0.4 over many seeds, on the seeds whose sampled first token is the data's
    (the cycle then starts where tau_sim's does): its first cycle's mean acceptance is tau_sim's
    value there. The drafts that cycle counts all follow the data, so the value is exact, not a
    bound."""
    target, drafter, _, seqs = _setup()
    key, ids, p = seqs[1]
    sampling = SamplingConfig(temperature=0.4)
    sim = TauSim(target, [seqs[1]], sampling).run(drafter, 8, 8, progress=False)
    # 7 tokens at most: drafts 1..6 count (the 7th would add an 8th), all equal to the data
    assert sim.committed == [[7]]
    want = sim.acceptance_lengths[0][0]
    assert 1.5 < want < 6.5  # drafts accepted often and rejected often
    firsts = []
    with torch.no_grad():
        for seed in range(300):
            r = decode(target, [ids[:p]], 8, sampling, seeds=[seed], stop_ids=(),
                       drafter=drafter, block_size=8)[0]  # fmt: skip
            if r.tokens[0] == ids[p]:
                firsts.append(r.acceptance_lengths[0])
    n = len(firsts)
    assert n > 100
    mean = sum(firsts) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in firsts) / (n - 1) / n)
    assert abs(mean - want) < 4 * se, (mean, want, se)


def test_training_evaluation_replays_and_decodes_at_eval_sampling(tmp_path, monkeypatch):
    """eval.sampling reaches both halves of training's evaluation: the project loop decodes at
    it (measured tau) and tau_sim replays by the engine's rule at it, so their gap compares
    like with like."""
    import threading

    import tiny
    from dflash_trainer.eval import engines
    from dflash_trainer.run.build import build_drafter
    from dflash_trainer.run.evaluation import PeriodicEval

    cfg = tiny.tiny_config(tmp_path, **{"eval.max_new_tokens": 6})
    cfg.eval.sampling.temperature = 0.7
    target, decoded_at = tiny.tiny_target(), []
    real = engines.evaluate
    monkeypatch.setattr(
        engines, "evaluate", lambda *a, **k: decoded_at.append(k["sampling"]) or real(*a, **k)
    )
    drafter = build_drafter(cfg, target, "cpu")
    ev = PeriodicEval(cfg, target, drafter, tiny.tiny_dataset(n=8), tmp_path, threading.Lock())
    rec = ev.final(0)
    assert decoded_at == [cfg.eval.sampling]
    examples = [(e.id, e.ids, len(e.prompt)) for e in ev.report]
    want = TauSim(target, examples, cfg.eval.sampling).run(drafter, 6, 4, progress=False)
    greedy = TauSim(target, examples).run(drafter, 6, 4, progress=False)
    assert rec["eval/tau_sim"] == pytest.approx(want.tau)
    assert want.tau != pytest.approx(greedy.tau)  # the sampled rule, not the greedy one
