"""Export: published names/config, interop with the reference `dflash` package, round trip,
clear errors on damaged files."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trainer.errors import UserError
from dflash_trainer.models.drafter import DFlashConfig, DFlashDrafter
from dflash_trainer.models.export import expected_names, export_drafter, load_drafter

H, NF, BS, L = 32, 3, 4, 2


def _drafter(seed=0):
    torch.manual_seed(seed)
    cfg = DFlashConfig(
        hidden_size=H,
        num_layers=L,
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
        max_position_embeddings=512,
    )
    m = DFlashDrafter(cfg)
    with torch.no_grad():  # non-trivial norm weights, so a mix-up of norms would show
        for n, p in m.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return m


@pytest.fixture
def exported(tmp_path):
    m = _drafter()
    out = export_drafter(m, tmp_path / "drafter")
    return m, out


def test_files_names_and_config(exported):
    m, out = exported
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    sd = load_file(str(out / "model.safetensors"))
    assert sorted(sd) == sorted(expected_names(L)) and len(sd) == 3 + 11 * L
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": [1, 3, 5]}
    assert cfg["num_target_layers"] == 8 and cfg["block_size"] == BS
    assert cfg["layer_types"] == ["full_attention"] * L and cfg["sliding_window"] is None
    assert cfg["rope_parameters"]["rope_theta"] == 10000.0 and cfg["dtype"] == "float32"
    assert not cfg["attention_bias"] and not cfg["tie_word_embeddings"]
    assert cfg["hidden_act"] == "silu"


def test_reference_package_loads_and_matches_forward_infer(exported):
    dflash_model = pytest.importorskip("dflash.model")
    m, out = exported
    ref = dflash_model.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    assert ref.target_layer_ids == [1, 3, 5] and ref.block_size == BS
    assert ref.mask_token_id == 127
    g = torch.Generator().manual_seed(3)
    S = 9
    feats = torch.randn(1, S, NF * H, generator=g)
    block = torch.randn(1, BS, H, generator=g)
    pos = torch.arange(S + BS)[None]  # context 0..S-1, the block at S..S+bs-1
    with torch.no_grad():
        want = ref(position_ids=pos, noise_embedding=block, target_hidden=feats)
        got = m.forward_infer(block, feats, m.new_cache(), start=S)
    torch.testing.assert_close(got, want)


def test_round_trip(exported):
    m, out = exported
    m2 = load_drafter(out, "cpu")
    assert m2.config == m.config
    for (n, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n
    g = torch.Generator().manual_seed(0)
    emb, feats = torch.randn(1, 2 * BS, H, generator=g), torch.randn(1, 7, NF * H, generator=g)
    anchors, valid = torch.tensor([[2, 4]]), torch.tensor([[True, True]])
    torch.testing.assert_close(m2(emb, feats, anchors, valid), m(emb, feats, anchors, valid))


def test_bf16_export_and_overwrite_is_atomic(tmp_path):
    m = _drafter()
    out = export_drafter(m, tmp_path / "d", dtype=torch.bfloat16)
    out = export_drafter(m, tmp_path / "d", dtype=torch.bfloat16)  # replaces the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temp/old dirs left
    m2 = load_drafter(out)
    assert m2.fc.weight.dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_truncated_file_is_a_user_error(exported):
    _, out = exported
    w = out / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    with pytest.raises(UserError, match="truncated or damaged"):
        load_drafter(out)


def test_tampered_names_and_shapes_are_user_errors(exported):
    _, out = exported
    w = out / "model.safetensors"
    sd = load_file(str(w))
    bad = dict(sd)
    bad["layers.0.self_attn.q_proj.bias"] = bad.pop("layers.0.self_attn.q_proj.weight")
    save_file(bad, str(w))
    with pytest.raises(UserError, match="q_proj.weight"):
        load_drafter(out)
    bad = dict(sd)
    bad["fc.weight"] = torch.zeros(H, 2 * H)  # 2 taps instead of 3
    save_file(bad, str(w))
    with pytest.raises(UserError, match="fc.weight"):
        load_drafter(out)


def test_config_errors(exported, tmp_path):
    _, out = exported
    c = out / "config.json"
    cfg = json.loads(c.read_text())
    cfg["num_hidden_layers"] = 3  # weights hold 2 layers
    c.write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="do not match"):
        load_drafter(out)
    del cfg["dflash_config"]
    c.write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="dflash_config"):
        load_drafter(out)
    c.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_drafter(out)
    with pytest.raises(UserError, match="does not exist"):
        load_drafter(tmp_path / "nowhere")


def test_training_record_keeps_the_target_revision():
    from dflash_trainer.config import Config
    from dflash_trainer.config_io import to_dict
    from dflash_trainer.models.export import training_record

    cfg = Config()
    cfg.target.model, cfg.target.revision = "org/tiny-target", "v1.0"
    rec = training_record(to_dict(cfg), step=3)
    assert rec["target"]["model"] == "org/tiny-target" and rec["target"]["revision"] == "v1.0"
    assert rec["config"]["target"]["revision"] == "v1.0"  # eval --drafter loads that revision
    cfg.target.revision = ""
    assert training_record(to_dict(cfg))["target"]["revision"] is None  # main


def test_training_record_names_the_target_an_engine_loads(tmp_path):
    from dflash_trainer.config import Config
    from dflash_trainer.config_io import to_dict
    from dflash_trainer.models.export import training_record

    cfg = Config()
    cfg.target.model, cfg.target.revision = "org/tiny-target", "v1.0"
    t = training_record(to_dict(cfg))["target"]
    assert t["engine_model"] == "org/tiny-target" and t["engine_revision"] == "v1.0"
    cfg.target.model = str(tmp_path)  # a local directory: its absolute path
    t = training_record(to_dict(cfg))["target"]
    assert t["engine_model"] == str(tmp_path.resolve()) and t["engine_revision"] is None


def test_export_dtype_names_and_the_last_layer_tap_warning(tmp_path, caplog):
    from dflash_trainer.models.export import export_dtype, last_layer_tap_warning

    assert export_dtype("bfloat16") is torch.bfloat16 and export_dtype("keep") is None
    with pytest.raises(UserError):
        export_dtype("int8")
    m = _drafter()
    assert last_layer_tap_warning(m.config) is None  # taps 1, 3, 5 of 8 layers
    m.config.target_layer_ids = [1, 3, 7]
    assert "SGLang" in last_layer_tap_warning(m.config)
    with caplog.at_level("WARNING"):
        export_drafter(m, tmp_path / "d", torch.bfloat16)
    assert "sglang#32204" in caplog.text
    assert json.loads((tmp_path / "d" / "config.json").read_text())["dtype"] == "bfloat16"


def test_an_export_for_a_target_no_engine_serves_says_so():
    from dflash_trainer.models.export import serving_note

    note = serving_note(["Gemma3ForCausalLM"])
    assert note is not None and "Gemma3ForCausalLM" in note and "no engine serves it" in note
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM", "GptOssForCausalLM"):
        assert serving_note([arch]) is None
    assert serving_note(None) is None  # a config that names no class: nothing claimed
