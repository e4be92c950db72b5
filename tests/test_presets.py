"""Presets say what they do: qwen3-8b names no training data, so train refuses without
--data.sources (before loading anything) instead of training on the embedded prompts."""

import pytest

from dflash_trainer.cli import main
from dflash_trainer.config_io import load_config
from dflash_trainer.errors import UserError
from dflash_trainer.run import train
from dflash_trainer.run.build import require_sources


def test_qwen3_preset_names_no_data():
    cfg = load_config("qwen3-8b")
    assert cfg.data.sources == []
    with pytest.raises(UserError, match="--data.sources=") as e:
        require_sources(cfg)
    assert "generate" in str(e.value)
    require_sources(load_config("qwen3-8b", None, ["--data.sources=answers.jsonl"]))
    assert load_config("smollm2-cpu").data.sources == ["embedded"]


def test_train_with_the_preset_alone_refuses_before_touching_anything(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main(["train", "--preset", "qwen3-8b", f"--run_dir={run_dir}", "--nproc", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "no training data" in err and "--data.sources=" in err
    assert not run_dir.exists()  # no directory, no torchrun launch, no target download


def test_library_train_refuses_too(tmp_path):
    cfg = load_config("qwen3-8b", None, [f"--run_dir={tmp_path / 'run'}"])
    with pytest.raises(UserError, match="no training data"):
        train(cfg)  # would otherwise load Qwen/Qwen3-8B


def test_config_show_says_it(capsys):
    assert main(["config", "show", "--preset", "qwen3-8b"]) == 0
    assert "sources = []" in capsys.readouterr().out
