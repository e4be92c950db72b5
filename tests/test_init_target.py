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
