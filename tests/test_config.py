import pytest

from dflash_trainer.cli import main
from dflash_trainer.config import (
    Config,
    ConfigError,
    from_dict,
    help_text,
    list_presets,
    load_config,
    to_dict,
    to_toml,
)


def test_defaults_and_presets_resolve():
    assert {"smollm2-cpu", "qwen3-8b"} <= set(list_presets())
    for name in list_presets():
        cfg = load_config(name)
        assert isinstance(cfg, Config)
    cfg = load_config("qwen3-8b")
    assert cfg.drafter.num_layers == 5 and cfg.target.model == "Qwen/Qwen3-8B"


def test_override_flags_types():
    cfg = load_config(
        None,
        None,
        [
            "--optim.lr=1e-3",
            "--pipeline.target_devices",
            "cuda:1,cuda:2",
            "--target.taps=[1,2,3]",
            "--checkpoint.resume=true",
        ],
    )
    assert cfg.optim.lr == 1e-3
    assert cfg.pipeline.target_devices == ["cuda:1", "cuda:2"]
    assert cfg.target.taps == [1, 2, 3]
    assert cfg.checkpoint.resume is True


def test_unknown_flag_suggests_closest():
    with pytest.raises(
        ConfigError, match=r"--drafter\.num_layer'.*Did you mean '--drafter\.num_layers'"
    ):
        load_config(None, None, ["--drafter.num_layer=3"])


def test_unknown_toml_key_names_file_and_suggests(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[optim]\nlearning_rate = 1.0\n")
    with pytest.raises(ConfigError, match=r"optim\.learning_rate.*c\.toml"):
        load_config(None, str(p))
    p.write_text("[optim]\nlr = 'fast'\n")
    with pytest.raises(ConfigError, match=r"optim\.lr: cannot read 'fast' as float"):
        load_config(None, str(p))


def test_bad_value_names_field_and_range():
    with pytest.raises(
        ConfigError, match=r"optim\.warmup_ratio: 2\.0 is outside the valid range \[0\.0, 1\.0\]"
    ):
        load_config(None, None, ["--optim.warmup_ratio=2"])
    with pytest.raises(ConfigError, match=r"pipeline\.schedule: 'fast' is not one of"):
        load_config(None, None, ["--pipeline.schedule=fast"])
    with pytest.raises(ConfigError, match="num_kv_heads"):
        load_config(None, None, ["--drafter.num_heads=9", "--drafter.num_kv_heads=2"])
    with pytest.raises(ConfigError, match="unknown preset 'smollm2'.*Did you mean 'smollm2-cpu'"):
        load_config("smollm2")


def test_round_trip_dict_and_toml(tmp_path):
    cfg = load_config("smollm2-cpu", None, ["--optim.lr=0.002"])
    assert to_dict(from_dict(to_dict(cfg))) == to_dict(cfg)
    p = tmp_path / "x.toml"
    p.write_text(to_toml(cfg))
    assert to_dict(load_config(None, str(p))) == to_dict(cfg)


def test_help_lists_every_field_with_unit_and_default():
    text = help_text()
    assert "--batching.max_tokens=<int>" in text and "unit: tokens" in text
    assert "default: 6e-4" in text.replace("0.0006", "6e-4")
    from dflash_trainer.config import all_keys

    missing = [k for k in all_keys() if f"--{k}=" not in text]
    assert not missing


def test_cli_config_show_and_errors(capsys):
    assert main(["config", "show", "--preset", "smollm2-cpu", "--optim.lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert "lr = 0.5" in out and "[drafter]" in out
    assert main(["config", "show", "--optim.lrr=1"]) == 2
    assert "Did you mean '--optim.lr'" in capsys.readouterr().err
