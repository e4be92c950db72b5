"""drafter.init=target: the drafter starts as the target's last layers (models/init_target.py)."""

import pytest
import torch

from dflash_trainer.errors import UserError
from dflash_trainer.models.export import export_drafter
from dflash_trainer.run.build import build_drafter
from tiny import tiny_config, tiny_target

SHAPES = {  # the tiny targets' head layout and MLP width
    "drafter.num_layers": 2,
    "drafter.num_heads": 4,
    "drafter.num_kv_heads": 2,
    "drafter.head_dim": 16,
    "drafter.intermediate_size": 128,
}


def _build(tmp_path, target, **over):
    cfg = tiny_config(tmp_path, **{**SHAPES, "drafter.init": "target", **over})
    return build_drafter(cfg, target, "cpu")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_layers_norm_and_fusion_start_from_the_target(tmp_path, arch):
    target = tiny_target(arch, layers=4)
    d = _build(tmp_path, target)
    t_layers = target.layers
    for i, src in enumerate((2, 3)):  # the last two of four
        dl, tl = d.layers[i], t_layers[src]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            torch.testing.assert_close(
                getattr(dl.self_attn, name).weight, getattr(tl.self_attn, name).weight
            )
        for name in ("gate_proj", "up_proj", "down_proj"):
            torch.testing.assert_close(getattr(dl.mlp, name).weight, getattr(tl.mlp, name).weight)
        torch.testing.assert_close(dl.input_layernorm.weight, tl.input_layernorm.weight)
        if arch == "qwen3":
            torch.testing.assert_close(dl.self_attn.q_norm.weight, tl.self_attn.q_norm.weight)
    torch.testing.assert_close(d.norm.weight, target.final_norm.weight)
    # fc passes the deepest tapped feature through, normalised like layer 2's input
    nf, H = d.config.num_features, d.config.hidden_size
    feats = torch.randn(1, 5, nf * H)
    want = t_layers[2].input_layernorm(feats[..., (nf - 1) * H :])
    torch.testing.assert_close(d.fuse(feats), want)


def test_init_tap_starts_after_the_chosen_tap_and_passes_its_feature(tmp_path):
    target = tiny_target("llama", layers=6)
    taps = list(target.layer_ids)
    d = _build(tmp_path, target, **{"drafter.init_tap": 0, "drafter.num_layers": 1})
    src = taps[0] + 1
    tl = target.layers[src]
    for name in ("q_proj", "o_proj"):
        torch.testing.assert_close(
            getattr(d.layers[0].self_attn, name).weight, getattr(tl.self_attn, name).weight
        )
    torch.testing.assert_close(d.layers[0].mlp.down_proj.weight, tl.mlp.down_proj.weight)
    nf, H = d.config.num_features, d.config.hidden_size
    feats = torch.randn(1, 5, nf * H)
    torch.testing.assert_close(d.fuse(feats), tl.input_layernorm(feats[..., :H]))
    with pytest.raises(UserError, match="init_tap=9 but the target has"):
        _build(tmp_path, target, **{"drafter.init_tap": 9})
    with pytest.raises(UserError, match="run past the target's 6 layers"):
        _build(tmp_path, target, **{"drafter.init_tap": len(taps) - 1, "drafter.num_layers": 6})


def test_random_init_is_the_default_and_differs(tmp_path):
    target = tiny_target("llama", layers=4)
    cfg = tiny_config(tmp_path, **SHAPES)
    assert cfg.drafter.init == "random"
    d = build_drafter(cfg, target, "cpu")
    assert not torch.equal(d.layers[0].mlp.up_proj.weight, target.layers[2].mlp.up_proj.weight)


def test_mismatching_shapes_name_the_tensor(tmp_path):
    target = tiny_target("llama", layers=4)
    with pytest.raises(UserError, match=r"layers\.0\.mlp\.gate_proj\.weight.*drafter\.init=random"):
        _build(tmp_path, target, **{"drafter.intermediate_size": 64})
    with pytest.raises(UserError, match="drafter has 6 layers but the target only 4"):
        _build(tmp_path, target, **{"drafter.num_layers": 6})


def test_export_loads_in_the_reference_with_no_missing_or_unexpected_tensors(tmp_path):
    dflash_model = pytest.importorskip("dflash.model")
    target = tiny_target("llama", layers=4)
    d = _build(tmp_path, target)
    out = export_drafter(d, tmp_path / "export")
    ref, info = dflash_model.DFlashDraftModel.from_pretrained(
        str(out), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info.get("mismatched_keys")
    sd = ref.state_dict()
    for name, p in d.state_dict().items():
        torch.testing.assert_close(sd[name], p, msg=name)


# ------------------------------------------------------------------ drafter.init_from (warm start)


def _exported(tmp_path, target, **over):
    d = _build(tmp_path / "a", target, **{"drafter.init": "random", **over})
    with torch.no_grad():  # trained-looking weights, not the init values
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return d, export_drafter(d, tmp_path / "published")


def test_warm_start_round_trip_identical_weights_and_first_loss(tmp_path):
    from dflash_trainer.train.objective import DFlashObjective

    target = tiny_target("llama", layers=4)
    src, out = _exported(tmp_path, target)
    # another block size for training is allowed; the mask token comes from the export
    d = _build(
        tmp_path / "b",
        target,
        **{"drafter.init_from": str(out), "drafter.block_size": 8, "drafter.mask_token_id": 5},
    )
    assert d.config.block_size == 8 and d.config.mask_token_id == src.config.mask_token_id
    d = _build(tmp_path / "b4", target, **{"drafter.init_from": str(out)})  # its block size
    for (n, a), (_, b) in zip(src.state_dict().items(), d.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 40), generator=g)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[:, 10:] = True
    feats = torch.randn(2, 40, d.config.num_features * 64, generator=g)
    losses = []
    for m in (src, d):
        obj = DFlashObjective(4, 6, mask_token_id=m.config.mask_token_id)
        out_ = obj(
            m,
            target.embed_weight,
            target.lm_head,
            feats,
            ids,
            mask,
            torch.Generator().manual_seed(1),
        )
        losses.append(out_.loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)


def test_warm_start_refuses_what_does_not_fit(tmp_path):
    target = tiny_target("llama", layers=4)
    _, out = _exported(tmp_path, target)
    with pytest.raises(UserError, match="has 2 layers but drafter.num_layers=1"):
        _build(tmp_path / "c", target, **{"drafter.init_from": str(out), "drafter.num_layers": 1})
    other = tiny_target("llama", layers=6)  # taps [1, 4]: not the export's [1, 2]
    with pytest.raises(UserError, match=r"trained on target layers \[1, 2\].*target.taps"):
        _build(tmp_path / "d", other, **{"drafter.init_from": str(out)})


def test_warm_start_names_the_first_bad_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    target = tiny_target("llama", layers=4)
    _, out = _exported(tmp_path, target)
    sd = load_file(str(out / "model.safetensors"))
    sd["layers.1.mlp.up_proj.weight"] = sd["layers.1.mlp.up_proj.weight"][:, :-1].contiguous()
    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(UserError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        _build(tmp_path / "e", target, **{"drafter.init_from": str(out)})
