"""DFlash objective: anchors, same-position labels, weighted CE, chunking, no host sync."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter
from dflash_trainer.train.objective import DFlashObjective, default_gamma

H, NF, BS, V, MASK = 32, 2, 4, 64, 63


def _setup(seed=0):
    torch.manual_seed(seed)
    cfg = DFlashConfig(
        hidden_size=H,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        block_size=BS,
        target_layer_ids=[1, 2],
        num_target_layers=4,
        mask_token_id=MASK,
        vocab_size=V,
        init_std=0.1,
        attention="split",
    )
    drafter = DFlashDrafter(cfg)
    embed = torch.randn(V, H)
    lm_head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    return drafter, embed, lm_head


def _data(B=3, S=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (B, S), generator=g)
    lm = torch.zeros(B, S, dtype=torch.bool)
    lm[0, 5:18] = True  # prompt 0..4, response 5..17, then padding
    lm[1, 3:6] = True  # short response: valid anchors 3, 4 (not 5: 6 is unsupervised)
    lm[1, 9:14] = True  # second assistant turn: anchors 9..12
    # row 2: no supervised token at all (e.g. a padded row)
    feats = torch.randn(B, S, NF * H, generator=g)
    return ids, lm, feats


def test_gamma_defaults():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    assert math.isclose(default_gamma(4), 4 / 2.3)
    w = DFlashObjective(16, 8, 0.0).slot_weights("cpu")
    assert w[0] == 0 and w[1] == 1 and math.isclose(w[8].item(), math.exp(-1.0), rel_tol=1e-6)


def test_anchor_sampling_rules():
    ids, lm, _ = _data()
    obj = DFlashObjective(BS, num_anchors=6)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        anchors, valid = obj.sample_anchors(lm, g)
        assert anchors.shape == valid.shape == (3, 6)
        for b in range(3):
            ok = [p for p in range(19) if lm[b, p] and lm[b, p + 1]]
            got = anchors[b][valid[b]].tolist()
            assert len(got) == min(6, len(ok))
            assert all(lm[b, p] and lm[b, p + 1] for p in got)  # never prompt / last token
            assert got == sorted(set(got))  # sorted, without replacement
            assert valid[b].tolist() == sorted(valid[b].tolist(), reverse=True)  # padding last
    # same generator seed -> same anchors; different seed -> different (row 0 has 12 choices)
    a1 = obj.sample_anchors(lm, torch.Generator().manual_seed(7))[0]
    a2 = obj.sample_anchors(lm, torch.Generator().manual_seed(7))[0]
    a3 = obj.sample_anchors(lm, torch.Generator().manual_seed(8))[0]
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)


def test_anchor_sampling_uniform():
    lm = torch.zeros(1, 12, dtype=torch.bool)
    lm[0, 2:10] = True  # valid anchors 2..8 (7 positions)
    obj = DFlashObjective(BS, num_anchors=3)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(12)
    for _ in range(700):
        a, v = obj.sample_anchors(lm, g)
        counts.index_add_(0, a[0], v[0].float())
    assert counts[:2].sum() == 0 and counts[9:].sum() == 0
    freq = counts[2:9] / 700  # each 3/7 ~ 0.43
    assert (freq - 3 / 7).abs().max() < 0.08


def test_more_anchors_than_positions_pads():
    ids, lm, _ = _data(S=20)
    obj = DFlashObjective(BS, num_anchors=40)  # > S-1 candidate positions
    anchors, valid = obj.sample_anchors(lm, torch.Generator().manual_seed(0))
    assert anchors.shape == (3, 40)
    assert valid.sum(1).tolist() == [12, 6, 0]


def test_blocks_and_same_position_labels():
    ids, lm, _ = _data()
    obj = DFlashObjective(BS, num_anchors=6, mask_token_id=MASK)
    anchors, valid = obj.sample_anchors(lm, torch.Generator().manual_seed(3))
    blocks = obj.build_blocks(ids, anchors, valid)
    labels, lv = obj.build_labels(ids, lm, anchors, valid)
    B, N, S = 3, 6, ids.shape[1]
    for b in range(B):
        for j in range(N):
            a = int(anchors[b, j])
            if valid[b, j]:
                assert blocks[b, j].tolist() == [int(ids[b, a])] + [MASK] * (BS - 1)
            else:
                assert blocks[b, j].tolist() == [MASK] * BS
            for k in range(BS):
                want_valid = bool(valid[b, j]) and k >= 1 and a + k < S and bool(lm[b, a + k])
                assert bool(lv[b, j, k]) == want_valid
                if want_valid:
                    assert labels[b, j, k] == ids[b, a + k]  # same position, not a + k + 1


def _dense_reference(obj, drafter, embed, lm_head, feats, ids, lm, g_seed, t_hidden=None):
    """Naive loop over valid blocks and slots: CE (+ KD against the target's logits at a+k-1,
    plain F.kl_div at temperature T) on slots 1..K = obj.loss_slots, exp-decay weights,
    normalised by the weight sum; plus obj.hidden_weight * the weighted mean over every slot of
    |h - t|^2 / |t|^2, t the target's hidden state at a+k-1; plus obj.reject_weight *
    -log(1 - p(top-1)) on the slots whose top-1 is not the label."""
    lam, T, K = obj.kd_weight, obj.kd_temperature, obj.loss_slots
    anchors, valid = obj.sample_anchors(lm, torch.Generator().manual_seed(g_seed))
    blocks = obj.build_blocks(ids, anchors, valid)
    hidden = drafter(F.embedding(blocks.flatten(1), embed), feats, anchors, valid)
    num, den, hnum, hden = 0.0, 0.0, 0.0, 0.0
    S = ids.shape[1]
    for b in range(ids.shape[0]):
        for j in range(anchors.shape[1]):
            if not valid[b, j]:
                continue
            a = int(anchors[b, j])
            for k in range(1, BS):
                if not (a + k < S and lm[b, a + k]):
                    continue
                w = math.exp(-(k - 1) / obj.gamma)
                h = hidden[b, j * BS + k]
                t = t_hidden[b, a + k - 1] if t_hidden is not None else None
                if obj.hidden_weight > 0:
                    hnum = hnum + w * (h - t).pow(2).sum() / t.pow(2).sum()
                    hden += w
                if k > K:
                    continue
                z = lm_head(h)[None]
                term = F.cross_entropy(z, ids[b, a + k][None])
                if lam > 0:
                    zt = lm_head(t)[None]
                    kl = F.kl_div(
                        F.log_softmax(z / T, -1),
                        F.log_softmax(zt / T, -1),
                        log_target=True,
                        reduction="sum",
                    )
                    term = (1 - lam) * term + lam * T * T * kl
                p = torch.softmax(z[0], -1)
                if obj.reject_weight > 0 and int(p.argmax()) != int(ids[b, a + k]):
                    term = term - obj.reject_weight * torch.log(1 - p.max())
                num = num + w * term
                den += w
    return num / den + (obj.hidden_weight * hnum / hden if hden else 0.0)


def _matches_dense(obj, t_hidden=None, wrap_head=False):
    """Run `obj` on the standard tiny setup and assert its loss and its gradients for every
    drafter parameter equal _dense_reference's. `wrap_head` hides the Linear head in a
    Sequential (the generic head path). Returns the objective's output."""
    drafter, embed, lm_head = _setup()
    ids, lm, feats = _data()
    head = torch.nn.Sequential(lm_head) if wrap_head else lm_head
    out = obj(drafter, embed, head, feats, ids, lm, torch.Generator().manual_seed(5), t_hidden)
    ref = _dense_reference(obj, drafter, embed, lm_head, feats, ids, lm, 5, t_hidden)
    torch.testing.assert_close(out.loss, ref)
    params = list(drafter.parameters())
    for a, b in zip(torch.autograd.grad(out.loss, params), torch.autograd.grad(ref, params)):
        torch.testing.assert_close(a, b)
    return out


def test_loss_matches_naive_reference():
    out = _matches_dense(DFlashObjective(BS, num_anchors=8, mask_token_id=MASK, chunk_blocks=3))
    names = out.metric_names
    assert out.metrics.shape == (len(names),)
    assert out.metrics[names.index("loss")] == out.loss.detach()
    assert out.metrics[names.index("num_blocks")] == 8 + 6 + 0


@pytest.mark.parametrize("chunk,wrap", [(3, False), (0, False), (1, True)])
def test_rejected_proposal_term_matches_dense_reference(chunk, wrap):
    """objective.reject_weight: -log(1 - p(top-1)) where the top-1 is not the label, beside the
    CE, against the naive loop (the hand-written gradient of the Linear-head path and autograd's
    through a wrapped head); its weighted mean is logged, and with the weight at 0 the loss is
    the plain one."""
    obj = DFlashObjective(BS, num_anchors=8, mask_token_id=MASK, chunk_blocks=chunk,
                          reject_weight=0.7)  # fmt: skip
    out = _matches_dense(obj, wrap_head=wrap)
    reject = out.metrics[out.metric_names.index("reject")]
    assert reject > 0  # random drafter: most top-1 proposals are wrong
    plain = _matches_dense(DFlashObjective(BS, 8, mask_token_id=MASK, chunk_blocks=chunk))
    assert out.loss > plain.loss
    with pytest.raises(ValueError, match="kd_weight"):
        DFlashObjective(BS, 8, kd_weight=0.5, reject_weight=0.1)


def test_chunked_equals_unchunked_values_and_grads():
    ids, lm, feats = _data()
    results = []
    for chunk in (1, 4, 1000, 0):  # 0 = auto (memory budget)
        drafter, embed, lm_head = _setup()
        obj = DFlashObjective(BS, num_anchors=6, mask_token_id=MASK, chunk_blocks=chunk)
        out = obj(drafter, embed, lm_head, feats, ids, lm, torch.Generator().manual_seed(1))
        out.loss.backward()
        results.append(
            (out.loss.detach(), out.metrics, [p.grad.clone() for p in drafter.parameters()])
        )
    for loss, metrics, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        torch.testing.assert_close(metrics, results[0][1])
        for a, b in zip(grads, results[0][2]):
            torch.testing.assert_close(a, b)


def test_generic_head_module_matches_linear_fast_path():
    """A non-Linear head goes through autograd; a bias-free Linear through the hand-written
    gradient. Both must agree (value, metrics, grads)."""
    ids, lm, feats = _data()
    res = []
    for wrap in (False, True):
        drafter, embed, lm_head = _setup()
        head = torch.nn.Sequential(lm_head) if wrap else lm_head
        obj = DFlashObjective(BS, num_anchors=6, mask_token_id=MASK, chunk_blocks=4)
        out = obj(drafter, embed, head, feats, ids, lm, torch.Generator().manual_seed(4))
        out.loss.backward()
        res.append((out.loss.detach(), out.metrics, [p.grad for p in drafter.parameters()]))
    torch.testing.assert_close(res[0][0], res[1][0])
    torch.testing.assert_close(res[0][1], res[1][1])
    for a, b in zip(res[0][2], res[1][2]):
        torch.testing.assert_close(a, b)


def test_trainable_lm_head_is_rejected():
    drafter, embed, lm_head = _setup()
    ids, lm, feats = _data()
    obj = DFlashObjective(BS, num_anchors=4, mask_token_id=MASK)
    with pytest.raises(ValueError, match="frozen"):
        obj(drafter, embed, lm_head.requires_grad_(True), feats, ids, lm)


def test_padding_rows_finite_loss_and_grads():
    drafter, embed, lm_head = _setup()
    ids, lm, feats = _data()
    obj = DFlashObjective(BS, num_anchors=8, mask_token_id=MASK)
    out = obj(drafter, embed, lm_head, feats, ids, lm, torch.Generator().manual_seed(0))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(out.metrics).all()
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters())
    # A batch with no supervised token at all: loss 0, grads finite (zero).
    drafter.zero_grad()
    out = obj(
        drafter, embed, lm_head, feats, ids, torch.zeros_like(lm), torch.Generator().manual_seed(0)
    )
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters())


def test_metrics_accuracy_and_acceptance():
    obj = DFlashObjective(BS, num_anchors=3)
    # 1 row, 3 blocks (last is padding); slots 1..3.
    correct = torch.tensor([[[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 1, 1]]]).bool()
    lv = torch.tensor([[[0, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0]]]).bool()
    bv = torch.tensor([[True, True, False]])
    m = dict(zip(obj.metric_names, obj._metrics(torch.tensor(0.5), correct, lv, bv).tolist()))
    assert m["num_label_tokens"] == 5 and m["num_blocks"] == 2
    assert m["acc"] == pytest.approx(3 / 5)
    assert m["acc_1"] == pytest.approx(1 / 2) and m["acc_2"] == pytest.approx(1.0)
    assert m["acc_3"] == pytest.approx(0.0)
    # block 0: slots 1,2 correct, 3 wrong -> 2 + 1; block 1: slot 1 wrong -> 0 + 1.
    assert m["accept_len"] == pytest.approx((3 + 1) / 2)


class _SyncCounter(TorchDispatchMode):
    SYNC_OPS = {
        "aten::_local_scalar_dense",
        "aten::nonzero",
        "aten::is_nonzero",
        "aten::equal",
        "aten::item",
    }

    def __init__(self):
        super().__init__()
        self.hits = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in self.SYNC_OPS:
            self.hits.append(name)
        out = func(*args, **kwargs)
        if name in ("aten::_to_copy", "aten::copy_", "aten::to"):  # device -> host copies
            src = [a for a in args if isinstance(a, torch.Tensor)]
            dst = out if isinstance(out, torch.Tensor) else None
            if (
                src
                and dst is not None
                and src[-1].device != dst.device
                and dst.device.type == "cpu"
            ):
                self.hits.append(f"{name} {src[-1].device}->cpu")
        return out


def test_no_host_sync_in_objective_and_backward():
    drafter, embed, lm_head = _setup()
    ids, lm, feats = _data()
    obj = DFlashObjective(BS, num_anchors=6, mask_token_id=MASK, chunk_blocks=2)
    g = torch.Generator().manual_seed(0)
    counter = _SyncCounter()
    with counter:
        out = obj(drafter, embed, lm_head, feats, ids, lm, g)
        out.loss.backward()
    assert counter.hits == []
    # The counter does see a sync when there is one (the test can fail).
    with counter:
        out.loss.item()
    assert counter.hits


def test_bf16_autocast_close_to_fp32():
    drafter, embed, lm_head = _setup()
    ids, lm, feats = _data()
    obj = DFlashObjective(BS, num_anchors=6, mask_token_id=MASK)
    ref = obj(drafter, embed, lm_head, feats, ids, lm, torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = obj(drafter, embed, lm_head, feats, ids, lm, torch.Generator().manual_seed(2))
    out.loss.backward()
    assert out.loss.dtype == torch.float32
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters())
    torch.testing.assert_close(out.loss, ref.loss.detach(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("autocast", [False, True])
def test_hand_written_linear_ce_matches_autograd(autocast):
    """The in-place CE of the Linear fast path against plain autograd CE on the same logits,
    in fp32 and under bf16 autocast (bf16 logits, upcast by the shift)."""
    from dflash_trainer.train.objective import _linear_ce

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 3, 5, 16, generator=g)
    weight = torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (2, 3, 5), generator=g)
    wm = torch.rand(2, 3, 5, generator=g) * (torch.rand(2, 3, 5, generator=g) > 0.3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hh = h.clone().requires_grad_(True)
        logits = torch.nn.functional.linear(hh, weight)
        ce = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 2), labels.flatten(), reduction="none"
        )
        ref_num = (ce.view_as(wm) * wm).sum()
        (ref_grad,) = torch.autograd.grad(ref_num, hh)
        num, den, correct, _, grad_h = _linear_ce(
            h, weight, labels, wm > 0, lambda ce, valid: wm, need_grad=True
        )
    tol = dict(atol=2e-2, rtol=2e-2) if autocast else {}
    torch.testing.assert_close(den, wm.sum())
    torch.testing.assert_close(num, ref_num.detach(), **tol)
    torch.testing.assert_close(grad_h, ref_grad, **tol)
    assert torch.equal(correct, logits.argmax(dim=-1) == labels)


def test_auto_chunk_is_sized_by_vocab_and_rows():
    from dflash_trainer.train import objective as O

    head = torch.nn.Linear(8, 49152, bias=False)
    # 2^25 fp32 logits per chunk: 1 row x 15 slots -> 45 blocks; 8 rows -> 5; a huge vocab -> 1
    assert O._auto_chunk_blocks(head, 1, 15) == (1 << 25) // (15 * 49152) == 45
    assert O._auto_chunk_blocks(head, 8, 15) == 5
    assert O._auto_chunk_blocks(torch.nn.Linear(8, 1 << 22, bias=False), 8, 15) == 1
    # CUDA: a 2 GiB budget, so each chunk re-reads the head for thousands of rows. Qwen3-8B's
    # 151,936 vocabulary, 8 rows: 29 blocks = 3,480 rows per chunk (CPU budget: 1 block).
    assert O.chunk_blocks_for(151936, "cuda", 8, 15) == 29
    assert O.chunk_blocks_for(151936, "cpu", 8, 15) == 1


# ---------------------------------------------------------------------------------- D-PACE, noise


def test_dpace_weights_hand_computed():
    from dflash_trainer.train.objective import dpace_weights

    q = torch.tensor([[0.8, 0.6, 0.4]])
    ce = -torch.log(q)
    # alpha 0.5: q~ = 0.9, 0.8, 0.7; reach = 0.9, 0.72, 0.504; w_j = sum of reach from j on
    w = dpace_weights(ce, torch.ones(1, 3), alpha=0.5)
    torch.testing.assert_close(w, torch.tensor([[2.124, 1.224, 0.504]]))
    # an invalid last slot passes the product through and gets weight 0
    w = dpace_weights(ce, torch.tensor([[1.0, 1.0, 0.0]]), alpha=0.5)
    torch.testing.assert_close(w, torch.tensor([[1.62, 0.72, 0.0]]))
    # alpha 1: every q~ is 1, w_j = valid slots from j on (uniform acceptance)
    w = dpace_weights(ce, torch.ones(1, 3), alpha=1.0)
    torch.testing.assert_close(w, torch.tensor([[3.0, 2.0, 1.0]]))
    # the floor: a slot the drafter gets badly wrong still leaves alpha of the product
    w = dpace_weights(torch.tensor([[50.0, 0.0]]), torch.ones(1, 2), alpha=0.5)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.5]]))
    with pytest.raises(ValueError, match="dpace_alpha"):
        DFlashObjective(BS, 4, weighting="dpace", dpace_alpha=0.0)


def _dpace_reference(obj, drafter, embed, lm_head, feats, ids, lm, g_seed):
    """Dense D-PACE: full logits, per-slot CE, detached weights from it, weighted mean."""
    from dflash_trainer.train.objective import dpace_weights

    anchors, valid = obj.sample_anchors(lm, torch.Generator().manual_seed(g_seed))
    blocks = obj.build_blocks(ids, anchors, valid)
    hidden = drafter(F.embedding(blocks.flatten(1), embed), feats, anchors, valid)
    labels, label_valid = obj.build_labels(ids, lm, anchors, valid)
    B, N, bs = labels.shape
    logits = lm_head(hidden.view(B, N, bs, -1)[:, :, 1:])
    ce = F.cross_entropy(logits.flatten(0, 2), labels[:, :, 1:].flatten(), reduction="none")
    ce = ce.view(B, N, bs - 1)
    w = dpace_weights(ce.detach(), label_valid[:, :, 1:], obj.dpace_alpha)
    return (w * ce).sum() / w.sum()


@pytest.mark.parametrize("chunk", [1, 3, 0])
def test_dpace_loss_and_grads_match_dense_reference(chunk):
    drafter, embed, lm_head = _setup()
    ids, lm, feats = _data()
    obj = DFlashObjective(
        BS, num_anchors=8, mask_token_id=MASK, chunk_blocks=chunk, weighting="dpace"
    )
    out = obj(drafter, embed, lm_head, feats, ids, lm, torch.Generator().manual_seed(5))
    ref = _dpace_reference(obj, drafter, embed, lm_head, feats, ids, lm, 5)
    torch.testing.assert_close(out.loss, ref)
    params = list(drafter.parameters())
    for a, b in zip(torch.autograd.grad(out.loss, params), torch.autograd.grad(ref, params)):
        torch.testing.assert_close(a, b)
    # and it is not the decay objective under another name
    decay = DFlashObjective(BS, num_anchors=8, mask_token_id=MASK, chunk_blocks=chunk)
    other = decay(drafter, embed, lm_head, feats, ids, lm, torch.Generator().manual_seed(5))
    assert not torch.allclose(other.loss, out.loss)


@pytest.mark.parametrize("chunk", [1, 0])
def test_dpace_without_its_floor_is_the_gradient_of_the_expected_accepted_length(chunk):
    """D-PACE as alpha -> 0 against a dense reference written from the definition of the
    acceptance-direct objective: minus each block's expected accepted length, sum_j prod_{i <=
    j} p(label_i), with autograd. The objective's gradient equals it divided by the (detached)
    weight sum it normalises with."""
    from dflash_trainer.train.objective import dpace_weights

    drafter, embed, lm_head = _setup()
    ids, lm, feats = _data()
    obj = DFlashObjective(
        BS, num_anchors=8, mask_token_id=MASK, chunk_blocks=chunk, weighting="dpace",
        dpace_alpha=1e-9,
    )  # fmt: skip
    out = obj(drafter, embed, lm_head, feats, ids, lm, torch.Generator().manual_seed(5))
    anchors, valid = obj.sample_anchors(lm, torch.Generator().manual_seed(5))
    blocks = obj.build_blocks(ids, anchors, valid)
    hidden = drafter(F.embedding(blocks.flatten(1), embed), feats, anchors, valid)
    labels, label_valid = obj.build_labels(ids, lm, anchors, valid)
    B, N, bs = labels.shape
    logp = torch.log_softmax(lm_head(hidden.view(B, N, bs, -1)[:, :, 1:]), -1)
    q = logp.gather(-1, labels[:, :, 1:, None]).squeeze(-1).exp()
    v = label_valid[:, :, 1:]
    q = torch.where(v, q, torch.ones_like(q))  # a slot without a label passes the product on
    expected = (torch.cumprod(q, -1) * v).sum()  # sum over blocks of E[accepted drafts]
    ce = -logp.gather(-1, labels[:, :, 1:, None]).squeeze(-1)
    w_sum = dpace_weights(ce.detach(), v, 0.0).sum()
    params = list(drafter.parameters())
    got = torch.autograd.grad(out.loss, params)
    want = torch.autograd.grad(-expected / w_sum, params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert expected.item() > 0


def test_feature_noise_is_relative_to_each_tap_and_training_only():
    from dflash_trainer.train.objective import add_feature_noise

    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 400, 2, 16, generator=g)
    base[:, :, 1] *= 100.0  # a deep tap at a much larger scale
    feats = base.reshape(2, 400, 32)
    noisy = add_feature_noise(feats, 0.05, 2, torch.Generator().manual_seed(1))
    delta = (noisy - feats).view(2, 400, 2, 16)
    rms = base.pow(2).mean(-1, keepdim=True).sqrt()
    ratio = (delta / rms).std(dim=(0, 1, 3))  # per tap: noise std relative to the tap's rms
    torch.testing.assert_close(ratio, torch.full((2,), 0.05), atol=4e-3, rtol=0)
    # the objective adds it only when asked, reproducibly from the step's generator
    drafter, embed, lm_head = _setup()
    ids, lm, feats2 = _data()
    plain = DFlashObjective(BS, 6, mask_token_id=MASK)
    noisy_obj = DFlashObjective(BS, 6, mask_token_id=MASK, feature_noise=0.5)
    runs = [
        o(drafter, embed, lm_head, feats2, ids, lm, torch.Generator().manual_seed(3)).loss
        for o in (plain, noisy_obj, noisy_obj)
    ]
    assert not torch.allclose(runs[0], runs[1])
    torch.testing.assert_close(runs[1], runs[2])


# ------------------------------------------------------------------------- logit distillation


def _teacher(B=3, S=20, seed=7):
    """Stand-in target final hidden states [B,S,H] (scaled so its softmax is not flat)."""
    return 3.0 * torch.randn(B, S, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "chunk,lam,T,wrap",
    [
        (1, 0.5, 1.0, False),
        (3, 1.0, 2.0, False),
        (0, 0.3, 0.7, False),
        (3, 0.5, 2.0, True),
    ],
)
def test_kd_loss_and_grads_match_dense_reference(chunk, lam, T, wrap):
    obj = DFlashObjective(
        BS,
        num_anchors=8,
        mask_token_id=MASK,
        chunk_blocks=chunk,
        kd_weight=lam,
        kd_temperature=T,
    )
    out = _matches_dense(obj, _teacher(), wrap_head=wrap)  # generic path vs Linear path
    names = out.metric_names
    ce, kd = out.metrics[names.index("ce")], out.metrics[names.index("kd")]
    torch.testing.assert_close((1 - lam) * ce + lam * kd, out.loss.detach())
    assert kd > 0


def test_kd_needs_the_target_hidden_states_and_is_off_by_default():
    drafter, embed, lm_head = _setup()
    ids, lm, feats = _data()
    obj = DFlashObjective(BS, num_anchors=4, mask_token_id=MASK, kd_weight=0.5)
    with pytest.raises(ValueError, match="final hidden states"):
        obj(drafter, embed, lm_head, feats, ids, lm)
    plain = DFlashObjective(BS, num_anchors=4, mask_token_id=MASK)
    assert "kd" not in plain.metric_names
    with pytest.raises(ValueError, match="kd_weight"):
        DFlashObjective(BS, 4, kd_weight=1.5)


def test_kd_with_a_teacher_equal_to_the_drafter_is_pure_ce_gradient_free_kl():
    """KL(p || p) = 0 and its gradient vanishes: with the drafter's own hidden states as the
    teacher, the KD term adds nothing (checks the sign and the position shift of the teacher)."""
    drafter, embed, lm_head = _setup()
    ids, lm, feats = _data()
    obj = DFlashObjective(BS, num_anchors=6, mask_token_id=MASK, kd_weight=1.0)
    g = torch.Generator().manual_seed(3)
    anchors, valid = obj.sample_anchors(lm, g)
    blocks = obj.build_blocks(ids, anchors, valid)
    hidden = drafter(F.embedding(blocks.flatten(1), embed), feats, anchors, valid)
    labels, lv = obj.build_labels(ids, lm, anchors, valid)
    teacher = hidden.detach().view(3, 6, BS, H)[:, :, 1:]
    out = obj.loss_from_hidden(hidden, lm_head, labels, lv, valid, teacher)
    torch.testing.assert_close(out.loss, torch.zeros(()), atol=1e-5, rtol=0)
    (g_h,) = torch.autograd.grad(out.loss, hidden)
    torch.testing.assert_close(g_h, torch.zeros_like(g_h), atol=1e-6, rtol=0)
    # teacher_hidden picks position a + k - 1 for slot k
    th = torch.arange(20.0)[None, :, None].expand(3, 20, H)
    t = obj.teacher_hidden(th, anchors)
    assert t[0, 0, 0, 0] == anchors[0, 0] and t[0, 0, 2, 0] == anchors[0, 0] + 2


def test_no_host_sync_with_kd():
    drafter, embed, lm_head = _setup()
    ids, lm, feats = _data()
    obj = DFlashObjective(BS, num_anchors=6, mask_token_id=MASK, chunk_blocks=2, kd_weight=0.5)
    counter = _SyncCounter()
    with counter:
        out = obj(
            drafter, embed, lm_head, feats, ids, lm, torch.Generator().manual_seed(0), _teacher()
        )
        out.loss.backward()
    assert counter.hits == []


# ------------------------------------------------- loss_slots (LM head on slots 1..K) + hidden


@pytest.mark.parametrize(
    "K,lam,hw,chunk",
    [(2, 0.0, 0.0, 3), (1, 0.5, 0.0, 1), (2, 0.0, 0.7, 0), (1, 0.3, 2.0, 2), (0, 0.0, 1.0, 3)],
)
def test_loss_slots_and_hidden_regression_match_dense_reference(K, lam, hw, chunk):
    obj = DFlashObjective(
        BS,
        num_anchors=8,
        mask_token_id=MASK,
        chunk_blocks=chunk,
        kd_weight=lam,
        loss_slots=K,
        hidden_weight=hw,
    )
    assert obj.loss_slots == (K or BS - 1)
    assert obj.needs_target_hidden == (lam > 0 or hw > 0)
    # the drafter's last layer computes slots 0..K only unless the hidden-state term reads all
    assert obj.read_slots == (0 if hw > 0 else obj.loss_slots + 1)
    out = _matches_dense(obj, _teacher())
    names = out.metric_names
    assert out.metrics.shape == (len(names),)
    assert [n for n in names if n.startswith("acc_")] == [
        f"acc_{k}" for k in range(1, obj.loss_slots + 1)
    ]
    assert ("hidden" in names) == (hw > 0)
    if hw > 0:
        assert out.metrics[names.index("hidden")] > 0


def test_loss_slots_metrics_count_only_scored_slots():
    """accept_len with K scored slots is the longest correct prefix of slots 1..K, + 1: at most
    K + 1, and equal to the full-block figure when K covers the block."""
    drafter, embed, lm_head = _setup()
    ids, lm, feats = _data()
    outs = {}
    for K in (1, 0):
        obj = DFlashObjective(BS, num_anchors=8, mask_token_id=MASK, loss_slots=K)
        with torch.no_grad():
            outs[K] = obj(drafter, embed, lm_head, feats, ids, lm, torch.Generator().manual_seed(5))
    n1, n0 = outs[1].metric_names, outs[0].metric_names
    a1 = outs[1].metrics[n1.index("accept_len")]
    assert 1.0 <= a1 <= 2.0
    assert a1 <= outs[0].metrics[n0.index("accept_len")] + 1e-6
    torch.testing.assert_close(
        outs[1].metrics[n1.index("acc_1")], outs[0].metrics[n0.index("acc_1")]
    )
    with pytest.raises(ValueError, match="loss_slots"):
        DFlashObjective(BS, 4, loss_slots=-1)


def test_hidden_regression_of_the_target_itself_is_zero():
    drafter, embed, lm_head = _setup()
    ids, lm, feats = _data()
    obj = DFlashObjective(BS, num_anchors=6, mask_token_id=MASK, hidden_weight=1.0)
    anchors, valid = obj.sample_anchors(lm, torch.Generator().manual_seed(3))
    blocks = obj.build_blocks(ids, anchors, valid)
    hidden = drafter(F.embedding(blocks.flatten(1), embed), feats, anchors, valid)
    labels, lv = obj.build_labels(ids, lm, anchors, valid)
    teacher = hidden.detach().view(3, 6, BS, H)[:, :, 1:]
    with_h = obj.loss_from_hidden(hidden, lm_head, labels, lv, valid, teacher)
    plain = DFlashObjective(BS, num_anchors=6, mask_token_id=MASK)
    without = plain.loss_from_hidden(hidden, lm_head, labels, lv, valid)
    torch.testing.assert_close(with_h.loss, without.loss)
    assert with_h.metrics[with_h.metric_names.index("hidden")] == 0
    with pytest.raises(ValueError, match="hidden_weight"):
        obj.loss_from_hidden(hidden, lm_head, labels, lv, valid)


def test_a_batch_computes_only_the_blocks_its_rows_can_fill():
    """Per-batch anchors (objective.step_anchors): where no row has num_anchors anchor
    positions, the step computes fewer blocks per row, and the loss, every metric and every
    gradient are those of the full num_anchors step (the dropped blocks are padding, the anchors
    the same): useful work only, the same training."""
    from dflash_trainer.pipeline.prefetcher import build_batch

    ids, lm, feats = _data()
    counts = (lm[:, :-1] & lm[:, 1:]).sum(1).numpy()  # [12, 6, 0]: the naive count
    obj = DFlashObjective(BS, num_anchors=64, mask_token_id=MASK)
    n = obj.step_anchors(counts)
    assert n == 16  # 12 rounded up to a multiple of 64 / 8, far below 64
    results = []
    for anchors in (None, n):
        drafter, embed, lm_head = _setup()
        out = obj(drafter, embed, lm_head, feats, ids, lm, torch.Generator().manual_seed(5),
                  num_anchors=anchors)  # fmt: skip
        out.loss.backward()
        grads = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
        results.append((out.loss.detach(), out.metrics, grads))
    (l64, m64, g64), (l16, m16, g16) = results
    torch.testing.assert_close(l16, l64)
    torch.testing.assert_close(m16, m64)
    for a, b in zip(g16, g64, strict=True):
        torch.testing.assert_close(a, b)
    assert obj.query_tokens(counts, 3) == (12 + 6 + 0) * BS  # useful blocks only
    assert obj.query_tokens(None, 3) == 3 * 64 * BS
    # the prefetcher counts the same positions on the host
    ds = type("D", (), {"lengths": torch.tensor([20, 20, 20]).numpy(),
                         "input_ids": ids.numpy(), "loss_mask": lm.numpy()})()  # fmt: skip
    assert build_batch(ds, [0, 1, 2], 4, 0).anchor_counts.tolist() == counts.tolist()


def test_batch_anchors_take_few_shapes_and_never_drop_an_anchor():
    obj = DFlashObjective(16, num_anchors=512)
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(500):
        counts = torch.randint(0, 2000, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        counts = (counts.float() * torch.rand(counts.shape, generator=g) ** 3).long().numpy()
        n = obj.step_anchors(counts)
        assert n >= min(512, int(counts.max()))  # every row keeps every anchor it can have
        assert n <= 512 and n % 64 == 0
        seen.add(n)
    assert len(seen) <= 8 and 512 in seen and len(seen) > 2
    assert obj.step_anchors(None) == 512 and obj.step_anchors(np.zeros(3, np.int64)) == 64
