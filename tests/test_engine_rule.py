"""Acceptance at temperature > 0 by the serving engine's rule.

vLLM (0.32, `rejection_sampler.py`, the default `draft_sample_method = "greedy"`) drafts each
slot's argmax and has no draft probabilities: it accepts draft x_j with probability p_j(x_j), the
target's tempered probability at that slot given the accepted prefix, and on a rejection samples
the recovered token from p_j with x_j removed. The project's loop drafts the same argmax and
accepts x_j when the target's own sample at that slot equals it: the sample equals x_j with
probability p_j(x_j), and when it does not it is distributed as p_j with x_j removed. So both give
the same law of accepted lengths and tokens. Here the loop's first-cycle acceptance over many
seeds is held against the engine rule's expectation computed from the target's probabilities,
1 + sum_k prod_{j<=k} p_j(x_j), on the drafts the loop made.
"""

import math

import pytest
import torch

from dflash_trainer.config import SamplingConfig
from dflash_trainer.decode import loop as decode_loop
from dflash_trainer.decode.loop import decode
from test_specdecode import _trained_drafter, random_prompt, side, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

# T: where this tiny target's tempered distribution leaves its drafts accepted in about half
# the slots (at 0.7 its 128-way distribution is flat: expected acceptance 1.3)
T, BS, RUNS = 0.4, 8, 400


def test_the_loops_sampled_acceptance_is_the_engines_rule(monkeypatch):
    model = tiny_target("llama", seed=6)
    g = torch.Generator().manual_seed(12)
    prompts = [random_prompt(g) for _ in range(4)]
    drafter = _trained_drafter(model, prompts, block_size=BS)
    target = side(model)
    target.embed_weight = model.get_input_embeddings().weight
    target.lm_head = model.get_output_embeddings()
    prompt = prompts[0][0].tolist()

    first_block: list[torch.Tensor] = []
    draft_block = decode_loop.draft_block

    def recording(*args, **kwargs):
        block = draft_block(*args, **kwargs)
        if not first_block:
            first_block.append(block[0].clone())
        return block

    monkeypatch.setattr(decode_loop, "draft_block", recording)
    measured, expected, drafts = [], [], {}
    with torch.no_grad():
        for seed in range(RUNS):
            first_block.clear()
            r = decode(
                target, [prompt], 3 * BS, SamplingConfig(temperature=T), seeds=[seed], stop_ids=(),
                drafter=drafter, block_size=BS,
            )[0]  # fmt: skip
            measured.append(r.acceptance_lengths[0])
            # the engine rule on the same drafts: the target's tempered probabilities of each
            # draft given the prompt, the committed first token and the drafts before it
            block = first_block[0]  # [anchor, x_1 .. x_k]
            # drafts are the drafter's argmax whatever T (vLLM's draft_sample_method "greedy"):
            # the same anchor always gets the same drafts
            assert drafts.setdefault(int(block[0]), block.tolist()) == block.tolist()
            ids = torch.tensor([prompt + block.tolist()])
            logits = model(input_ids=ids).logits[0, len(prompt) : len(prompt) + len(block) - 1]
            p = torch.softmax(logits.float() / T, -1)
            p_draft = p.gather(-1, block[1:, None])[:, 0]
            expected.append(1.0 + float(torch.cumprod(p_draft, 0).sum()))
    n = len(measured)
    mean_m, mean_e = sum(measured) / n, sum(expected) / n
    var = sum((x - mean_m) ** 2 for x in measured) / (n - 1)
    se = math.sqrt(var / n)
    assert 1.3 < mean_e < BS - 0.5, mean_e  # drafts accepted often and rejected often
    assert len(drafts) > 1  # the sampled first token (the anchor) varied
    assert abs(mean_m - mean_e) < 4 * se, (mean_m, mean_e, se)
