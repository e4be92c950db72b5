"""List-valued fields accept the forms users type (a,b / [a,b] / TOML) from flags, --config
files and presets, for every list field; anything else names the accepted syntax."""

import typing

import pytest

from dflash_trainer.config import ConfigError
from dflash_trainer.config_io import iter_fields, load_config, parse_list

LIST_KEYS = [k for k, _, tp in iter_fields() if typing.get_origin(tp) is list]


@pytest.mark.parametrize(
    "text,want",
    [
        ("a.jsonl,b.jsonl", ["a.jsonl", "b.jsonl"]),
        ("a.jsonl", ["a.jsonl"]),
        ("[a.jsonl]", ["a.jsonl"]),
        ("[a.jsonl, b.jsonl@3]", ["a.jsonl", "b.jsonl@3"]),
        ('["a.jsonl","b.jsonl"]', ["a.jsonl", "b.jsonl"]),
        ("['a.jsonl', 'b c.jsonl']", ["a.jsonl", "b c.jsonl"]),
        ('"a.jsonl", b.jsonl', ["a.jsonl", "b.jsonl"]),
        ("", []),
        ("[]", []),
        (" [ ] ", []),
    ],
)
def test_parse_list_forms(text, want):
    assert parse_list(text) == want


def test_every_list_field_takes_every_form(tmp_path):
    assert LIST_KEYS  # data.sources, target.taps, pipeline.target_devices, eval.datasets, ...
    for key in LIST_KEYS:
        ints = key == "target.taps"
        # elements each field accepts: ids, or KEY=VALUE pairs (generate.vllm_args), or names
        a, b = {"target.taps": ("1", "3"), "generate.vllm_args": ("x=1", "y=2")}.get(
            key, ("x", "y")
        )
        want = [1, 3] if ints else [a, b]
        forms = [f"{a},{b}", f"[{a},{b}]", f"[{a}, {b}]"]
        forms.append("[1, 3]" if ints else f'["{a}", "{b}"]')
        for form in forms:
            cfg = load_config(None, None, [f"--{key}={form}"])
            obj = cfg
            for part in key.split("."):
                obj = getattr(obj, part)
            assert obj == want, (key, form, obj)


def test_toml_file_lists_and_strings(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[data]\nsources = ["a,b.jsonl"]\n[pipeline]\ntarget_devices = "cpu"\n')
    cfg = load_config(None, f, [])
    assert cfg.data.sources == ["a,b.jsonl"]  # a real TOML list is never split
    assert cfg.pipeline.target_devices == ["cpu"]


@pytest.mark.parametrize("bad", ["[a.jsonl", "[[a]]", "[a]]"])
def test_bad_list_names_the_accepted_syntax(bad):
    with pytest.raises(ConfigError) as e:
        load_config(None, None, [f"--data.sources={bad}"])
    msg = str(e.value)
    assert "data.sources" in msg and "a,b" in msg and "[a,b]" in msg and '["a", "b"]' in msg


def test_bad_list_item_is_named():
    with pytest.raises(ConfigError, match=r"item 'x' is not int.*a,b"):
        load_config(None, None, ["--target.taps=[1,x]"])
