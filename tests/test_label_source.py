"""objective.label_source=target: each slot's label is the target's own argmax at the position
before it (its final hidden state through the LM head), checked against a naive loop over the
full [B, S, V] logits; validity is the text labels'; the run wires it end to end."""

import pytest
import torch

from dflash_trainer.run import train
from dflash_trainer.train.objective import DFlashObjective
from tiny import tiny_config, tiny_dataset, tiny_target

B, S, H, V, BS, N = 2, 24, 16, 40, 4, 6


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.zeros(B, S, dtype=torch.long)
    mask[0, 5:] = 1
    mask[1, 9:17] = 1  # ends before the row does: positions past it are invalid labels
    hidden = torch.randn(B, S, H, generator=g)
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    return ids, mask, hidden, head


def naive(ids, mask, hidden, head, anchors, valid):
    """labels[b, j, k] = argmax of the target's logits at anchor + k - 1, where valid."""
    logits = head(hidden)  # [B, S, V]: fine at this size
    out = []
    for b in range(B):
        for j in range(N):
            for k in range(1, BS):
                if valid[b, j, k]:
                    a = int(anchors[b, j])
                    out.append((b, j, k, int(logits[b, a + k - 1].argmax())))
    return out


@pytest.mark.parametrize("loss_slots,chunk", [(0, 0), (2, 1)])
def test_target_labels_are_the_targets_argmax_one_position_back(loss_slots, chunk):
    ids, mask, hidden, head = _batch()
    obj = DFlashObjective(BS, N, chunk_blocks=chunk, loss_slots=loss_slots, label_source="target")
    assert obj.needs_target_hidden
    anchors, bv = obj.sample_anchors(mask, torch.Generator().manual_seed(1))
    text, valid = obj.build_labels(ids, mask, anchors, bv)
    got = obj.target_labels(text, obj.teacher_hidden(hidden, anchors), head)
    K = obj.loss_slots
    assert (got[:, :, 0] == text[:, :, 0]).all()  # slot 0 is given: the anchor's token
    assert (got[:, :, K + 1 :] == text[:, :, K + 1 :]).all()  # never read
    checked = 0
    for b, j, k, want in naive(ids, mask, hidden, head, anchors, valid):
        if k <= K:
            assert int(got[b, j, k]) == want, (b, j, k)
            checked += 1
    assert checked > 10
    # the labels differ from the text's (a random target does not predict random text)
    assert (got[:, :, 1 : K + 1] != text[:, :, 1 : K + 1])[valid[:, :, 1 : K + 1]].any()


def test_the_loss_trains_on_the_target_labels_with_the_text_validity():
    ids, mask, hidden, head = _batch(2)
    E = torch.randn(V, H)
    w = torch.nn.Parameter(torch.eye(H))

    def drafter(emb, feats, anchors, block_valid, attention=None, out_slots=0):
        return emb @ w  # every slot (a drafter may return all of them: the loss reads the shape)

    seen = {}
    for source in ("text", "target"):
        obj = DFlashObjective(BS, N, label_source=source)
        inner = obj.loss_from_hidden

        def spy(hid, lm_head, labels, label_valid, *rest, _inner=inner, _s=source):
            seen[_s] = (labels, label_valid)
            return _inner(hid, lm_head, labels, label_valid, *rest)

        obj.loss_from_hidden = spy
        g = torch.Generator().manual_seed(3)
        out = obj(drafter, E, head, hidden, ids, mask, g, target_hidden=hidden)
        assert torch.isfinite(out.loss)
        if source == "target":
            with pytest.raises(ValueError, match="label_source=target"):
                obj(drafter, E, head, hidden, ids, mask, torch.Generator().manual_seed(3))
    (text, v_text), (tgt, v_tgt) = seen["text"], seen["target"]
    assert torch.equal(v_text, v_tgt)  # same anchors (same seed), same validity
    assert torch.equal(tgt[:, :, 0], text[:, :, 0])
    anchors, _ = DFlashObjective(BS, N).sample_anchors(mask, torch.Generator().manual_seed(3))
    for b, j, k, want in naive(ids, mask, hidden, head, anchors, v_tgt):
        assert int(tgt[b, j, k]) == want


def test_a_run_with_target_labels_trains(tmp_path):
    cfg = tiny_config(tmp_path, **{"objective.label_source": "target", "optim.epochs": 1})
    res = train(cfg, target=tiny_target(), train_set=tiny_dataset(8))
    losses = [m["loss"] for _, m in res.history]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
