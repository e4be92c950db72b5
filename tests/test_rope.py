"""The drafter's RoPE contract (models/rope.py): a published-format drafter that declares a scaled
RoPE (YaRN, Llama 3's) loads and computes what the `dflash` reference package computes on it;
the export writes the form in every key engines read; a form that cannot be computed the way
engines do is refused, never dropped."""

import json

import pytest
import torch

from dflash_trainer.errors import UserError
from dflash_trainer.models.drafter import DFlashDrafter
from dflash_trainer.models.export import export_drafter, load_drafter
from test_drafter import tiny_cfg

H, NF, BS, L, V, HEADS, HD = 32, 3, 4, 2, 128, 4, 8
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _reference_drafter(tmp_path, scaling, seed=0):
    """A drafter built and saved by the reference package itself (transformers' Qwen3Config,
    rope_parameters in the transformers-5 form), random weights, non-trivial norms."""
    ref = pytest.importorskip("dflash.model")
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        hidden_size=H,
        intermediate_size=48,
        num_hidden_layers=L,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=HD,
        vocab_size=V,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **(scaling or {})},
    )
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size = BS
    cfg.num_target_layers = 8
    cfg.dflash_config = {"mask_token_id": V - 1, "target_layer_ids": [1, 3, 5]}
    torch.manual_seed(seed)
    model = ref.DFlashDraftModel(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.rand(p.shape) + 0.5 if "norm" in n else torch.randn(p.shape) * 0.1)
    out = tmp_path / "ref-drafter"
    model.save_pretrained(str(out))
    return model, out


def _inputs(S=40):
    """A context past the original window (16), so a scaled RoPE differs from a plain one."""
    g = torch.Generator().manual_seed(3)
    return torch.randn(1, S, NF * H, generator=g), torch.randn(1, BS, H, generator=g)


def _ours(drafter, feats, block):
    S = feats.shape[1]
    with torch.no_grad():
        return drafter.forward_infer(block, feats, drafter.new_cache(), start=S)


def _reference(model, feats, block):
    S = feats.shape[1]
    with torch.no_grad():
        return model(
            position_ids=torch.arange(S + BS)[None], noise_embedding=block, target_hidden=feats
        )


@pytest.mark.parametrize("scaling", [YARN, LLAMA3], ids=["yarn", "llama3"])
def test_a_published_scaled_rope_drafter_loads_with_the_references_logits(tmp_path, scaling):
    model, out = _reference_drafter(tmp_path, scaling)
    ours = load_drafter(out)
    assert ours.config.rope_scaling == scaling
    feats, block = _inputs()
    want = _reference(model, feats, block)
    torch.testing.assert_close(_ours(ours, feats, block), want)
    # through the LM head as served: the same logits
    head = torch.nn.Linear(H, V, bias=False)
    torch.testing.assert_close(head(_ours(ours, feats, block)), head(want))

    # the older form (rope_scaling + rope_theta, `type`) loads the same drafter
    c = out / "config.json"
    cfg = json.loads(c.read_text())
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = 10000.0
    cfg["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
    c.write_text(json.dumps(cfg))
    torch.testing.assert_close(_ours(load_drafter(out), feats, block), want)


def test_negative_control_the_same_weights_with_plain_rope_differ(tmp_path):
    """What loading used to do with a YaRN drafter (the form dropped): it is measurably wrong."""
    model, out = _reference_drafter(tmp_path, YARN)
    c = out / "config.json"
    cfg = json.loads(c.read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    c.write_text(json.dumps(cfg))
    feats, block = _inputs()
    plain = _ours(load_drafter(out), feats, block)
    want = _reference(model, feats, block)
    assert (plain - want).abs().max() > 1e-2


def _cfg(scaling):
    """test_drafter's tiny drafter (H 32, 4 x 8 heads, taps [1, 3, 5], vocab 128) with `scaling`."""
    return tiny_cfg(max_position_embeddings=256, rope_scaling=scaling)


def test_the_export_writes_the_form_in_every_key_and_reads_it_back(tmp_path):
    torch.manual_seed(0)
    d = DFlashDrafter(_cfg(LLAMA3))
    out = export_drafter(d, tmp_path / "d")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_parameters"] == {"rope_theta": 10000.0, **LLAMA3}
    assert cfg["rope_scaling"] == LLAMA3 and cfg["rope_theta"] == 10000.0
    assert cfg["max_position_embeddings"] == 256
    back = load_drafter(out)
    assert back.config.rope_scaling == LLAMA3
    feats, block = _inputs()
    torch.testing.assert_close(_ours(back, feats, block), _ours(d, feats, block))
    # and the reference package computes the same on our export
    ref = pytest.importorskip("dflash.model")
    model = ref.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    torch.testing.assert_close(_ours(d, feats, block), _reference(model, feats, block))


def test_forms_that_cannot_be_computed_as_engines_do_are_refused(tmp_path):
    torch.manual_seed(0)
    out = export_drafter(DFlashDrafter(_cfg(YARN)), tmp_path / "d")
    c = out / "config.json"
    cfg = json.loads(c.read_text())
    dyn = {**cfg, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}
    dyn["rope_scaling"] = None
    c.write_text(json.dumps(dyn))
    with pytest.raises(UserError, match="rope_type 'dynamic' is not supported"):
        load_drafter(out)
    two = {**cfg, "rope_scaling": LLAMA3}  # rope_parameters says YaRN
    c.write_text(json.dumps(two))
    with pytest.raises(UserError, match="two different RoPE forms"):
        load_drafter(out)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        _cfg({**YARN, "partial_rotary_factor": 0.5})
