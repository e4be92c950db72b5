"""Any target a user brings: every decoder family the serving engines serve, on tiny random
configs (tests/families.py), through the start-up tap check, `generate`, a few training steps
from both starts, the export and evaluation; `drafter.init = target` proven to compute the
target layer's function or refused naming what differs (models/layer_map.py,
docs/guides/families.md).
"""

import json
import math
import types

import pytest
import torch

from dflash_trainer.cli import main
from dflash_trainer.errors import UserError
from dflash_trainer.models.layer_map import layer_error, norm_scale
from dflash_trainer.models.target import TargetModel
from dflash_trainer.models.target_layout import rope_theta
from dflash_trainer.run.build import build_drafter
from families import FAMILIES, MAPPED, tiny_family_model
from tiny import base_tokenizer, tiny_config

AUTO_SHAPES = {  # 0 = the target's (what init=target needs)
    "drafter.num_heads": 0,
    "drafter.num_kv_heads": 0,
    "drafter.head_dim": 0,
    "drafter.intermediate_size": 0,
}

REFUSED_BECAUSE = {  # what the refusal must name
    "qwen2": ["biases on q_proj/k_proj/v_proj"],
    "gemma3": ["activation gelu_pytorch_tanh", "sandwich norms"],
    "qwen3_moe": ["mixture of experts"],
}


def _target(family, **kw):
    return TargetModel.from_hf(tiny_family_model(family, **kw), base_tokenizer(), [1, 2])


def _drafter(tmp_path, target, **over):
    flags = {**AUTO_SHAPES, "drafter.init": "target", "drafter.num_layers": 2, **over}
    return build_drafter(tiny_config(tmp_path, **flags), target, "cpu")


# ------------------------------------------------------------------ the start, per family


@pytest.mark.parametrize("family", FAMILIES)
def test_target_start_is_exact_or_refused(tmp_path, family):
    target = _target(family)
    if family not in MAPPED:
        with pytest.raises(UserError) as e:
            _drafter(tmp_path, target)
        for part in REFUSED_BECAUSE[family] + ["--drafter.init=random"]:
            assert part in str(e.value)
        return
    d = _drafter(tmp_path, target)  # shapes followed the target: nothing typed
    for i, src in enumerate((2, 3)):
        err = layer_error(d.layers[i], target.layers[src], target.model, src, d.rope_cos_sin)
        assert err < 1e-4, (family, src, err)  # fp32 rounding; a mismatch is O(1)
    H = d.config.hidden_size
    torch.testing.assert_close(d.norm.weight, norm_scale(target.final_norm, H, "norm"))


def test_gemma3_offset_norms_map_to_one_plus_w():
    target = _target("gemma3")
    norm = target.layers[0].input_layernorm
    torch.testing.assert_close(norm_scale(norm, 64, "n"), 1.0 + norm.weight.float())


def test_a_layer_the_drafter_cannot_compute_is_caught_without_a_named_cause(tmp_path):
    """The check decides by output, not by a list of known differences: a RoPE base other than
    the target's, or Llama 3's frequency scaling, passes every tensor-name check."""
    target = _target("llama")
    with pytest.raises(UserError, match=r"RoPE base 5000 \(the target's layer 2 uses 10000\)"):
        _drafter(tmp_path, target, **{"drafter.rope_theta": 5000})
    with pytest.raises(UserError, match="RoPE type 'llama3'"):
        _drafter(tmp_path, _llama3_target())


def _llama3_target():
    """The tiny Llama with Llama 3's frequency-scaled RoPE (its rotary built from them)."""
    target = _target("llama")
    cfg = target.model.config
    cfg.rope_parameters = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return TargetModel.from_hf(type(target.model)(cfg).eval(), base_tokenizer(), [1, 2])


def test_llama3_rope_maps_when_the_drafter_takes_the_targets_form(tmp_path):
    """drafter.rope = target: the drafter rotates with the target's own Llama 3 scaling, so the
    copied layers compute the target layers' function (models/rope.py)."""
    llama3 = _llama3_target()
    d = _drafter(tmp_path, llama3, **{"drafter.rope": "target"})
    assert d.config.rope_scaling["rope_type"] == "llama3"
    for i, src in enumerate((2, 3)):
        err = layer_error(d.layers[i], llama3.layers[src], llama3.model, src, d.rope_cos_sin, 40)
        assert err < 1e-4, (src, err)


def test_shapes_that_differ_name_the_values_to_pass(tmp_path):
    target = _target("qwen3")
    with pytest.raises(UserError) as e:
        _drafter(tmp_path, target, **{"drafter.intermediate_size": 64})
    msg = str(e.value)
    for flag in ("--drafter.num_heads=4", "--drafter.num_kv_heads=2", "--drafter.head_dim=16"):
        assert flag in msg
    assert "--drafter.intermediate_size=128" in msg and "drafter.init=random" in msg


# ------------------------------------------------------------------------------ RoPE base


def test_rope_base_follows_the_copied_layer_type(tmp_path):
    """Gemma 3: sliding layers rotate with a local base (10k), full layers with a global one
    (1M). The drafter gets the base of the layer it starts from; at random, the global one."""
    target = _target("gemma3")
    cfg = target.model.config

    def theta(**over):
        c = tiny_config(tmp_path, **{**AUTO_SHAPES, "drafter.num_layers": 1, **over})
        from dflash_trainer.models.drafter import DFlashConfig

        return DFlashConfig.from_configs(c.drafter, target).rope_theta

    assert cfg.layer_types[3] == "full_attention" and cfg.layer_types[2] == "sliding_attention"
    assert theta(**{"drafter.init": "target"}) == 1e6  # copies layer 3
    assert theta(**{"drafter.init": "target", "drafter.init_tap": 0}) == 1e4  # copies layer 2
    assert theta() == 1e6
    assert theta(**{"drafter.rope_theta": 500}) == 500


def test_a_config_without_a_rope_base_says_which_the_drafter_got():
    bare = types.SimpleNamespace(hidden_size=64)
    theta, note = rope_theta(bare)
    assert theta == 10000.0 and "names no RoPE base" in note and "default" in note
    old = types.SimpleNamespace(rope_theta=5e5)  # transformers 4.x: top-level
    assert rope_theta(old)[0] == 5e5


def test_embedding_scale_is_reported_and_the_raw_table_used():
    target = _target("gemma3")
    assert target.embed_scale == pytest.approx(math.sqrt(64))
    assert target.embed_weight is target.model.get_input_embeddings().weight
    assert _target("llama").embed_scale == 1.0


# ------------------------------------------------------------------- the CLI, per family


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    """(family, a saved tiny model dir, raw-text training data, prompts)."""
    root = tmp_path_factory.mktemp(request.param)
    model = root / "model"
    tiny_family_model(request.param).save_pretrained(model)
    base_tokenizer().save_pretrained(model)
    data = root / "d.jsonl"
    rows = [{"text": " ".join([f"the cat sat on the mat {i % 5}"] * 6)} for i in range(16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = root / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": "the cat sat"}) + "\n" for i in range(2))
    )
    return request.param, model, data, prompts


COMMON = [
    "--target.taps=1,2",
    "--data.format=text",
    "--data.max_length=64",
    "--metrics.wandb=off",
    "--metrics.tensorboard=false",
    "--metrics.console=false",
    "--metrics.log_every_s=0.05",
    "--metrics.tick_s=0.05",
]


def _train(family_dir, tmp_path, init):
    family, model, data, _ = family_dir
    run = tmp_path / f"run-{init}"
    rc = main(
        [
            "train",
            f"--run_dir={run}",
            f"--target.model={model}",
            f"--data.sources={data}",
            f"--data.cache_dir={tmp_path / 'tok'}",
            f"--drafter.init={init}",
            "--drafter.num_layers=1",
            "--drafter.block_size=4",
            "--objective.num_anchors=4",
            "--batching.max_tokens=256",
            "--optim.max_steps=3",
            "--pipeline.feature_cache_gb=0",
            "--eval.periodic_prompts=1",
            "--eval.max_new_tokens=8",
            *COMMON,
        ]
    )
    return rc, run


def first_loss(run) -> float:
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "drafter/loss" in rec:
            return float(rec["drafter/loss"])
    raise AssertionError("no loss logged")


def test_cli_generate_train_export_eval(family_dir, tmp_path, capsys):
    family, model, _, prompts = family_dir
    out = tmp_path / "gen.jsonl"
    argv = ["generate", f"--generate.prompts={prompts}", f"--target.model={model}"]
    argv += [f"--generate.out={out}"]
    assert (
        main([*argv, f"--run_dir={tmp_path / 'gen'}", "--generate.max_new_tokens=4", *COMMON]) == 0
    )
    assert [json.loads(r)["id"] for r in out.read_text().splitlines()] == ["p0", "p1"]

    rc, run = _train(family_dir, tmp_path, "random")
    assert rc == 0, capsys.readouterr().err
    assert "match output_hidden_states" in (run / "train.log").read_text()  # the tap check
    assert (run / "export" / "model.safetensors").is_file()
    losses = {"random": first_loss(run)}
    argv = ["eval", f"--run_dir={run}", f"--eval.datasets={prompts}", "--eval.max_new_tokens=8"]
    assert main([*argv, "--data.format=text"]) == 0
    (res,) = json.loads((run / "eval.json").read_text())["datasets"].values()
    assert res["lossless"] and res["tau"] >= 1.0

    capsys.readouterr()
    rc, run = _train(family_dir, tmp_path, "target")
    if family in MAPPED:
        assert rc == 0, capsys.readouterr().err
        losses["target"] = first_loss(run)
    else:
        err = capsys.readouterr().err
        assert rc == 2 and "drafter.init=target" in err and "--drafter.init=random" in err
        losses["target"] = "refused"
    assert all(isinstance(v, str) or math.isfinite(v) for v in losses.values())
    print(f"\n{family}: first-step loss {losses}")
