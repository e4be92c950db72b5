"""On-policy anchors (objective.anchors; train/anchor_policy.py): the next starts a training step
records are where the decode loop's drafting would start its next block, the sampler draws the
remembered positions it is given, and the memory is part of an exact resume."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_trainer.config import ConfigError, anchor_share
from dflash_trainer.decode.draft import accepted, draft_block
from dflash_trainer.train.anchor_policy import AnchorPolicy
from dflash_trainer.train.objective import DFlashObjective
from test_specdecode import _real_drafter, side, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

BS, K = 8, 5  # block size; scored slots (objective.loss_slots)


def _drafts(target, drafter, ids: list[int], p: int) -> list[int]:
    """The decode loop's drafts (decode/draft.py) for a block starting at p of `ids`."""
    feats = target.features(torch.tensor([ids]))
    block = draft_block(
        drafter, target.embed_weight, target.lm_head, torch.tensor([ids[p]]), p,
        feats[:, :p], drafter.new_cache(), BS, BS - 1,
    )  # fmt: skip
    return block[0, 1:].tolist()


def _sequence_with_known_acceptance(target, drafter, anchors, accepts, length=72, seed=0):
    """Token ids whose drafts, replayed by the decode loop from each anchor p_i, are right for
    exactly accepts[i] leading slots: left to right, the drafts at p_i are written after it and
    the next token made wrong (a causal target: what follows p_i never changes its drafts)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 120, (length,), generator=g).tolist()
    for p, a in zip(anchors, accepts):
        d = _drafts(target, drafter, ids, p)
        ids[p + 1 : p + 1 + a] = d[:a]
        ids[p + 1 + a] = (d[a] + 1) % 120  # a wrong token: the first rejected slot
    for p, a in zip(anchors, accepts):  # the construction holds for every anchor at the end
        assert accepted(_drafts(target, drafter, ids, p)[:K], ids[p + 1 : p + 1 + K]) == a
    return ids


def test_next_starts_are_where_the_decode_loop_starts_its_next_block():
    """A training step's next starts (p + accepted + 1, where a scored slot was rejected) equal
    a naive replay of the decode loop's drafting at the same anchors; a block right on every
    scored slot has none. The anchors are forced through the on-policy sampler (share 1)."""
    model = tiny_target("llama", seed=5)
    target, drafter = side(model), _real_drafter(model, block_size=BS)
    anchors, accepts = [10, 22, 34, 46, 58], [0, 2, 4, K, 3]
    ids = _sequence_with_known_acceptance(target, drafter, anchors, accepts)
    x = torch.tensor([ids])
    loss_mask = torch.zeros_like(x, dtype=torch.bool)
    loss_mask[:, 8:] = True
    obj = DFlashObjective(
        BS, len(anchors), mask_token_id=drafter.config.mask_token_id, loss_slots=K
    )
    preferred = torch.tensor([anchors + [-1, 3]])  # -1: none; 3 is a prompt token: not an anchor
    with torch.no_grad():
        out = obj(
            drafter, target.embed_weight, target.lm_head, target.features(x), x, loss_mask,
            torch.Generator().manual_seed(0), preferred=preferred,
            preferred_count=len(anchors), want_next_starts=True,
        )  # fmt: skip
    naive = [p + a + 1 if a < K else -1 for p, a in zip(anchors, accepts)]
    assert out.next_starts is not None
    assert out.next_starts[0].tolist() == naive


def test_the_sampler_draws_the_preferred_positions_it_is_given():
    """Up to preferred_count of a row's valid preferred positions, each equally likely (against
    the count a naive draw gives), the rest of the row uniformly; no duplicates; with none
    preferred the draw is the uniform one, bit for bit."""
    obj = DFlashObjective(BS, 6)
    B, S = 1, 40
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[:, 10:] = True  # valid anchors: 10..38
    preferred = torch.tensor([[12, 20, 20, 30, 5, -1, 39]])  # 20 twice; 5 prompt, 39 last
    usable = {12, 20, 30}
    counts = torch.zeros(S)
    trials = 3000
    g = torch.Generator().manual_seed(1)
    for _ in range(trials):
        a, v = obj.sample_anchors(mask, g, 6, preferred, preferred_count=2)
        got = a[0][v[0]].tolist()
        assert len(got) == len(set(got)) == 6 and all(10 <= p <= 38 for p in got)
        assert len(usable & set(got)) >= 2
        counts[a[0][v[0]]] += 1
    # each usable preferred position is drawn by the preferred draw (2 of 3) or else by the
    # uniform draw of the other 4 among the 27 remaining valid positions
    p_pref = 2 / 3 + (1 / 3) * 4 / 27
    for p in usable:
        assert counts[p] / trials == pytest.approx(p_pref, abs=0.03)
    others = [p for p in range(10, 39) if p not in usable]
    assert (counts[others] / trials).mean().item() == pytest.approx(4 / 27, abs=0.02)
    plain = obj.sample_anchors(mask, torch.Generator().manual_seed(3), 6)
    none = obj.sample_anchors(mask, torch.Generator().manual_seed(3), 6, None, 0)
    assert torch.equal(plain[0], none[0]) and torch.equal(plain[1], none[1])


def test_the_memory_keeps_a_samples_next_starts_and_round_trips():
    pol = AnchorPolicy(0.5, num_anchors=6, num_samples=4, device="cpu")
    assert pol.preferred_count(6) == 3 and pol.preferred_count(1) == 1
    ns = torch.tensor([[-1, 7, 9, -1, 11, 13], [-1] * 6])
    pol.record(pol.rows(torch.tensor([2, 0])), ns, torch.Generator().manual_seed(0))
    kept = pol.preferred(pol.rows(torch.tensor([2, 0, 1])))
    assert sorted(p for p in kept[0].tolist() if p >= 0) == [7, 9, 11, 13]
    assert kept[1].tolist() == kept[2].tolist() == [-1] * 6
    again = AnchorPolicy(0.5, num_anchors=6, num_samples=4, device="cpu")
    again.load_state_dict(pol.state_dict())
    assert torch.equal(again.positions, pol.positions)
    with pytest.raises(ValueError, match="same data"):
        AnchorPolicy(0.5, 6, 5, "cpu").load_state_dict(pol.state_dict())


@pytest.mark.parametrize(
    "spec,share", [("random", 0.0), ("on_policy", 1.0), ("mixed:0.25", 0.25), ("mixed:1", 1.0)]
)
def test_anchor_specs(spec, share):
    assert anchor_share(spec) == share


@pytest.mark.parametrize("spec", ["mixed", "mixed:0", "mixed:1.5", "mixed:x", "policy"])
def test_a_bad_anchor_spec_names_the_forms(spec):
    with pytest.raises(ConfigError, match="random, on_policy or mixed:P"):
        anchor_share(spec)


def test_preferred_positions_change_the_loss_only_through_the_anchors():
    """With preferred positions the step trains on blocks at those anchors: its loss equals the
    plain objective's on the same anchors (the sampler is the only difference)."""
    model = tiny_target("llama", seed=5)
    target, drafter = side(model), _real_drafter(model, block_size=BS)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 120, (2, 40), generator=g)
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[:, 6:] = True
    obj = DFlashObjective(BS, 4, mask_token_id=drafter.config.mask_token_id)
    feats = target.features(x)
    pref = torch.tensor([[7, 15, 23, 31], [9, 17, 25, 33]])
    with torch.no_grad():
        a = obj(drafter, target.embed_weight, target.lm_head, feats, x, mask,
                torch.Generator().manual_seed(1), preferred=pref, preferred_count=4)  # fmt: skip
        forced = obj.sample_anchors(mask, torch.Generator().manual_seed(1), 4, pref, 4)
    assert forced[0].tolist() == pref.tolist()  # every preferred position drawn, sorted

    class Fixed(DFlashObjective):
        def sample_anchors(self, *args, **kw):
            return forced

    b_obj = Fixed(BS, 4, mask_token_id=drafter.config.mask_token_id)
    with torch.no_grad():
        b = b_obj(drafter, target.embed_weight, target.lm_head, feats, x, mask)
    torch.testing.assert_close(a.loss, b.loss)
    assert F.mse_loss(a.metrics, b.metrics) == 0


@pytest.mark.parametrize("spec", ["mixed:0.5", "on_policy"])
def test_on_policy_anchors_still_memorise(spec):
    """test_specdecode's memorisation through the training objective (three continuations,
    300 steps, tau ~7.7 of 8 with random anchors), with the memory of next starts fed back
    step after step: learning is not broken, the inference loop accepts nearly whole blocks."""
    from test_specdecode import V, greedy_continuations, run_spec

    model = tiny_target("llama", seed=3)
    g = torch.Generator().manual_seed(5)
    data = greedy_continuations(model, g)
    drafter = _real_drafter(model, block_size=BS, seed=2).train()
    obj = DFlashObjective(BS, num_anchors=12, mask_token_id=V - 1)
    policy = AnchorPolicy(anchor_share(spec), 12, len(data), "cpu")
    emb = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().requires_grad_(False)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    used = 0
    for step in range(300):
        i = step % len(data)
        _, s, mask, feats = data[i]
        sid = policy.rows(torch.tensor([i]))
        pref = policy.preferred(sid)
        used += int((pref >= 0).sum())
        out = obj(drafter, emb, head, feats, s, mask, g, preferred=pref,
                  preferred_count=policy.preferred_count(12), want_next_starts=True)  # fmt: skip
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        policy.record(sid, out.next_starts, g)
    drafter.eval()
    taus = [run_spec(model, drafter, ids, 24, BS, lm_head=head).tau for ids, *_ in data]
    assert used > 0  # the memory fed the sampler
    assert min(taus) > 6.5, taus


def test_a_run_with_on_policy_anchors_resumes_exactly(tmp_path):
    """SIGTERM at step 9 of three epochs, then resume: the memory of next starts is in the
    checkpoint, so the resumed run trains the uninterrupted run's losses, step for step."""
    from dflash_trainer.run import train
    from test_pipeline import assert_resumed_exactly
    from tiny import tiny_config, tiny_dataset
    from tiny import tiny_target as tiny_run_target

    over = {"optim.epochs": 3, "objective.anchors": "mixed:0.5"}

    def run(path, **more):
        cfg = tiny_config(path, **over, **more)
        return train(cfg, target=tiny_run_target(), train_set=tiny_dataset())

    full = run(tmp_path / "full")
    part = run(tmp_path / "run2", **{"pipeline.fault": "drafter:9:sigterm"})
    assert part.reason == "signal" and 9 <= part.steps < full.steps
    res = run(tmp_path / "run2", **{"checkpoint.resume": True})
    assert_resumed_exactly(full, res, first=part.steps + 1)
