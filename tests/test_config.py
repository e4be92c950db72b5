import dataclasses
import re

import pytest

from dflash_trainer import config_io
from dflash_trainer.cli import main
from dflash_trainer.config import RENAMED, RENAMED_VALUES, Config, ConfigError
from dflash_trainer.config_io import (
    all_keys,
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
    from dflash_trainer.config_io import all_keys

    missing = [k for k in all_keys() if f"--{k}=" not in text]
    assert not missing


def test_cli_config_show_and_errors(capsys):
    assert main(["config", "show", "--preset", "smollm2-cpu", "--optim.lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert "lr = 0.5" in out and "[drafter]" in out
    assert main(["config", "show", "--optim.lrr=1"]) == 2
    assert "Did you mean '--optim.lr'" in capsys.readouterr().err


# Every config key, by section. A rename or a removal changes this table on purpose: keep the old
# key in config.RENAMED (an error that names the new one) and update presets, README and docs.
PINNED_KEYS = {
    "": ["run_dir", "overwrite", "seed"],
    "data": [
        "sources",
        "on_bad_record",
        "max_length",
        "overlong",
        "min_supervised",
        "eval_fraction",
        "report_sources",
        "truncated",
        "format",
        "chat_template",
        "cache_dir",
        "roots",
    ],
    "batching": [
        "max_tokens",
        "max_batch_size",
        "pad_multiple",
        "num_buckets",
        "seed",
        "sort_window",
    ],
    "target": [
        "model",
        "revision",
        "attn_implementation",
        "dtype",
        "num_taps",
        "taps",
        "trust_remote_code",
        "cache_dir",
        "enable_thinking",
        "packed_linear",
        "check_taps",
    ],
    "drafter": [
        "init",
        "init_tap",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "block_size",
        "mask_token_id",
        "rms_norm_eps",
        "rope_theta",
        "rope",
        "attention",
        "init_std",
        "init_from",
        "variant",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
    ],
    "objective": [
        "num_anchors",
        "anchors",
        "gamma",
        "loss_chunk_blocks",
        "weighting",
        "dpace_alpha",
        "feature_noise",
        "kd_weight",
        "label_source",
        "kd_temperature",
        "reject_weight",
        "loss_slots",
        "hidden_weight",
        "selector_weight",
    ],
    "optim": [
        "lr",
        "min_lr_ratio",
        "warmup_ratio",
        "weight_decay",
        "beta1",
        "beta2",
        "eps",
        "grad_clip",
        "epochs",
        "max_steps",
        "time_budget_s",
        "grad_accum",
        "max_consecutive_skips",
    ],
    "pipeline": [
        "schedule",
        "target_devices",
        "drafter_device",
        "work_queue_size",
        "hs_queue_size",
        "memory_plan",
        "cpu_threads",
        "target_thread_share",
        "share_cores",
        "share_trial_windows",
        "feature_cache_gb",
        "capture_features",
        "poll_s",
        "shutdown_deadline_s",
        "stall_timeout_s",
        "precision",
        "fault",
        "collective_timeout_s",
        "split",
    ],
    "checkpoint": [
        "every_steps",
        "keep_last",
        "resume",
        "resume_from",
        "async_write",
        "write_timeout_s",
        "export_dtype",
    ],
    "metrics": [
        "log_every_s",
        "tick_s",
        "wandb",
        "wandb_project",
        "wandb_entity",
        "wandb_group",
        "wandb_tags",
        "tensorboard",
        "console",
        "peak_tflops",
        "wandb_init_timeout_s",
        "wandb_finish_timeout_s",
    ],
    "eval": [
        "every_steps",
        "at_end",
        "at_end_sources",
        "at_end_baseline",
        "at_end_adaptive",
        "compare",
        "periodic_prompts",
        "dataset_prompts",
        "validation_fraction",
        "validation_prompts",
        "dtype",
        "tau_sim",
        "max_new_tokens",
        "block_size",
        "verify",
        "datasets",
        "heldout_path",
        "seed",
        "engine",
        "parity",
        "parity_prompts",
        "parity_tolerance",
        "vllm_python",
    ],
    "synth": [
        "prompts",
        "seed",
        "max_tokens",
        "min_chars",
        "near_duplicate",
        "hints",
        "system_prompt",
        "exclude",
        "max_rounds",
    ],
    "generate": [
        "prompts",
        "out",
        "limit",
        "shard",
        "max_new_tokens",
        "batch_size",
        "engine",
        "chunk_prompts",
        "vllm_args",
    ],
    "export": ["source", "out", "dtype"],
    **{
        f"{s}": ["temperature", "top_p", "top_k"]
        for s in ("eval.sampling", "synth.sampling", "synth.answer_sampling", "generate.sampling")
    },
    "bench": ["quick", "time_budget_s", "only"],
}


def test_the_set_of_config_keys_is_pinned():
    got: dict[str, list[str]] = {}
    for key in all_keys():
        section, _, name = key.rpartition(".")
        got.setdefault(section, []).append(name)
    assert got == PINNED_KEYS


@pytest.mark.parametrize("old,new", sorted(RENAMED.items()))
def test_a_renamed_key_is_an_error_that_names_the_new_one(tmp_path, old, new):
    """A key with two meanings became two keys (a tuple): the error names both, and a saved
    value goes to both."""
    news = (new,) if isinstance(new, str) else new
    assert all(n in all_keys() for n in news) and old not in all_keys()
    both = " and ".join(f"'--{n}'" for n in news)
    with pytest.raises(
        ConfigError, match=re.escape(f"'--{old}'") + ".*renamed to " + re.escape(both)
    ):
        load_config(None, None, [f"--{old}=1"])
    section, _, name = old.rpartition(".")
    toml = tmp_path / "old.toml"
    toml.write_text(f"[{section}]\n{name} = 1\n")
    with pytest.raises(ConfigError, match=f"'{old}'.*renamed to '{news[0]}'"):
        load_config(None, str(toml))
    # a config saved by an older version (an export's training.json) reads under the new name
    value = _another_valid_value(news[0])
    cfg = load_config(None, None, [], base={section: {name: value}})
    assert all(get_value(cfg, n) == value for n in news)


@pytest.mark.parametrize("key_old,new", sorted(RENAMED_VALUES.items()))
def test_a_renamed_value_is_an_error_that_names_the_new_one(tmp_path, key_old, new):
    """One precision vocabulary: an old spelling from a flag or a file is an error naming the
    new one; a config saved by an older version (a checkpoint, an export's training.json) reads
    it as the new one."""
    key, old = key_old
    assert new in _field(key).metadata["choices"] and old not in _field(key).metadata["choices"]
    with pytest.raises(ConfigError, match=f"{key}: '{old}'.*renamed to '{new}'"):
        load_config(None, None, [f"--{key}={old}"])
    section, _, name = key.rpartition(".")
    toml = tmp_path / "old.toml"
    toml.write_text(f'[{section}]\n{name} = "{old}"\n')
    with pytest.raises(ConfigError, match=f"{key}: '{old}'.*renamed to '{new}'"):
        load_config(None, str(toml))
    assert get_value(load_config(None, None, [], base={section: {name: old}}), key) == new
    saved = config_io.to_dict(Config())
    saved[section][name] = old
    assert get_value(config_io.from_dict(saved), key) == new


def _field(key):
    section, _, name = key.rpartition(".")
    holder = get_value(Config(), section) if section else Config()
    return {f.name: f for f in dataclasses.fields(holder)}[name]


def _another_valid_value(key):
    """A value `key` accepts that is not its default: another choice, or a number in range."""
    f = _field(key)
    default, m = f.default, f.metadata
    if m.get("choices"):
        return next(c for c in m["choices"] if c != default)
    hi = m.get("max")
    value = default + 1 if hi is None or default + 1 <= hi else (default + m.get("min", 0)) / 2
    assert value != default and (hi is None or value <= hi) and value >= (m.get("min") or 0)
    return type(default)(value) if isinstance(default, int) else value


def get_value(cfg, key):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(
    "argv,flag,key",
    [
        (["generate", "--max-new-tokens", "4"], "--max-new-tokens", "generate.max_new_tokens"),
        (["generate", "--output=x.jsonl"], "--output", "generate.out"),
        (["export", "ckpt", "--out", "x"], "--out", "export.out"),
        (["bench", "--only", "bench_kd.py"], "--only", "bench.only"),
    ],
)
def test_a_command_flag_that_became_a_config_key_names_it(capsys, argv, flag, key):
    """generate/export/bench settings are config sections; their old flags name the key."""
    assert main(argv) == 2
    assert f"'{flag}' of `{argv[0]}` is now the config key '--{key}'" in capsys.readouterr().err


def test_the_export_positional_is_export_source():
    from dflash_trainer.cli import build_parser, config_overrides

    args, rest = build_parser().parse_known_args(["export", "ck", "--export.out=o"])
    assert config_overrides(args, rest) == ["--export.source=ck", "--export.out=o"]
    cfg = load_config(None, None, config_overrides(args, rest))
    assert (cfg.export.source, cfg.export.out) == ("ck", "o")


def test_a_presets_fp32_cpu_table_applies_where_the_drafter_trains_in_fp32(
    cpu_native_bf16, monkeypatch, tmp_path
):
    """[fp32_cpu]: the preset's shape on a CPU without native bf16 (auto precision), after the
    preset's own values and before a config file or flags; absent on a bf16 CPU."""
    from dflash_trainer import config_io

    (tmp_path / "p.toml").write_text(
        "[objective]\nnum_anchors = 40\nloss_slots = 4\n"
        "[fp32_cpu]\nobjective.num_anchors = 20\n[fp32_cpu.optim]\nlr = 0.004\n"
    )
    monkeypatch.setattr(config_io, "PRESET_DIR", tmp_path)
    cfg = config_io.load_config("p")
    fp32 = not cpu_native_bf16
    assert cfg.objective.num_anchors == (20 if fp32 else 40) and cfg.objective.loss_slots == 4
    assert cfg.optim.lr == (0.004 if fp32 else config_io.Config().optim.lr)
    assert config_io.preset_kind_table("p", cfg) == (
        ("fp32_cpu", {"objective.num_anchors": 20, "optim.lr": 0.004}) if fp32 else ("", {})
    )
    flags = config_io.load_config("p", overrides=["--objective.num_anchors=33"])
    assert flags.objective.num_anchors == 33  # a flag wins over the table, and is not said as its
    assert config_io.preset_kind_table("p", flags) == (
        ("fp32_cpu", {"optim.lr": 0.004}) if fp32 else ("", {})
    )
    bf16 = config_io.load_config("p", overrides=["--pipeline.precision=bfloat16"])
    assert bf16.objective.num_anchors == 40  # the drafter autocasts: not the fp32 shape
    assert config_io.load_config("p", overrides=["--pipeline.precision=float32"]).optim.lr == 0.004


@pytest.mark.parametrize("card_gib,applies", [(79.2, True), (139.8, False), (0.0, False)])
def test_a_presets_gpu_80gb_table_applies_on_an_80gb_card(monkeypatch, card_gib, applies):
    """qwen3-8b's [gpu_80gb]: where the drafter's GPU has ~80 GB (H100, A100 80 GB), the shape
    its memory plan fits (bench/RESULTS.md); an H200 (141 GB) and a CPU keep the preset's own."""
    from dflash_trainer import config_io

    monkeypatch.setattr(config_io, "card_memory_gib", lambda device: card_gib)
    cfg = config_io.load_config("qwen3-8b")
    table, shape = config_io.preset_kind_table("qwen3-8b", cfg)
    assert (table == "gpu_80gb") is applies
    assert cfg.batching.max_batch_size == (4 if applies else 8)
    assert cfg.optim.grad_accum == (2 if applies else 1)  # the same rows per optimizer step
    assert cfg.objective.num_anchors == 512  # the recipe's anchors per row on every card
