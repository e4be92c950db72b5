"""DFlash2's objective (SelectorLoss in models/variants/dflash2.py) against a naive per-slot
loop, its metrics at the neutral start, and a short training run through the real `train()`
path with variant=dflash2 that learns and exports a DFlash2DraftModel the reference package
loads."""

import json

import pytest
import torch
import torch.nn.functional as F

from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter
from dflash_trainer.models.variants.dflash2 import SelectorLoss
from dflash_trainer.run import train
from dflash_trainer.train.objective import DFlashObjective
from tiny import tiny_config, tiny_dataset, tiny_target

H, V, BS, N, S, TOPK = 32, 64, 4, 5, 20, 6


def _setup(seed=0, randomise=True, V=V):
    torch.manual_seed(seed)
    cfg = DFlashConfig(
        hidden_size=H,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        block_size=BS,
        target_layer_ids=[0, 1],
        num_target_layers=4,
        mask_token_id=V - 1,
        vocab_size=V,
        init_std=0.2,
        variant="dflash2",
        options=dict(conv_group_size=8, selector_rank=8, selector_top_k=TOPK),
    )
    d = DFlashDrafter(cfg)
    if randomise:
        with torch.no_grad():
            for n, p in d.named_parameters():
                if "candidate_selector" in n:
                    p.normal_(0, 0.5)
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V - 1, (2, S), generator=g)
    mask = torch.ones(2, S, dtype=torch.long)
    mask[:, :3] = 0
    feats = torch.randn(2, S, 2 * H, generator=g)
    embed = torch.randn(V, H, generator=g)
    obj = DFlashObjective(BS, N, mask_token_id=V - 1, chunk_blocks=2, extra_terms=SelectorLoss())
    return d, head, ids, mask, feats, embed, obj


def _naive_selector_loss(d, head, hidden, labels, valid, gamma):
    """Per block and slot, in Python: the label's k-way CE among the unary top-k (the label
    replacing the weakest when absent), the true previous token as predecessor."""
    sel = d.candidate_selector
    num = den = 0.0
    for b in range(labels.shape[0]):
        for j in range(labels.shape[1]):
            for k in range(1, BS):
                if not valid[b, j, k]:
                    continue
                h = hidden[b, j * BS + k]
                logits = head(h)
                cand = torch.topk(logits, TOPK).indices.tolist()
                lab = int(labels[b, j, k])
                if lab not in cand:
                    cand[-1] = lab
                cand_t = torch.tensor(cand)
                prev = labels[b, j, k - 1]
                pair = sel.predecessor_codebook[prev] * sel.hidden_projection(h)
                scores = logits[cand_t] + sel.successor_codebook[cand_t] @ pair
                ce = F.cross_entropy(scores[None], torch.tensor([cand.index(lab)]))
                w = torch.exp(torch.tensor(-(k - 1) / gamma))
                num, den = num + w * ce, den + w
    return num / den


def test_selector_loss_matches_a_naive_loop():
    d, head, ids, mask, feats, embed, obj = _setup()
    gen = torch.Generator().manual_seed(4)
    out = obj(d, embed, head, feats, ids, mask, generator=gen)
    m = dict(zip(out.metric_names, out.metrics.tolist()))
    # the same anchors again, to rebuild what the objective saw
    gen = torch.Generator().manual_seed(4)
    anchors, bv = obj.sample_anchors(mask, gen)
    blocks = obj.build_blocks(ids, anchors, bv)
    with torch.no_grad():
        hidden = d(F.embedding(blocks.view(2, -1), embed), feats, anchors, bv)
    labels, valid = obj.build_labels(ids, mask, anchors, bv)
    want = _naive_selector_loss(d, head, hidden, labels, valid, obj.gamma)
    assert m["sel_loss"] == pytest.approx(float(want.detach()), rel=1e-5)
    assert m["loss"] + m["sel_loss"] == pytest.approx(float(out.loss.detach()), rel=1e-5)
    out.loss.backward()  # the selector gets gradients from its loss
    assert d.candidate_selector.hidden_projection.weight.grad.abs().sum() > 0


def test_at_the_neutral_start_the_walk_is_argmax():
    """Selector pairwise term 0 (the neutral start): the teacher-forced selector accuracy where
    the label is a candidate is the plain top-1 accuracy, and the walk accepts what argmax does."""
    # a vocabulary of 8 so that random drafts are right often enough to compare
    d, head, ids, mask, feats, embed, obj = _setup(randomise=False, V=8)
    out = obj(d, embed, head, feats, ids, mask, generator=torch.Generator().manual_seed(4))
    m = dict(zip(out.metric_names, out.metrics.tolist()))
    assert m["acc"] > 0 and m["accept_len"] > 1 and 0 < m["recall_k"] < 1, m
    assert m["sel_acc"] == pytest.approx(m["acc"])
    assert m["walk_accept_len"] == pytest.approx(m["accept_len"])


def test_variant_dflash2_trains_and_exports(tmp_path):
    over = {
        "optim.epochs": 6,
        "drafter.variant": "dflash2",
        "drafter.conv_group_size": 16,
        "drafter.selector_rank": 16,
        "drafter.selector_top_k": 8,
    }
    res = train(tiny_config(tmp_path, **over), target=tiny_target(), train_set=tiny_dataset())
    losses = [m["loss"] for _, m in res.history]
    sel = [m["sel_loss"] for _, m in res.history]
    assert res.steps == len(losses) > 10
    assert sum(losses[-3:]) < 0.9 * sum(losses[:3]), losses
    assert sum(sel[-3:]) < 0.9 * sum(sel[:3]), sel
    assert "walk_accept_len" in res.history[-1][1]
    cfg = json.loads((res.export_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    ref = pytest.importorskip("dflash.model")
    m = ref.DFlash2DraftModel.from_pretrained(str(res.export_dir), dtype=torch.float32)
    assert m.candidate_selector.top_k == 8


def test_init_from_a_dflash_export_with_variant_dflash2_starts_neutral(tmp_path):
    """drafter.init_from=<DFlash export> with drafter.variant=dflash2 (models/init_target.py):
    the DFlash2 drafter computes exactly what the export computes, and drafts what it drafts."""
    from dflash_trainer.models.export import load_drafter
    from dflash_trainer.models.init_target import warm_start

    target = tiny_target()
    res = train(
        tiny_config(tmp_path / "a", **{"optim.epochs": 1}), target=target, train_set=tiny_dataset()
    )
    cfg = tiny_config(
        tmp_path / "b", **{"drafter.variant": "dflash2", "drafter.init_from": str(res.export_dir)}
    )
    d2 = warm_start(res.export_dir, cfg.drafter, target)
    pub = load_drafter(res.export_dir)
    assert d2.config.variant == "dflash2" and pub.config.variant == "dflash"
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 7, pub.fc.weight.shape[1], generator=g)
    block = torch.randn(1, 4, pub.config.hidden_size, generator=g)
    with torch.no_grad():
        want = pub.forward_infer(block, feats, pub.new_cache(), 7)
        got = d2.forward_infer(block, feats, d2.new_cache(), 7)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        head = target.lm_head
        anchor = torch.tensor([5])
        torch.testing.assert_close(
            d2.propose(got[:, 1:], head, anchor), pub.propose(want[:, 1:], head, anchor)
        )
