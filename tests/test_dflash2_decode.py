"""DFlash2 in the project's one decode loop and in tau_sim: the selector walk drafts there
(`DFlashDrafter.propose`, called by decode/draft.draft_block), token for token as the published
reference loop `dflash_generate` drafts with `DFlash2DraftModel` on the same export; and
tau_sim replays that same walk.

The drafter: a DFlash drafter trained on the target's own continuations (tests/test_specdecode),
warm-started as DFlash2 and moved off its identity start (convolutions and selector random), so
the walk picks other tokens than the LM head's argmax in some slots. A loop that drafted by
argmax, or a reference that loaded the export without its DFlash2 parts, would differ."""

from __future__ import annotations

import functools

import pytest
import torch

from decoding import spec_generate
from dflash_trainer.decode.loop import GenResult
from dflash_trainer.eval.evaluation import evaluate
from dflash_trainer.eval.metrics import summarize
from dflash_trainer.eval.tau_sim import TauSim
from dflash_trainer.models.drafter import convert_variant
from dflash_trainer.models.export import export_drafter
from test_specdecode import _trained_drafter, ar_generate, random_prompt, side, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

DFLASH2 = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4)


def _off_identity(drafter, conv_scale=0.02, selector_scale=0.3, seed=0):
    """Random convolution deltas and a random selector: the pairwise term reaches the size of
    the logits' gaps, so the walk differs from argmax in some slots, while drafts are still
    accepted often enough to compare accepted lengths (measured: tau 2.7-6.3 at block 8)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            if "conv" in n:
                p.add_(torch.randn(p.shape, generator=g) * conv_scale)
            elif "candidate_selector" in n:
                p.copy_(torch.randn(p.shape, generator=g) * selector_scale)
    return drafter.eval()


class WalkSpy:
    """Counts the drafted slots where the drafter's `propose` differs from the LM head's argmax
    (so a test can tell that the walk, not argmax, drafted)."""

    def __init__(self, drafter):
        self.differ = self.slots = 0
        self.propose = drafter.propose
        drafter.propose = self

    def __call__(self, hidden, lm_head, anchor_ids, *args, **kwargs):
        out = self.propose(hidden, lm_head, anchor_ids, *args, **kwargs)
        argmax = lm_head(hidden.reshape(-1, hidden.shape[-1])).argmax(-1).view(out.shape)
        self.differ += int((out != argmax).sum())
        self.slots += out.numel()
        return out


@functools.cache
def _setup(kind="llama"):
    model = tiny_target(kind, seed=6)
    g = torch.Generator().manual_seed(12)
    prompts = [random_prompt(g) for _ in range(4)]
    d1 = _trained_drafter(model, prompts)
    return model, prompts, d1


def _dflash2(d1):
    return _off_identity(convert_variant(d1, "dflash2", DFLASH2))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_loop_matches_reference_dflash_generate(kind, tmp_path, monkeypatch):
    """The DFlash2 export in the reference loop and the drafter in ours, same target, greedy,
    fp32: identical tokens and per-cycle acceptance lengths; the walk changed some drafts."""
    ref = pytest.importorskip("dflash.model")
    import time

    from dflash_trainer.eval.reference import ReferenceLoop, reference_class

    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # return_stats syncs CUDA otherwise
    model, prompts, d1 = _setup(kind)
    drafter = _dflash2(d1)
    out = export_drafter(drafter, tmp_path / "export")
    assert reference_class(ref, out) is ref.DFlash2DraftModel
    ref_model = ref.DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    spy = WalkSpy(drafter)
    t = side(model)
    g = torch.Generator().manual_seed(3)
    ours_all, ref_all = [], []
    for i, ids in enumerate(prompts):
        for bs in (4, 8):
            stop = [int(torch.randint(1, 127, (1,), generator=g))] if i % 2 else None
            r = ref.dflash_generate(
                ref_model, model, ids, 20, stop, block_size=bs, return_stats=True
            )
            ours = spec_generate(
                model, t.layer_ids, t.embed_weight, t.lm_head, drafter, ids, 20, bs,
                stop_ids=stop or (),
            )  # fmt: skip
            assert ours.tokens == r.output_ids[0, ids.shape[1] :].tolist()
            lens = [int(x) for x in r.acceptance_lengths]
            assert ours.acceptance_lengths == lens
            ours_all.append(ours)
            ref_all.append(GenResult([], lens, [], []))
    assert spy.differ > 0, "the walk never differed from argmax: the test cannot tell them apart"
    ours_tau = summarize(ours_all, None, 8).tau
    assert ours_tau == summarize(ref_all, None, 8).tau
    assert ours_tau > 1.2  # real acceptances were compared, not only rejections
    # the evaluation's reference engine loads the export as DFlash2 too (eval/reference.py)
    unstopped = [p[0].tolist() for p in prompts[::2]]  # the prompts decoded without stop ids
    got = ReferenceLoop(out, model, progress=False).decode(unstopped, 20, 8).tau
    assert got == summarize(ours_all[1::4], None, 8).tau  # ours on them, block 8


def test_tau_sim_replays_the_walk():
    """tau_sim on the target's greedy answers is the decode loop itself, with the walk: equal
    per-cycle acceptance to the loop with the DFlash2 drafter, and different from the same
    weights drafting by argmax (so it is the walk that tau_sim replays)."""
    model, prompts, d1 = _setup()
    drafter = _dflash2(d1)
    target = side(model)
    seqs = [
        (f"r{i}", p[0].tolist() + ar_generate(model, p, 24).tokens, p.shape[1])
        for i, p in enumerate(prompts)
    ]
    sim = TauSim(target, seqs)
    spy = WalkSpy(drafter)
    measured = evaluate(target, drafter, prompts, 24, 8, baseline=False, warmup=False)
    walk = sim.run(drafter, 24, 8, progress=False)
    assert spy.differ > 0
    assert walk.acceptance_lengths == [r.acceptance_lengths for r in measured.spec_results]
    argmax = _dflash2(d1)
    argmax.candidate_selector = None  # the same weights, drafting by argmax
    assert sim.run(argmax, 24, 8, progress=False).acceptance_lengths != walk.acceptance_lengths
