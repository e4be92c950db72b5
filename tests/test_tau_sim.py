"""eval/tau_sim predicts measured tau: the draft-verify loop replayed on the target's own greedy
responses, aggregated like tau (per response, then over responses)."""

from __future__ import annotations

import functools

import pytest
import torch

from dflash_trainer.eval.evaluation import evaluate
from dflash_trainer.eval.tau_sim import TauSim, simulate_response
from test_specdecode import _trained_drafter, ar_generate, random_prompt, side, tiny_target

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
    assert simulate_response(drafter, *_heads(target), feats, ids, p, 24, 8, [ids[p]]) == []


def _heads(target):
    return target.embed_weight, target.lm_head
