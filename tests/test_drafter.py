"""DFlash drafter: names, init, training forward vs a per-block inference loop, isolation, cache."""

from types import SimpleNamespace

import pytest
import torch

from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter, resolve_mask_token_id
from dflash_trainer.models.export import expected_names

H, NF, BS = 32, 3, 4


def tiny_cfg(**kw) -> DFlashConfig:
    base = dict(
        hidden_size=H,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        block_size=BS,
        target_layer_ids=[1, 3, 5],
        num_target_layers=8,
        mask_token_id=127,
        vocab_size=128,
        rope_theta=10000.0,
        init_std=0.1,
        attention="split",
    )
    base.update(kw)
    return DFlashConfig(**base)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return DFlashDrafter(tiny_cfg(**kw))


def _batch(S=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.tensor([[0, 2, 3, 7, 9], [1, 4, 6, 0, 0]])
    valid = torch.tensor([[1] * 5, [1, 1, 1, 0, 0]]).bool()
    N = anchors.shape[1]
    emb = torch.randn(2, N * BS, H, generator=g)
    feats = torch.randn(2, S, NF * H, generator=g)
    return emb, feats, anchors, valid


def test_param_names_match_published_layout():
    m = make()
    sd = m.state_dict()
    assert sorted(sd) == sorted(expected_names(2))
    assert len(sd) == 3 + 11 * 2
    assert sd["fc.weight"].shape == (H, NF * H)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (4 * 8, H)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (2 * 8, H)
    assert sd["layers.0.self_attn.q_norm.weight"].shape == (8,)
    assert sd["layers.1.mlp.down_proj.weight"].shape == (H, 48)


def test_init_norms_one_linears_std():
    m = make(num_layers=1, init_std=0.02)
    for n, p in m.named_parameters():
        if n.endswith("norm.weight") or "layernorm" in n:
            assert torch.equal(p, torch.ones_like(p)), n
        else:
            assert abs(p.std().item() - 0.02) < 0.004, n


def test_training_forward_equals_per_block_inference_loop():
    """Each valid block of the batched training pass == a fresh-cache forward_infer of that block
    alone on the context strictly before its anchor (an independent, mask-free reference)."""
    m = make()
    emb, feats, anchors, valid = _batch()
    out = m(emb, feats, anchors, valid)
    assert out.shape == emb.shape
    for b in range(2):
        for j in range(anchors.shape[1]):
            if not valid[b, j]:
                continue
            a = int(anchors[b, j])
            blk = emb[b : b + 1, j * BS : (j + 1) * BS]
            ref = m.forward_infer(blk, feats[b : b + 1, :a], m.new_cache(), start=a)
            torch.testing.assert_close(out[b : b + 1, j * BS : (j + 1) * BS], ref)


@pytest.mark.parametrize("impl", ["dense", "split"])
def test_impls_agree_in_drafter(impl):
    m = make()
    emb, feats, anchors, valid = _batch()
    ref = m(emb, feats, anchors, valid, attention="dense")
    out = m(emb, feats, anchors, valid, attention=impl)
    keep = valid.repeat_interleave(BS, dim=1)[..., None]
    torch.testing.assert_close(out * keep, ref * keep)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("impl", ["dense", "split"])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_out_slots_equal_the_full_forward_sliced(impl, slots):
    """forward(out_slots=q): the first q slots of every block, equal to the full forward's, and
    the same parameter gradients for a loss on those slots (the last layer skips the others'
    queries and MLP, tests/test_attention.py holds the attention part)."""
    emb, feats, anchors, valid = _batch()
    ref_m, m = make(), make()
    N = anchors.shape[1]
    full = ref_m(emb, feats, anchors, valid, attention=impl)
    ref = full.view(2, N, BS, H)[:, :, :slots].reshape(2, N * slots, H)
    out = m(emb, feats, anchors, valid, attention=impl, out_slots=slots)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref)
    w = torch.randn_like(ref)
    (ref * w).sum().backward()
    (out * w).sum().backward()
    for (name, a), b in zip(m.named_parameters(), ref_m.parameters()):
        assert a.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_out_slots_keeps_every_slot_where_the_variant_needs_whole_blocks():
    m = make(variant="dflash2")
    emb, feats, anchors, valid = _batch()
    assert m(emb, feats, anchors, valid, out_slots=2).shape == emb.shape
    assert m.last_layer_slots(2, None, "cpu") == BS


def test_last_layer_slots_is_what_forward_computes():
    """The count the FLOP model reads is the shape forward returns, for every out_slots."""
    m = make()
    emb, feats, anchors, valid = _batch()
    N = anchors.shape[1]
    for out_slots in range(0, BS + 2):
        q = m.last_layer_slots(out_slots, None, "cpu")
        assert q == (out_slots if 0 < out_slots < BS else BS)
        assert m(emb, feats, anchors, valid, out_slots=out_slots).shape == (2, N * q, H)


def test_block_isolation_from_other_blocks_and_future_context():
    m = make()
    emb, feats, anchors, valid = _batch()
    base = m(emb, feats, anchors, valid)
    b, j = 0, 2  # anchor 3, overlapping neighbours (spacing < bs)
    a, sl = int(anchors[b, j]), slice(j * BS, (j + 1) * BS)
    emb2, feats2 = emb.clone(), feats.clone()
    mask = torch.ones(emb.shape[1], dtype=torch.bool)
    mask[sl] = False
    emb2[b, mask] = torch.randn_like(emb2[b, mask])  # every other block's tokens
    feats2[b, a:] = torch.randn_like(feats2[b, a:])  # context at and after the anchor
    out = m(emb2, feats2, anchors, valid)
    torch.testing.assert_close(out[b, sl], base[b, sl])
    feats3 = feats.clone()
    feats3[b, a - 1] += 1.0  # strictly before: must matter
    assert (m(emb, feats3, anchors, valid)[b, sl] - base[b, sl]).abs().max() > 1e-4


def test_padded_rows_finite_with_grads():
    m = make()
    emb, feats, anchors, valid = _batch()
    valid = valid.clone()
    valid[1] = False
    out = m(emb, feats, anchors, valid)
    out.square().mean().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_cache_incremental_and_crop():
    m = make()
    _, feats, _, _ = _batch(S=10)
    f = feats[:1]
    blk = torch.randn(1, BS, H)
    one = m.forward_infer(blk, f, m.new_cache(), start=10)
    c = m.new_cache()
    m.forward_infer(torch.randn(1, BS, H), f[:, :6], c, start=6)  # a draft at 6
    assert c.length == 6  # block K/V not kept
    two = m.forward_infer(blk, f[:, 6:], c, start=10)
    assert c.length == 10
    torch.testing.assert_close(two, one)
    c.crop(6)  # reject: back to 6
    assert c.length == 6
    three = m.forward_infer(blk, f[:, 6:], c, start=10)
    torch.testing.assert_close(three, one)


def test_bf16_autocast_forward_backward():
    m = make()
    emb, feats, anchors, valid = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(emb, feats, anchors, valid)
    ref = m(emb, feats, anchors, valid)
    out.float().sum().backward()
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.1)


def _fake_target(rope):
    cfg = SimpleNamespace(max_position_embeddings=2048, **rope)
    return SimpleNamespace(
        hidden_size=H,
        num_layers=8,
        layer_ids=[1, 3, 5],
        vocab_size=128,
        model=SimpleNamespace(config=cfg),
        tokenizer=list(range(120)),
    )


def test_from_configs_reads_target_and_rope_parameters():
    from dflash_trainer.config import DrafterConfig

    dc = DrafterConfig(
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, block_size=BS
    )
    cfg = DFlashConfig.from_configs(dc, _fake_target({"rope_parameters": {"rope_theta": 5e5}}))
    assert cfg.rope_theta == 5e5 and cfg.hidden_size == H and cfg.num_features == 3
    assert cfg.mask_token_id == 120  # first padded embedding row
    assert cfg.max_position_embeddings == 2048
    cfg = DFlashConfig.from_configs(dc, _fake_target({"rope_theta": 1e4}))
    assert cfg.rope_theta == 1e4
    dc.rope_theta = 123.0
    assert DFlashConfig.from_configs(dc, _fake_target({"rope_theta": 1e4})).rope_theta == 123.0


def test_mask_token_rules():
    t = SimpleNamespace(vocab_size=128, tokenizer=list(range(128)))
    assert resolve_mask_token_id(-1, t) == 0  # no padded row
    assert resolve_mask_token_id(5, t) == 5
    from dflash_trainer.errors import UserError

    with pytest.raises(UserError, match="mask_token_id"):
        resolve_mask_token_id(128, t)


def test_mask_built_once_per_forward_not_per_layer(monkeypatch):
    """The dense mask (and, on CUDA, the flex BlockMask, through the same cache) is shared by
    all layers of one forward."""
    from dflash_trainer.models import attention as A

    calls = []
    real = A.dense_mask
    monkeypatch.setattr(A, "dense_mask", lambda *a: calls.append(1) or real(*a))
    cfg = DFlashConfig(
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        block_size=4,
        target_layer_ids=[0, 1],
        num_target_layers=4,
        mask_token_id=0,
        vocab_size=50,
        attention="dense",
    )
    d = DFlashDrafter(cfg)
    anchors = torch.tensor([[1, 5, 9]])
    d(torch.randn(1, 12, 32), torch.randn(1, 14, 64), anchors, torch.ones(1, 3, dtype=torch.bool))
    assert len(calls) == 1
    d(torch.randn(1, 12, 32), torch.randn(1, 14, 64), anchors, torch.ones(1, 3, dtype=torch.bool))
    assert len(calls) == 2  # a new forward builds its own


def test_cache_growth_equals_concatenation():
    from dflash_trainer.models.drafter import DrafterCache

    g = torch.Generator().manual_seed(0)
    cache, ks, vs = DrafterCache(2), [], []
    for n in (3, 1, 300, 7, 1):  # crosses the first capacity (256) and one doubling
        k, v = torch.randn(2, 3, n, 8, generator=g), torch.randn(2, 3, n, 8, generator=g)
        for layer in range(2):
            kk, vv = cache.append(layer, k + layer, v - layer)
            torch.testing.assert_close(kk, torch.cat(ks + [k], 2) + layer, rtol=0, atol=0)
            torch.testing.assert_close(vv, torch.cat(vs + [v], 2) - layer, rtol=0, atol=0)
        ks.append(k)
        vs.append(v)
    assert cache.length == 312 and cache.keys[1].shape[2] == 312
    cache.crop(10)
    assert cache.length == 10
    torch.testing.assert_close(cache.values[0], torch.cat(vs, 2)[:, :, :10], rtol=0, atol=0)


def test_mask_token_auto_takes_a_reserved_special_token_where_no_row_is_padded():
    class Tok(list):
        def get_added_vocab(self):
            return {"<|begin_of_text|>": 120, "<|reserved_special_token_1|>": 125,
                    "<|reserved_special_token_0|>": 122}  # fmt: skip

    t = SimpleNamespace(vocab_size=128, tokenizer=Tok(range(128)))
    assert resolve_mask_token_id(-1, t) == 122


def test_a_mask_token_the_training_text_holds_is_refused(tmp_path):
    from dflash_trainer.errors import UserError
    from dflash_trainer.run import train
    from tiny import tiny_config, tiny_dataset, tiny_target

    data = tiny_dataset()  # tokens >= 3; put id 1 into one answer
    data.input_ids[5][-3] = 1
    cfg = tiny_config(tmp_path, **{"drafter.mask_token_id": 1})
    with pytest.raises(UserError, match=r"MASK token id 1 occurs in the training text \(sample"):
        train(cfg, target=tiny_target(), train_set=data)
