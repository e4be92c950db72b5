"""The variant registry (models/variants/): a third variant is one class and one registry line.

The toy variant here scales each layer's MLP output by a learned per-channel gate (1 at its
neutral start) and adds an L2 term pulling the gate to 1. Registered with one line, it builds,
trains, exports under its own architecture, loads back, and starts exactly from a DFlash drafter,
through the same code paths as DFlash2, with no other change."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from dflash_trainer.config import DrafterConfig
from dflash_trainer.models import variants
from dflash_trainer.models.drafter import DFlashDrafter, convert_variant
from dflash_trainer.models.export import expected_names, export_drafter, load_drafter
from dflash_trainer.models.variants.base import DrafterVariant
from dflash_trainer.train.objective import DFlashObjective
from test_drafter import tiny_cfg

H, NF, BS, L, V = 32, 3, 4, 2, 128  # test_drafter.tiny_cfg's


class MLPGate(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(hidden))

    def prepare(self, x):
        return x, None

    def finish(self, y, state):
        return y * self.scale


class GateL2:
    metric_names = ["gate_l2"]

    def __init__(self, weight: float):
        self.weight = weight

    def __call__(self, drafter, hidden, lm_head, labels, label_valid, slot_weights, chunk_blocks):
        l2 = sum(((m.scale - 1) ** 2).sum() for m in drafter.modules() if isinstance(m, MLPGate))
        return self.weight * l2, l2.detach()[None]


class Gated(DrafterVariant):
    name = "gated"
    architecture = "GatedDFlashDraftModel"
    options = ("gate_l2_weight",)
    warm_starts_from = ("dflash",)

    def default_options(self):
        return {"gate_l2_weight": 0.5}  # not a drafter.* key of config.py: the toy's own

    def layer_parts(self, cfg):
        return {"mlp": ("mlp_gate", MLPGate(cfg.hidden_size))}

    @torch.no_grad()
    def reset_parts(self, drafter, generator=None):
        for m in drafter.modules():
            if isinstance(m, MLPGate):
                m.scale.fill_(1.0)

    def objective_terms(self, section, cfg):
        return GateL2(cfg.options["gate_l2_weight"])

    def tensor_names(self, num_layers):
        return [f"layers.{i}.mlp_gate.scale" for i in range(num_layers)]


@pytest.fixture
def gated(monkeypatch):
    monkeypatch.setitem(variants.REGISTRY, "gated", Gated())  # the one registry line


def _cfg(variant="gated", **options):
    """test_drafter's tiny drafter (H 32, 2 layers, taps [1, 3, 5], vocab 128) as `variant`."""
    return tiny_cfg(init_std=0.2, variant=variant, options=options)


def _inputs(seed=3, S=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, S, NF * H, generator=g), torch.randn(1, BS, H, generator=g)


def test_a_registered_variant_builds_with_its_parts_and_defaults(gated):
    d = DFlashDrafter(_cfg())
    assert d.config.options == {"gate_l2_weight": 0.5}
    assert sorted(d.state_dict()) == sorted(expected_names(L, "gated"))
    assert len(d.state_dict()) == 3 + 11 * L + L


def test_it_starts_exactly_from_a_dflash_drafter(gated):
    torch.manual_seed(0)
    d1 = DFlashDrafter(_cfg("dflash"))
    d2 = convert_variant(d1, "gated", {"gate_l2_weight": 0.1})
    assert d2.config.variant == "gated" and d2.config.options == {"gate_l2_weight": 0.1}
    feats, block = _inputs()
    with torch.no_grad():
        want = d1.forward_infer(block, feats, d1.new_cache(), feats.shape[1])
        got = d2.forward_infer(block, feats, d2.new_cache(), feats.shape[1])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # and the gate changes what it computes once it moves
    with torch.no_grad():
        d2.layers[0].mlp_gate.scale.mul_(0.5)
        moved = d2.forward_infer(block, feats, d2.new_cache(), feats.shape[1])
    assert (moved - want).abs().max() > 1e-3


def test_its_objective_terms_join_the_block_loss(gated):
    torch.manual_seed(1)
    d = DFlashDrafter(_cfg())
    with torch.no_grad():
        d.layers[1].mlp_gate.scale.fill_(2.0)  # L2 = H * 1
    g = torch.Generator().manual_seed(2)
    S = 12
    ids = torch.randint(0, V - 1, (2, S), generator=g)
    mask = torch.ones(2, S, dtype=torch.long)
    mask[:, :3] = 0
    feats = torch.randn(2, S, NF * H, generator=g)
    embed, head = torch.randn(V, H, generator=g), nn.Linear(H, V, bias=False).requires_grad_(False)
    plain = DFlashObjective(BS, 3, mask_token_id=V - 1)
    obj = DFlashObjective(
        BS, 3, mask_token_id=V - 1, extra_terms=d.config.spec.objective_terms(None, d.config)
    )
    base = plain(d, embed, head, feats, ids, mask, generator=torch.Generator().manual_seed(4))
    out = obj(d, embed, head, feats, ids, mask, generator=torch.Generator().manual_seed(4))
    m = dict(zip(out.metric_names, out.metrics.tolist()))
    assert out.metric_names == base.metric_names + ["gate_l2"]
    assert m["gate_l2"] == pytest.approx(float(H))
    torch.testing.assert_close(out.loss, base.loss + 0.5 * H)
    out.loss.backward()
    grad = d.layers[1].mlp_gate.scale.grad
    assert grad is not None and grad.abs().sum() > 0


def test_it_exports_under_its_architecture_and_loads_back(gated, tmp_path):
    torch.manual_seed(3)
    d = DFlashDrafter(_cfg(gate_l2_weight=0.25))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    out = export_drafter(d, tmp_path / "gated")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["GatedDFlashDraftModel"]
    assert cfg["dflash_config"]["gate_l2_weight"] == 0.25
    assert sorted(load_file(str(out / "model.safetensors"))) == sorted(expected_names(L, "gated"))
    back = load_drafter(out)
    assert back.config.variant == "gated" and back.config.options == {"gate_l2_weight": 0.25}
    for (n, a), (n2, b) in zip(d.state_dict().items(), back.state_dict().items()):
        assert n == n2
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_unknown_variant_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"variant='nope' is not one of \['dflash', 'dflash2'\]"):
        _cfg("nope")
    with pytest.raises(ValueError, match="has no option"):
        _cfg("dflash", conv_kernel_size=2)


def test_the_config_schema_offers_exactly_the_registered_variants():
    """drafter.variant's choices are checked when the config is read (before a target loads):
    a variant registered for users is added there too."""
    field = DrafterConfig.__dataclass_fields__["variant"]
    assert sorted(field.metadata["choices"]) == sorted(variants.REGISTRY)


def test_a_dflash2_drafter_cannot_become_a_dflash_one():
    torch.manual_seed(0)
    d2 = DFlashDrafter(_cfg("dflash2", conv_group_size=8, selector_rank=4, selector_top_k=4))
    with pytest.raises(ValueError, match="cannot start from a dflash2 one"):
        convert_variant(d2, "dflash", {})
