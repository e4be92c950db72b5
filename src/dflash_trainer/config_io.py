"""Reading and writing configs: the one parser of every config source, and the generated text.

    defaults  <  preset (presets/NAME.toml)  <  --config FILE.toml  <  --section.field=value

A preset may hold tables for a kind of drafter device (DEVICE_TABLES), applied right after the
preset's own values (so a config file or a flag still wins): `[fp32_cpu]` where the drafter
trains on a CPU in float32 (no native bf16: `auto` precision on an AVX2 CPU), because there a step
costs about twice what it costs in bf16 and the recipe that fits a wall-time budget differs
(presets/smollm2-cpu.toml says what was measured); `[gpu_80gb]` where the drafter's GPU has ~80
GB, the shape its memory plan fits (presets/qwen3-8b.toml). `preset_kind_table` names what it
set.

`load_config` applies them in that order; each value is coerced to its field's type and checked
against its range (config.py declares both). Unknown keys are errors that suggest the closest
valid key; a renamed key is an error that names the new one (config.RENAMED). `to_toml` (`config
show`) and `help_text` (`--help`) are generated from the fields' help text.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.config import (
    PRESET_DIR,
    RENAMED,
    RENAMED_VALUES,
    Config,
    ConfigError,
    check_range,
    suggest,
    validate,
)
from dflash_trainer.precision import use_autocast

# The preset table applied where the drafter computes in fp32 on a CPU (module docstring).
FP32_CPU_TABLE = "fp32_cpu"
GPU_80GB_TABLE = "gpu_80gb"

# --------------------------------------------------------------------------------------------
# Introspection
# --------------------------------------------------------------------------------------------


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def iter_fields(cfg_cls=Config, prefix: str = ""):
    """Yield (dotted_key, dataclass Field, resolved type) for every leaf field."""
    hints = _hints(cfg_cls)
    for f in dataclasses.fields(cfg_cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, tp


def subsection_help(cfg_cls=Config, prefix: str = "") -> dict[str, str]:
    """The help of every sub-section below the top sections ('eval.sampling': ...), by key."""
    out: dict[str, str] = {}
    hints = _hints(cfg_cls)
    for f in dataclasses.fields(cfg_cls):
        if dataclasses.is_dataclass(hints[f.name]):
            if prefix:
                out[f"{prefix}{f.name}"] = f.metadata.get("help", "")
            out.update(subsection_help(hints[f.name], f"{prefix}{f.name}."))
    return out


def all_keys() -> list[str]:
    return [k for k, _, _ in iter_fields()]


def _type_name(tp) -> str:
    if typing.get_origin(tp) is list:
        return f"list[{typing.get_args(tp)[0].__name__}]"
    return tp.__name__


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------


LIST_SYNTAX = 'a,b  or  [a,b]  or  TOML ["a", "b"]  (one item: a; none: [])'


def _unquote(item: str) -> str:
    item = item.strip()
    if len(item) >= 2 and item[0] == item[-1] and item[0] in "'\"":
        return item[1:-1]
    return item


def parse_list(text: str) -> list:
    """A list flag as users type it: `a,b`, `[a,b]`, `["a","b"]` / `['a']` (TOML), `[1, 2]`;
    '' and `[]` are empty. ValueError when it is none of these (e.g. an unclosed bracket)."""
    s = text.strip()
    if not s.startswith("["):
        return [_unquote(v) for v in s.split(",") if v.strip()]
    if not s.endswith("]"):
        raise ValueError("unclosed [")
    try:
        value = tomllib.loads(f"v = {s}")["v"]
    except tomllib.TOMLDecodeError:
        inner = s[1:-1]
        if "[" in inner or "]" in inner:
            raise ValueError("nested brackets") from None
        return [_unquote(v) for v in inner.split(",") if v.strip()]
    if not isinstance(value, list):
        raise ValueError("not a list")
    return value


def _coerce(key: str, tp, value: Any) -> Any:
    """Turn a TOML value or a flag string into the field's type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        why = ""
        try:
            items = parse_list(value) if isinstance(value, str) else value
            if isinstance(items, list):
                out = []
                for v in items:
                    try:
                        out.append(_coerce(key, item_tp, v))
                    except ConfigError:
                        why = f" (item {v!r} is not {item_tp.__name__})"
                        raise
                return out
        except (TypeError, ValueError):  # a ConfigError is a ValueError too
            pass
        raise ConfigError(
            f"{key}: cannot read {value!r} as {_type_name(tp)}{why}. Write a list as {LIST_SYNTAX}."
        )
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in {"true", "1", "yes", "on"}:
                return True
            if isinstance(value, str) and value.lower() in {"false", "0", "no", "off"}:
                return False
            raise TypeError
        if tp is int:
            if isinstance(value, bool):
                raise TypeError
            if isinstance(value, float) and not value.is_integer():
                raise TypeError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if tp is str:
            if not isinstance(value, str):
                raise TypeError
            return value
    except (TypeError, ValueError, json.JSONDecodeError):
        pass
    raise ConfigError(f"{key}: cannot read {value!r} as {_type_name(tp)}.")


def _get_parent(cfg: Config, key: str):
    *path, leaf = key.split(".")
    obj = cfg
    for p in path:
        obj = getattr(obj, p)
    return obj, leaf


def renamed_to(key: str) -> tuple[str, ...]:
    """The key(s) an old key became (config.RENAMED); (key,) when it was not renamed."""
    new = RENAMED.get(key, key)
    return (new,) if isinstance(new, str) else new


def _renamed(key: str, origin: str, flag: bool = False) -> ConfigError:
    dash = "--" if flag else ""
    new = " and ".join(f"'{dash}{k}'" for k in renamed_to(key))
    return ConfigError(f"'{dash}{key}' (from {origin}) was renamed to {new}; use the new name.")


def renamed_value(key: str, value: Any) -> Any:
    """The value an old value of `key` became (config.RENAMED_VALUES); `value` when it was not
    renamed."""
    return RENAMED_VALUES.get((key, value), value) if isinstance(value, str) else value


def set_value(cfg: Config, key: str, value: Any, *, origin: str = "flag") -> None:
    fields = {k: (f, tp) for k, f, tp in iter_fields()}
    if key in RENAMED:
        raise _renamed(key, origin)
    if renamed_value(key, value) != value:
        raise ConfigError(
            f"{key}: {value!r} (from {origin}) was renamed to {renamed_value(key, value)!r}; "
            "use the new value."
        )
    if key not in fields:
        raise ConfigError(
            f"unknown config key '{key}' (from {origin})."
            + suggest(key, list(fields))
            + " See `dflash-trainer config show`."
        )
    f, tp = fields[key]
    v = _coerce(key, tp, value)
    check_range(key, f, v)
    obj, leaf = _get_parent(cfg, key)
    setattr(obj, leaf, v)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def apply_mapping(cfg: Config, mapping: dict, origin: str) -> None:
    for key, value in _flatten(mapping).items():
        set_value(cfg, key, value, origin=origin)


def load_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist.")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}. Fix the file and retry.") from None


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


# Short flags users type, and the key each one sets.
ALIASES = {"resume_from": "checkpoint.resume_from"}
_BOOL_WORDS = {"true", "1", "yes", "on", "false", "0", "no", "off"}


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """['--a.b=1', '--c.d', '2'] -> [('a.b','1'), ('c.d','2')]; anything else is an error.
    A boolean field given alone (`--overwrite`) is true; `--resume-from PATH` is
    `--checkpoint.resume_from=PATH` (ALIASES)."""
    keys = {k: tp for k, _, tp in iter_fields()}
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or len(a) == 2:
            raise ConfigError(
                f"unexpected argument '{a}'; overrides look like --section.field=VALUE."
            )
        body = a[2:]
        k, v = body.split("=", 1) if "=" in body else (body, None)
        k = k.replace("-", "_")
        k = ALIASES.get(k, k)
        if k in RENAMED:
            raise _renamed(k, "the command line", flag=True)
        if k not in keys:
            raise ConfigError(
                f"unknown flag '--{k}'."
                + suggest(k, list(keys)).replace("'", "'--", 1)
                + " See --help for every field."
            )
        if v is None:
            nxt = args[i + 1] if i + 1 < len(args) else None
            if keys[k] is bool and (nxt is None or nxt.lower() not in _BOOL_WORDS):
                v = "true"
            elif nxt is None:
                raise ConfigError(f"flag '{a}' needs a value: {a}=VALUE.")
            else:
                v = nxt
                i += 1
        out.append((k, v))
        i += 1
    return out


def apply_saved(cfg: Config, saved: dict, origin: str) -> list[str]:
    """Apply a config saved by another version of the trainer (an export's training.json):
    keys this version does not know are skipped and returned, not errors."""
    known = set(all_keys())
    # older versions' names: the value goes to the key(s) each became
    flat = {new: v for k, v in _flatten(saved).items() for new in renamed_to(k)}
    for key, value in flat.items():
        if key in known:
            set_value(cfg, key, renamed_value(key, value), origin=origin)
    return sorted(k for k in flat if k not in known)


def load_config(
    preset: str | None = None,
    config_file: str | None = None,
    overrides: list[str] | tuple = (),
    base: dict | None = None,
) -> Config:
    """defaults < `base` (a saved config, e.g. an export's training config) < preset (and its
    device table, DEVICE_TABLES, where the run's drafter device is of that kind) < --config
    file < flags."""
    mapping = _preset_mapping(preset) if preset else {}
    tables = {name: mapping.pop(name) for name in DEVICE_TABLES if name in mapping}
    cfg = _compose(mapping, preset, config_file, overrides, base)
    name = device_table(cfg, tables)
    if name is not None:
        cfg = _compose(mapping, preset, config_file, overrides, base, (name, tables[name]))
    return validate(cfg)


def drafter_fp32_cpu(cfg: Config) -> bool:
    """Does the drafter train in float32 on a CPU (pipeline.precision resolved on this CPU)?"""
    p = cfg.pipeline
    return p.drafter_device.startswith("cpu") and not use_autocast(p.precision, p.drafter_device)


def card_memory_gib(device: str) -> float:
    """Memory of CUDA device `device` in GiB (0 where there is none)."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return 0.0
    return torch.cuda.get_device_properties(torch.device(device)).total_memory / (1 << 30)


def drafter_on_80gb_card(cfg: Config) -> bool:
    """Is the drafter's device a GPU of at most ~80 GB (an H100 or A100 80 GB: 79.2 GiB)?"""
    return 0 < card_memory_gib(cfg.pipeline.drafter_device) < 100


# A preset's tables for a kind of drafter device, applied after the preset's own values where
# the run's drafter device is of that kind (the first that applies): its shape there, measured.
DEVICE_TABLES = {FP32_CPU_TABLE: drafter_fp32_cpu, GPU_80GB_TABLE: drafter_on_80gb_card}


def device_table(cfg: Config, tables) -> str | None:
    """The name of the first of `tables` (names of DEVICE_TABLES) that applies to `cfg`."""
    return next((n for n in DEVICE_TABLES if n in tables and DEVICE_TABLES[n](cfg)), None)


def preset_kind_table(preset: str | None, cfg: Config) -> tuple[str, dict[str, Any]]:
    """(the device table of `preset` that `cfg` runs under, the values it set in `cfg`);
    ("", {}) when none applies: what a run says it adapted to its device."""
    if not preset:
        return "", {}
    tables = {n: t for n, t in _preset_mapping(preset).items() if n in DEVICE_TABLES}
    name = device_table(cfg, tables)
    if name is None:
        return "", {}
    table = _flatten(tables[name])
    as_set = Config()
    apply_mapping(as_set, table, origin=f"preset {preset} [{name}]")
    # only the values that still hold: a config file or a flag may have set another
    return name, {k: _value(cfg, k) for k in table if _value(cfg, k) == _value(as_set, k)}


def _value(cfg: Config, key: str) -> Any:
    parent, leaf = _get_parent(cfg, key)
    return getattr(parent, leaf)


def _preset_mapping(preset: str) -> dict:
    path = PRESET_DIR / f"{preset}.toml"
    if not path.is_file():
        raise ConfigError(
            f"unknown preset '{preset}'."
            + suggest(preset, list_presets())
            + f" Available: {', '.join(list_presets())}."
        )
    return load_toml(path)


def _compose(
    mapping: dict,
    preset: str | None,
    config_file: str | None,
    overrides: list[str] | tuple,
    base: dict | None,
    table: tuple[str, dict] | None = None,
) -> Config:
    cfg = Config()
    if base:
        apply_saved(cfg, base, origin="the recorded training config")
    if preset:
        apply_mapping(cfg, mapping, origin=f"preset {preset}")
    if table:
        apply_mapping(cfg, table[1], origin=f"preset {preset} [{table[0]}]")
    if config_file:
        apply_mapping(cfg, load_toml(config_file), origin=str(config_file))
    for k, v in parse_overrides(list(overrides)):
        set_value(cfg, k, v, origin=f"--{k}")
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> Config:
    """Rebuild a Config from to_dict() output (checkpoints). Unknown keys are errors."""
    cfg = Config()
    for key, value in _flatten(d).items():  # older versions' values read as their new names
        set_value(cfg, key, renamed_value(key, value), origin="saved config")
    return validate(cfg)


def to_toml(cfg: Config) -> str:
    """Render as TOML (sections, and their sub-sections, as tables), with each field's help as a
    comment."""
    lines: list[str] = []

    def render(obj: Any, name: str) -> None:
        hints = _hints(type(obj))
        flds = dataclasses.fields(obj)
        subs = [f for f in flds if dataclasses.is_dataclass(hints[f.name])]
        for f in flds:
            if f in subs:
                continue
            unit = f.metadata.get("unit")
            lines.append(f"# {f.metadata.get('help', '')}" + (f" [{unit}]" if unit else ""))
            lines.append(f"{f.name} = {json.dumps(getattr(obj, f.name))}")
        for f in subs:
            table = f"{name}.{f.name}" if name else f.name
            lines.extend(["", f"[{table}]"])
            if f.metadata.get("help"):
                lines.append(f"# {f.metadata['help']}")
            render(getattr(obj, f.name), table)

    render(cfg, "")
    return "\n".join(lines) + "\n"


def _facts(key: str, f: dataclasses.Field, tp, defaults: Config) -> list[str]:
    """A field's unit, choices, range, list syntax and default, in words."""
    obj, leaf = _get_parent(defaults, key)
    m = f.metadata
    extra = []
    if m.get("unit"):
        extra.append(f"unit: {m['unit']}")
    if m.get("choices"):
        extra.append("one of " + "/".join(m["choices"]))
    if m.get("min") is not None or m.get("max") is not None:
        lo = "-inf" if m.get("min") is None else m["min"]
        hi = "inf" if m.get("max") is None else m["max"]
        extra.append(f"range [{lo}, {hi}]")
    if typing.get_origin(tp) is list:
        extra.append('a list: a,b or [a,b] or TOML ["a", "b"]')
    extra.append(f"default: {json.dumps(getattr(obj, leaf))}")
    return extra


def help_text() -> str:
    """Every field with its type, unit, default and valid range: the body of --help."""
    out = []
    defaults = Config()
    for key, f, tp in iter_fields():
        extra = _facts(key, f, tp, defaults)
        out.append(
            f"  --{key}=<{_type_name(tp)}>\n      {f.metadata.get('help', '')} ({'; '.join(extra)})"
        )
    return "\n".join(out)


def reference_markdown() -> str:
    """docs/reference/config.md: every key by section, generated from the schema (`make docs`;
    a test keeps the file equal to this)."""
    lines = [
        "# Configuration keys",
        "",
        "Generated from `src/dflash_trainer/config.py` by `make docs`; do not edit by hand.",
        "Set a key with `--section.key=VALUE`, in a TOML file (`--config`), or through a preset",
        "(`--preset`).",
    ]
    defaults = Config()
    section = sub = None
    subsections = subsection_help()
    for key, f, tp in iter_fields():
        top = key.split(".")[0] if "." in key else ""
        if top != section:
            section = top
            lines += ["", f"## [{top}]" if top else "## top level", ""]
            lines += ["| key | type | meaning | unit, range, default |", "|---|---|---|---|"]
        parent = key.rpartition(".")[0]
        if parent in subsections and parent != sub:
            sub = parent
            lines.append(f"| `{parent}.*` | section | {subsections[parent]} | |")
        extra = "; ".join(_facts(key, f, tp, defaults)).replace("|", "\\|")
        meaning = f.metadata.get("help", "").replace("|", "\\|")
        lines.append(f"| `{key}` | {_type_name(tp)} | {meaning} | {extra} |")
    return "\n".join(lines) + "\n"
