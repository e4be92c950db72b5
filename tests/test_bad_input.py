"""Bad-input matrix through the CLI: each case ends with one clear message (what, where, what to
do) on stderr, exit code 2, the traceback only in the log file, and nothing already written lost.
The table in docs/guides/reliability.md lists the same cases."""

import json
import shutil

import pytest
import torch

from conftest import CHATML_SPECIALS, CHATML_TEMPLATE, word_tokenizer
from dflash_trainer.cli import main

GOOD = {
    "messages": [
        {"role": "user", "content": "Hello how is it going ?"},
        {"role": "assistant", "content": "Fine thanks . Tell me a joke"},
    ]
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama + ChatML tokenizer saved like a hub checkpoint (loads offline)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny_model")
    tok = word_tokenizer(CHATML_SPECIALS, CHATML_TEMPLATE)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok) + 8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _train(model_dir, tmp_path, *extra):
    return main(
        [
            "train",
            f"--run_dir={tmp_path / 'run'}",
            f"--target.model={model_dir}",
            "--target.num_taps=2",
            "--drafter.num_layers=1",
            "--drafter.num_heads=4",
            "--drafter.num_kv_heads=2",
            "--drafter.head_dim=8",
            "--drafter.intermediate_size=32",
            "--drafter.block_size=4",
            "--objective.num_anchors=4",
            "--optim.max_steps=2",
            "--metrics.wandb=off",
            "--metrics.tensorboard=false",
            "--metrics.console=false",
            f"--data.cache_dir={tmp_path / 'tokcache'}",
            "--data.eval_fraction=0",
            *extra,
        ]
    )


def _write(path, text: str | bytes):
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


CASES = {
    "malformed_json": (
        lambda p: _write(p / "d.jsonl", json.dumps(GOOD) + "\n{not json\n"),
        [r"d\.jsonl", r"line 2", "on_bad_record=skip"],
    ),
    "wrong_schema": (
        lambda p: _write(
            p / "d.jsonl", json.dumps({"messages": [{"role": "user", "text": "hi"}]}) + "\n"
        ),
        [r"d\.jsonl", "line 1", "content"],
    ),
    "non_utf8": (
        lambda p: _write(p / "d.jsonl", json.dumps(GOOD).encode() + b"\n\xff\xfe\n"),
        [r"d\.jsonl", "line 2", "UTF-8"],
    ),
    "empty_file": (lambda p: _write(p / "d.jsonl", ""), [r"d\.jsonl", "empty"]),
    "no_assistant_turn": (
        lambda p: _write(
            p / "d.jsonl", json.dumps({"messages": [{"role": "user", "content": "Hello"}]}) + "\n"
        ),
        ["no usable conversations", "no assistant reply"],
    ),
    "nonexistent_path": (lambda p: p / "missing.jsonl", [r"missing\.jsonl"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_data_gives_clear_error(case, model_dir, tmp_path, capsys):
    make, patterns = CASES[case]
    path = make(tmp_path)
    rc = _train(model_dir, tmp_path, f"--data.sources={path}")
    err = capsys.readouterr().err
    assert rc == 2, err
    import re

    for pat in patterns:
        assert re.search(pat, err, re.I), (pat, err)
    assert "Traceback" not in err
    log = tmp_path / "run" / "train.log"
    assert log.is_file() and "Traceback" in log.read_text()


def test_taps_beyond_the_target(model_dir, tmp_path, capsys):
    path = _write(tmp_path / "d.jsonl", json.dumps(GOOD) + "\n")
    rc = _train(model_dir, tmp_path, f"--data.sources={path}", "--target.taps=[1,40]")
    err = capsys.readouterr().err
    assert rc == 2 and "layer 40 does not exist" in err and "6 layers" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="flex is valid where CUDA is the device")
def test_flex_attention_on_cpu_is_refused_before_training(model_dir, tmp_path, capsys):
    path = _write(tmp_path / "d.jsonl", json.dumps(GOOD) + "\n")
    rc = _train(model_dir, tmp_path, f"--data.sources={path}", "--drafter.attention=flex")
    err = capsys.readouterr().err
    assert rc == 2 and "drafter.attention=flex needs CUDA" in err and "split" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_tokenizer_without_chat_template(model_dir, tmp_path, capsys):
    d = tmp_path / "no_template"
    shutil.copytree(model_dir, d)
    for f in d.glob("chat_template*"):
        f.unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    path = _write(tmp_path / "d.jsonl", json.dumps(GOOD) + "\n")
    rc = _train(d, tmp_path, f"--data.sources={path}")
    err = capsys.readouterr().err
    assert rc == 2 and "chat template" in err.lower()


def test_resume_with_another_config_and_tampered_checkpoint(model_dir, tmp_path, capsys):
    path = _write(tmp_path / "d.jsonl", "\n".join([json.dumps(GOOD)] * 8) + "\n")
    assert _train(model_dir, tmp_path, f"--data.sources={path}") == 0
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert ckpts
    before = (ckpts[-1] / "drafter.safetensors").read_bytes()
    capsys.readouterr()
    rc = _train(
        model_dir,
        tmp_path,
        f"--data.sources={path}",
        "--checkpoint.resume=true",
        "--drafter.intermediate_size=48",
    )
    err = capsys.readouterr().err
    assert rc == 2 and "drafter.intermediate_size" in err and "another drafter config" in err
    # nothing already written was touched
    assert (ckpts[-1] / "drafter.safetensors").read_bytes() == before
    # a truncated weights file is named, not a crash
    (ckpts[-1] / "drafter.safetensors").write_bytes(before[: len(before) // 2])
    rc = _train(model_dir, tmp_path, f"--data.sources={path}", "--checkpoint.resume=true")
    err = capsys.readouterr().err
    assert rc == 2 and "drafter.safetensors" in err and "corrupt" in err


def test_truncated_export_in_eval(model_dir, tmp_path, capsys):
    path = _write(tmp_path / "d.jsonl", "\n".join([json.dumps(GOOD)] * 8) + "\n")
    assert _train(model_dir, tmp_path, f"--data.sources={path}") == 0
    export = tmp_path / "run" / "export"
    w = export / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    capsys.readouterr()
    rc = main(
        [
            "eval",
            f"--run_dir={tmp_path / 'run'}",
            f"--target.model={model_dir}",
            "--target.num_taps=2",
            f"--eval.datasets={path}",
            "--eval.dataset_prompts=1",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "model.safetensors" in err
