"""DFlash2 (models/variants/dflash2.py on the one drafter backbone): parity with the published
reference package's `DFlash2DraftModel` (forward and `propose`) on the same weights, with random
non-identity convolutions and selector; the identity start (a DFlash2 drafter warm-started from
a DFlash export drafts exactly what that export drafts); export names/config and round trip."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter, convert_variant
from dflash_trainer.models.export import expected_names, export_drafter, load_drafter
from dflash_trainer.models.variants.dflash2 import grouped_causal_conv

H, NF, BS, L, V = 32, 3, 6, 2, 128
TAPS, GROUP, RANK, TOPK = 3, 8, 12, 5
OPTIONS = dict(
    conv_kernel_size=TAPS, conv_group_size=GROUP, selector_rank=RANK, selector_top_k=TOPK
)


def _cfg(variant="dflash2", **kw):
    return DFlashConfig(
        hidden_size=H,
        num_layers=L,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        block_size=BS,
        target_layer_ids=[1, 3, 5],
        num_target_layers=8,
        mask_token_id=V - 1,
        vocab_size=V,
        rope_theta=10000.0,
        init_std=0.1,
        max_position_embeddings=512,
        variant=variant,
        options=OPTIONS if variant == "dflash2" else {},
        **kw,
    )


def _randomise(m, seed=0, scale=0.3):
    """Every DFlash2 part away from its identity/zero start, norms away from 1: a mix-up of
    sides, taps, groups or codebooks shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            elif "conv" in n or "candidate_selector" in n:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return m


def _drafter(seed=0, variant="dflash2"):
    torch.manual_seed(seed)
    m = DFlashDrafter(_cfg(variant))
    return _randomise(m, seed) if variant == "dflash2" else m


def _inputs(seed=3, S=9, Q=BS):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, S, NF * H, generator=g), torch.randn(1, Q, H, generator=g)


@pytest.fixture
def exported(tmp_path):
    m = _drafter()
    return m, export_drafter(m, tmp_path / "drafter2")


def _reference(out):
    dflash_model = pytest.importorskip("dflash.model")
    return dflash_model.DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------ export
def test_export_names_and_config(exported):
    m, out = exported
    sd = load_file(str(out / "model.safetensors"))
    assert sorted(sd) == sorted(expected_names(L, "dflash2")) and len(sd) == 6 + 15 * L
    assert sd["layers.0.attention_conv.base_kernel"].shape == (2, TAPS, H)
    assert sd["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * TAPS * H // GROUP, H)
    assert sd["candidate_selector.predecessor_codebook"].shape == (V, RANK)
    assert sd["candidate_selector.successor_codebook"].shape == (V, RANK)
    assert sd["candidate_selector.hidden_projection.weight"].shape == (RANK, H)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {
        "mask_token_id": V - 1,
        "target_layer_ids": [1, 3, 5],
        "conv_kernel_size": TAPS,
        "conv_group_size": GROUP,
        "selector_rank": RANK,
        "selector_top_k": TOPK,
    }


def test_round_trip(exported):
    m, out = exported
    back = load_drafter(out)
    assert back.config == dataclasses.replace(m.config, attention=back.config.attention)
    for (n, a), (n2, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert n == n2
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_dflash_export_loads_as_dflash(tmp_path):
    out = export_drafter(_drafter(variant="dflash"), tmp_path / "d1")
    assert not hasattr(load_drafter(out), "candidate_selector")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


# ------------------------------------------------------------------------ reference parity
def test_forward_matches_the_reference(exported):
    m, out = exported
    ref = _reference(out)
    assert ref.block_size == BS and ref.candidate_selector.top_k == TOPK
    feats, block = _inputs()
    S = feats.shape[1]
    pos = torch.arange(S + BS)[None]
    with torch.no_grad():
        want = ref(position_ids=pos, noise_embedding=block, target_hidden=feats)
        got = m.forward_infer(block, feats, m.new_cache(), start=S)
    torch.testing.assert_close(got, want)


def test_training_forward_matches_inference_per_block():
    """The training path (many blocks in one stream) convolves within each block only: each
    block's hidden states equal a separate forward_infer of that block alone."""
    m = _drafter()
    S, N = 12, 3
    feats, _ = _inputs(S=S)
    g = torch.Generator().manual_seed(5)
    blocks = torch.randn(1, N * BS, H, generator=g)
    anchors = torch.tensor([[2, 5, 9]])
    valid = torch.ones(1, N, dtype=torch.bool)
    with torch.no_grad():
        got = m(blocks, feats, anchors, valid, "dense").view(1, N, BS, H)
        for j, a in enumerate(anchors[0].tolist()):
            want = m.forward_infer(blocks[:, j * BS : (j + 1) * BS], feats[:, :a], m.new_cache(), a)
            torch.testing.assert_close(got[:, j], want)


def test_propose_matches_the_reference_walk(exported):
    """The greedy selector walk against the reference `propose` on the same weights, hidden
    states and anchors; the walk must also differ from the plain argmax somewhere (else the
    test could not tell a walk from argmax)."""
    m, out = exported
    ref = _reference(out)
    g = torch.Generator().manual_seed(7)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
    differs = False
    for _ in range(6):
        hidden = torch.randn(3, BS - 1, H, generator=g)
        anchors = torch.randint(0, V, (3,), generator=g)
        with torch.no_grad():
            want, _, _ = ref.propose(hidden, anchors, head, 0.0)
            got = m.propose(hidden, head, anchors)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        differs |= bool((got != head(hidden).argmax(-1)).any())
    assert differs


def test_sampled_walk_draws_from_the_reference_distribution():
    """At T > 0 each slot's choice is a Gumbel-max sample of softmax(scores / T): its frequency
    over many draws matches those probabilities (one slot, fixed predecessor)."""
    m = _drafter()
    sel = m.candidate_selector
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(1, 1, H, generator=g)
    logits = torch.randn(1, 1, V, generator=g) * 2
    anchor = torch.tensor([4])
    n = 4000
    with torch.no_grad():
        unary, cand = torch.topk(logits, TOPK, dim=-1)
        scores = unary[0, 0] + sel.pairwise(hidden[0, 0], anchor[0], cand[0, 0])
        p = torch.softmax(scores / 0.7, -1)
        toks = sel.walk(hidden.expand(n, 1, H), logits.expand(n, 1, V), anchor.expand(n), 0.7, g)
    freq = (toks[:, 0, None] == cand[0, 0]).float().mean(0)
    torch.testing.assert_close(freq, p, atol=0.03, rtol=0)


def test_conv_is_causal_within_the_block():
    """Changing slot t of a block changes outputs at slots >= t of that block only."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2 * BS, H, generator=g)
    delta = torch.randn(1, 2 * BS, TAPS, H // GROUP, generator=g)
    base = torch.randn(TAPS, H, generator=g)
    y = grouped_causal_conv(x, delta, base, BS)
    x2 = x.clone()
    x2[:, 2] += 1.0  # block 0, slot 2
    d = (grouped_causal_conv(x2, delta, base, BS) - y).abs().sum(-1)[0]
    assert (d[:2] == 0).all() and (d[BS:] == 0).all() and (d[2 : 2 + TAPS] > 0).all()


# ------------------------------------------------------------------------- identity start
def test_warm_start_from_a_dflash_export_drafts_what_it_drafts(tmp_path):
    torch.manual_seed(1)
    d1 = DFlashDrafter(_cfg("dflash"))
    out = export_drafter(d1, tmp_path / "d1")
    pub = load_drafter(out)
    d2 = convert_variant(pub, "dflash2", OPTIONS)
    assert d2.config.variant == "dflash2" and d2.candidate_selector is not None
    feats, block = _inputs()
    S = feats.shape[1]
    g = torch.Generator().manual_seed(9)
    head = torch.nn.Linear(H, V, bias=False)
    anchors = torch.randint(0, V, (1,), generator=g)
    with torch.no_grad():
        want = pub.forward_infer(block, feats, pub.new_cache(), S)
        got = d2.forward_infer(block, feats, d2.new_cache(), S)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(
            d2.propose(got[:, 1:], head, anchors), head(want[:, 1:]).argmax(-1), rtol=0, atol=0
        )
        # the training path too, with the default (split) attention
        N = 2
        blocks = torch.randn(1, N * BS, H, generator=g)
        anc, ok = torch.tensor([[3, 7]]), torch.ones(1, N, dtype=torch.bool)
        torch.testing.assert_close(d2(blocks, feats, anc, ok), pub(blocks, feats, anc, ok))


def test_a_config_json_writing_options_as_floats_loads_them_as_ints(exported):
    """What the loader did before the variant registry: int(...) of each DFlash2 key."""
    _, out = exported
    c = out / "config.json"
    cfg = json.loads(c.read_text())
    cfg["dflash_config"]["conv_kernel_size"] = float(TAPS)
    c.write_text(json.dumps(cfg))
    back = load_drafter(out)
    assert back.config.options["conv_kernel_size"] == TAPS
    assert isinstance(back.config.options["conv_kernel_size"], int)
