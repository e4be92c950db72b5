"""Conversation sources -> `Conversation`s: JSONL / JSON / Parquet files, HF `save_to_disk` dirs,
and whatever `datasets.load_dataset` reads (a Hub dataset id or a local dir of data files).

A source spec is `PATH[@W]` or `NAME[:SPLIT][@W]` / `NAME:CONFIG:SPLIT[@W]`. A path that exists
locally always wins; otherwise an `owner/name` Hub id (or an existing dir followed by `:SPLIT`) is
loaded with `datasets.load_dataset(NAME, CONFIG, split=SPLIT)`. SPLIT may slice (`train[:1000]`).
HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are honoured by `datasets` itself.

Two record shapes are accepted:

    ShareGPT  {"id"?: ..., "conversations": [{"from": "human|user|gpt|assistant|system|
                                                       tool|observation|function_call",
                                              "value": str}]}
    OpenAI    {"id"?: ..., "messages":      [{"role": "system|user|assistant|tool",
                                              "content": str, "tool_calls"?: [...],
                                              "tool_call_id"?: str, "name"?: str}]}

Tool use: a `tool` message (ShareGPT `tool` / `observation`) is the tool's answer, rendered by the
chat template and never supervised. An assistant message's `tool_calls` are kept for the template;
a ShareGPT `function_call` turn (a JSON {"name", "arguments"} object or a list of them) becomes an
assistant message with those `tool_calls`: the target writes the call, so it is supervised.

Every reader yields `(locator, record)` pairs where the locator ("line 12", "row 7", "item 3") is
what an error message names. Line numbers are 1-based (as editors show them); row and item numbers
are 0-based (as pyarrow/pandas/`datasets` index them). A malformed record raises `DataError` naming
file, locator and field unless `on_bad_record == "skip"`, in which case it is counted.

JSONL is streamed line by line in binary mode, so memory is bounded by the longest line (a 100 MB
line costs that line, its decoded text and its parsed objects, never the whole file).

Mixing: `path@W` samples the source W times relative to a weight-1 source. It is implemented as a
deterministic re-sampling of that source's kept records: every record appears floor(W) times, and a
seeded random subset of round(frac(W) * n) records appears once more. Copies keep the record's id,
so the held-out split (which groups by id) never puts a copy on both sides.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_trainer.errors import DataError, UserError

SKIP_HINT = "set data.on_bad_record=skip to skip such records"

# ShareGPT speaker names -> OpenAI roles ("function_call" is read by _function_call).
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_call": "assistant",
}
_OPENAI_ROLES = ("system", "user", "assistant", "tool")
# Optional OpenAI message fields kept for the chat template, by role.
_TOOL_FIELDS = {"assistant": ("tool_calls",), "tool": ("tool_call_id", "name")}

HF_EXTRA_HINT = "pip install 'dflash-trainer[hf]'"
# owner/name, as the Hub spells dataset ids (a file name with a data suffix is never one)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq")


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # [{"role": "system|user|assistant|tool", "content": str, ...}]
    source: str  # the source spec it came from (file, dir or dataset name, without '@W')
    # the last assistant turn was cut at a generation limit (finish_reason "length"): it must not
    # end with an end-of-turn token the model never produced (data.truncated)
    truncated: bool = False


@dataclass
class SourceStats:
    path: str
    weight: float
    read: int = 0  # records read (good or bad)
    bad: int = 0  # malformed records skipped (on_bad_record=skip)
    dropped_empty: int = 0  # empty conversations or no assistant turn with content
    kept: int = 0  # valid conversations before weighting
    sampled: int = 0  # conversations contributed after weighting
    first_errors: list[str] = field(default_factory=list)  # a few skipped-record messages


@dataclass
class SourceReport:
    sources: list[SourceStats]

    def total(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.sources)

    def summary(self) -> str:
        parts = [
            f"{Path(s.path).name}@{s.weight:g}: read {s.read}, bad {s.bad}, "
            f"dropped {s.dropped_empty}, kept {s.kept}, sampled {s.sampled}"
            for s in self.sources
        ]
        return "; ".join(parts)


class BadRecord(Exception):
    """A record failed validation (`parse_record`); `field` is the JSON path of the offending
    value."""

    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field = field
        self.problem = problem


# --------------------------------------------------------------------------------------------
# Source specs and paths
# --------------------------------------------------------------------------------------------


def parse_source_spec(spec: str) -> tuple[str, float]:
    """'path@W' -> (path, W); '@' followed by something that is not a number belongs to the path."""
    if "@" in spec:
        path, w = spec.rsplit("@", 1)
        try:
            weight = float(w)
        except ValueError:
            return spec, 1.0
        if not math.isfinite(weight) or weight < 0:
            raise UserError(
                f"data.sources: weight {w!r} in {spec!r} must be a finite number >= 0 "
                "(e.g. 'data.jsonl@2')."
            )
        return path, weight
    return spec, 1.0


def _resolve(path_str: str, roots: tuple | list) -> Path:
    if path_str == "embedded":
        raise UserError(
            "data.sources: 'embedded' must be resolved to a file first "
            "(dflash_trainer.data.generate.ensure_embedded_responses)."
        )
    p = Path(path_str).expanduser()
    if not p.exists():
        raise UserError(
            f"data.sources: '{path_str}' does not exist. Check the path (relative "
            "paths are relative to the working directory); a Hugging Face Hub dataset is "
            "written owner/name[:split]."
        )
    rp = p.resolve()
    if roots:
        rroots = [Path(r).expanduser().resolve() for r in roots]
        if not any(rp == r or rp.is_relative_to(r) for r in rroots):
            raise UserError(
                f"data.sources: '{path_str}' lies outside the allowed data roots "
                f"({', '.join(map(str, rroots))}); move it there or add its dir to "
                "data.roots."
            )
    return p


@dataclass(frozen=True)
class DatasetSpec:
    """A source read with `datasets.load_dataset(name, config, split=split)`; `name` is a Hub
    dataset id or a local dir of data files."""

    name: str
    config: str | None = None
    split: str | None = None

    @property
    def label(self) -> str:
        """The spec as written (NAME[:CONFIG][:SPLIT]): what messages name."""
        return ":".join(x for x in (self.name, self.config, self.split) if x)

    @property
    def stem(self) -> str:
        """Conversation ids without an 'id' field: '<stem>:<row>', e.g. 'ultrachat_200k:train_sft:7'
        (the split is part of it, so two splits of one dataset never share ids)."""
        return ":".join(x for x in (Path(self.name).name, self.config, self.split) if x)


# ':' that is not inside a split slice such as 'train[:10%]'
_SPEC_COLON = re.compile(r":(?![^\[]*\])")


def dataset_spec(path_str: str) -> DatasetSpec | None:
    """`path_str` as a `load_dataset` source, or None: an existing local path wins (it is read as
    a file or dir), and a name that is neither an `owner/name` Hub id nor an existing dir
    followed by ':SPLIT' is left to the local-path error ('does not exist')."""
    if Path(path_str).expanduser().exists():
        return None
    name, *rest = _SPEC_COLON.split(path_str)
    is_hub_id = _HUB_ID.fullmatch(name) and not name.lower().endswith(_DATA_SUFFIXES)
    if not (is_hub_id or (rest and Path(name).expanduser().is_dir())):
        return None
    if len(rest) > 2 or not all(rest):
        raise UserError(
            f"data.sources: '{path_str}' is not NAME, NAME:SPLIT or NAME:CONFIG:SPLIT "
            "(e.g. 'HuggingFaceH4/ultrachat_200k:train_sft')."
        )
    config = rest[0] if len(rest) == 2 else None
    split = rest[-1] if rest else None
    return DatasetSpec(name, config, split)


def _check_dataset_roots(spec: DatasetSpec, roots) -> None:
    """data.roots confines data to local dirs: a local dataset dir must lie under one, and no
    Hub dataset is downloaded."""
    if Path(spec.name).expanduser().is_dir():
        _resolve(spec.name, roots)
    elif roots:
        raise UserError(
            f"data.sources: '{spec.label}' is not a local path, and data.roots allows only "
            "local data; download the dataset into one of the roots and list it there, or "
            "unset data.roots."
        )


# --------------------------------------------------------------------------------------------
# Readers: yield (locator, record dict or BadRecord)
# --------------------------------------------------------------------------------------------


def _read_jsonl(p: Path) -> Iterator[tuple[str, Any]]:
    with open(p, "rb") as f:
        lineno = 0
        # A plain readline loop: enumerate(f) would keep the last line alive in its cached
        # result tuple, so `del raw` below could not free it.
        while raw := f.readline():
            lineno += 1
            loc = f"line {lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield (
                    loc,
                    BadRecord(
                        "<bytes>",
                        f"not valid UTF-8 (byte offset {e.start} in the "
                        "line); re-encode the file as UTF-8",
                    ),
                )
                continue
            finally:
                del raw  # free the bytes before parsing: peak = decoded line + parsed record
            if not text or text.isspace():  # (strip() would copy a huge line)
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                rec = BadRecord("<json>", f"invalid JSON ({e.msg} at column {e.colno})")
            del text
            yield loc, rec


def _read_json(p: Path) -> Iterator[tuple[str, Any]]:
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{p}: not valid UTF-8 (byte offset {e.start}); re-encode the file as UTF-8."
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{p}: line {e.lineno}: invalid JSON ({e.msg} at column {e.colno}). A JSON "
            'source must be a list of records or {"data": [...]}; use .jsonl for one '
            "record per line."
        ) from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(
            f'{p}: a JSON source must be a list of records or {{"data": [...]}}, got '
            f"{type(data).__name__}."
        )
    for i, rec in enumerate(data):
        yield f"item {i}", rec


def _read_parquet(p: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(p)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DataError(f"{p}: cannot read as Parquet ({e}).") from None
    row = 0
    for batch in pf.iter_batches(batch_size=1024):
        for rec in batch.to_pylist():
            yield f"row {row}", rec
            row += 1


def _read_hf_dir(p: Path) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"{p} is a Hugging Face dataset dir; reading it needs the `datasets` "
            "package: pip install 'dflash-trainer[hf]'."
        ) from None
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        if "train" in ds:
            ds = ds["train"]
        elif len(ds) == 1:
            ds = next(iter(ds.values()))
        else:
            raise UserError(
                f"{p}: a DatasetDict with splits {sorted(ds)} and no 'train'; point "
                f"data.sources at one split dir (e.g. {p}/{sorted(ds)[0]})."
            )
    for i, rec in enumerate(ds):
        yield f"row {i}", rec


def _read_dataset(spec: DatasetSpec) -> Iterator[tuple[str, Any]]:
    """Rows of `datasets.load_dataset(spec.name, spec.config, split=spec.split)`."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"data.sources: '{spec.label}' is read with datasets.load_dataset, which needs the "
            f"`datasets` package: {HF_EXTRA_HINT}. Or give a local JSONL/JSON/Parquet file."
        ) from None
    try:
        ds = datasets.load_dataset(spec.name, spec.config, split=spec.split)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        cause = str(e).splitlines()[0] if str(e) else ""
        if Path(spec.name).expanduser().is_dir():
            hint = (
                "Check that the directory holds data files (JSONL/JSON/Parquet/CSV) and the "
                "split name, or list the files in data.sources instead"
            )
        else:
            hint = (
                "It is not a local path, so it was read as a Hugging Face Hub dataset: check "
                "the id, config and split (NAME:SPLIT or NAME:CONFIG:SPLIT) and that the Hub is "
                "reachable or the dataset is in the HF cache (HF_HUB_OFFLINE=1 reads only the "
                "cache); or download it and give the local file or dir"
            )
        raise DataError(
            f"data.sources: cannot load '{spec.label}' with datasets.load_dataset "
            f"({type(e).__name__}: {cause}). {hint}."
        ) from None
    if isinstance(ds, datasets.DatasetDict):  # no split named
        names = sorted(ds)
        if len(names) != 1:
            raise DataError(
                f"data.sources: '{spec.label}' has the splits {', '.join(names)}; name one, "
                f"e.g. '{spec.label}:{names[0]}'."
            )
        ds = ds[names[0]]
    for i, rec in enumerate(ds):
        yield f"row {i}", rec


def _reader_for(p: Path):
    if p.is_dir():
        if (
            (p / "dataset_info.json").exists()
            or (p / "state.json").exists()
            or (p / "dataset_dict.json").exists()
        ):
            return _read_hf_dir
        # a dir of data files, e.g. a downloaded Hub dataset: load_dataset infers the format
        return lambda d: _read_dataset(DatasetSpec(str(d)))
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl
    if suffix == ".json":
        return _read_json
    if suffix in (".parquet", ".pq"):
        return _read_parquet
    raise UserError(
        f"data.sources: '{p}' has an unknown extension '{p.suffix}'; use .jsonl, "
        ".json, .parquet, a dataset dir, or a Hub dataset id (owner/name[:split])."
    )


def _open_source(path_str: str, roots) -> tuple[str, str, Iterator[tuple[str, Any]]]:
    """(name that messages give, id stem, records) of one source."""
    spec = dataset_spec(path_str)
    if spec is not None:
        _check_dataset_roots(spec, roots)
        return spec.label, spec.stem, _read_dataset(spec)
    p = _resolve(path_str, roots)
    return str(p), (p.stem if p.is_file() else p.name), _reader_for(p)(p)


# --------------------------------------------------------------------------------------------
# Record validation
# --------------------------------------------------------------------------------------------


def _content(value: Any, field_name: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    # OpenAI "content parts": [{"type": "text", "text": ...}, ...]
    if isinstance(value, list):
        out = []
        for j, part in enumerate(value):
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise BadRecord(
                    f"{field_name}[{j}]",
                    "only text content parts ({'type': 'text', 'text': str}) are supported",
                )
            out.append(part["text"])
        return "".join(out)
    raise BadRecord(field_name, f"expected a string, got {type(value).__name__}")


def parse_record(rec: Any) -> tuple[Any, list[dict]]:
    """Validate one record; return (id or None, messages). Raises BadRecord."""
    if not isinstance(rec, dict):
        raise BadRecord("<record>", f"expected a JSON object, got {type(rec).__name__}")
    if "messages" in rec and rec["messages"] is not None:
        key, parse_turn = "messages", _openai_message
    elif "conversations" in rec and rec["conversations"] is not None:
        key, parse_turn = "conversations", _sharegpt_message
    else:
        raise BadRecord(
            "messages",
            "missing: a record needs 'messages' (OpenAI: role/content) "
            "or 'conversations' (ShareGPT: from/value)",
        )
    turns = rec[key]
    if not isinstance(turns, list):
        raise BadRecord(key, f"expected a list, got {type(turns).__name__}")
    messages = []
    for i, t in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(t, dict):
            raise BadRecord(where, f"expected an object, got {type(t).__name__}")
        messages.append(parse_turn(t, where))
    rid = rec.get("id")
    if rid is not None and not isinstance(rid, (str, int)):
        raise BadRecord("id", f"expected a string or integer, got {type(rid).__name__}")
    return rid, messages


def _speaker(t: dict, key: str, where: str, known) -> str:
    if key not in t:
        raise BadRecord(f"{where}.{key}", "missing")
    value = t[key]
    if not isinstance(value, str):
        raise BadRecord(f"{where}.{key}", f"expected a string, got {type(value).__name__}")
    if value not in known:
        kind = "role" if key == "role" else "speaker"
        raise BadRecord(
            f"{where}.{key}", f"unknown {kind} {value!r} (expected one of {', '.join(known)})"
        )
    return value


def _openai_message(t: dict, where: str) -> dict:
    role = _speaker(t, "role", where, _OPENAI_ROLES)
    extra = _tool_fields(t, role, where)
    # An assistant message that only calls tools may leave out its content (OpenAI API form).
    if "content" not in t and "tool_calls" not in extra:
        raise BadRecord(f"{where}.content", "missing")
    return {"role": role, "content": _content(t.get("content"), f"{where}.content"), **extra}


def _sharegpt_message(t: dict, where: str) -> dict:
    speaker = _speaker(t, "from", where, _SHAREGPT_ROLES)
    if "value" not in t:
        raise BadRecord(f"{where}.value", "missing")
    if speaker == "function_call":
        return _function_call(t["value"], f"{where}.value")
    return {"role": _SHAREGPT_ROLES[speaker], "content": _content(t["value"], f"{where}.value")}


def _tool_fields(t: dict, role: str, where: str) -> dict:
    """The optional tool-use fields of an OpenAI message, kept for the chat template. None counts
    as absent: Arrow-backed readers (Parquet, `datasets`) give every message every field."""
    out = {}
    for key in _TOOL_FIELDS.get(role, ()):
        value = t.get(key)
        if value is None or value == []:
            continue
        if key == "tool_calls":
            if not (isinstance(value, list) and all(isinstance(c, dict) for c in value)):
                raise BadRecord(f"{where}.{key}", "expected a list of tool-call objects")
        elif not isinstance(value, str):
            raise BadRecord(f"{where}.{key}", f"expected a string, got {type(value).__name__}")
        out[key] = value
    return out


def _function_call(value: Any, field_name: str) -> dict:
    """A ShareGPT `function_call` turn -> an assistant message with OpenAI `tool_calls`, so the
    chat template renders the call the way the target writes it."""
    calls = value
    if isinstance(value, str):
        try:
            calls = json.loads(value)
        except json.JSONDecodeError:
            calls = None
    if isinstance(calls, dict):
        calls = [calls]
    if not (
        isinstance(calls, list)
        and calls
        and all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls)
    ):
        raise BadRecord(
            field_name,
            'a function_call turn must hold a JSON object {"name": str, "arguments": ...} '
            "or a list of them",
        )
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments")}}
            for c in calls
        ],
    }


def finish_reason(rec: dict) -> str | None:
    """How the record's last answer ended, where the record says: `finish_reason` at the top
    level or in `provenance` (what `dflash-trainer generate` writes): "stop" or "length"."""
    prov = rec.get("provenance")
    value = rec.get("finish_reason")
    if value is None and isinstance(prov, dict):
        value = prov.get("finish_reason")
    return value if isinstance(value, str) else None


def _has_response(messages: list[dict]) -> bool:
    """Some assistant turn to learn from: text, or a tool call."""
    return any(
        m["role"] == "assistant"
        and (m.get("tool_calls") or (m["content"] and not m["content"].isspace()))
        for m in messages
    )


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def read_source(
    path: str | Path, on_bad_record: str = "error", roots=(), stats: SourceStats | None = None
) -> list[Conversation]:
    """Read one source (no weighting). Counts go to `stats`."""
    if on_bad_record not in ("error", "skip"):
        raise UserError(f"data.on_bad_record: {on_bad_record!r} is not 'error' or 'skip'.")
    name, stem, records = _open_source(str(path), roots)
    stats = stats if stats is not None else SourceStats(str(path), 1.0)
    out: list[Conversation] = []
    for loc, rec in records:
        stats.read += 1
        try:
            if isinstance(rec, BadRecord):
                raise rec
            rid, messages = parse_record(rec)
        except BadRecord as e:
            msg = f"{name}: {loc}: field '{e.field}': {e.problem}."
            if on_bad_record == "skip":
                stats.bad += 1
                if len(stats.first_errors) < 5:
                    stats.first_errors.append(msg)
                continue
            raise DataError(f"{msg} Fix the record, or {SKIP_HINT}.") from None
        if not messages or not _has_response(messages):
            stats.dropped_empty += 1
            continue
        cid = str(rid) if rid is not None else f"{stem}:{loc.split()[-1]}"
        out.append(Conversation(cid, messages, str(path), finish_reason(rec) == "length"))
    if stats.read == 0:
        raise DataError(f"{name}: the source is empty (no records). Remove it from data.sources.")
    stats.kept = len(out)
    return out


def _resample(convs: list[Conversation], weight: float, rng: np.random.Generator) -> list:
    """floor(W) copies of every record + one more copy of a seeded subset of size round(frac*n)."""
    n = len(convs)
    whole = int(math.floor(weight))
    extra = int(round((weight - whole) * n))
    counts = np.full(n, whole, dtype=np.int64)
    if extra:
        counts[rng.choice(n, size=extra, replace=False)] += 1
    return [c for c, k in zip(convs, counts.tolist()) for _ in range(k)]


def load_sources(
    sources: list[str], on_bad_record: str = "error", roots=(), seed: int = 0
) -> tuple[list[Conversation], SourceReport]:
    """Read and mix all sources. Returns (conversations in source order, report)."""
    if not sources:
        raise UserError("data.sources is empty; give at least one file or dataset dir.")
    report = SourceReport([])
    out: list[Conversation] = []
    for idx, spec in enumerate(sources):
        path, weight = parse_source_spec(spec)
        stats = SourceStats(path, weight)
        report.sources.append(stats)
        convs = read_source(path, on_bad_record, roots, stats)
        # Seeded per (seed, source position) so adding a source does not reshuffle the others.
        picked = _resample(convs, weight, np.random.default_rng([seed, idx]))
        stats.sampled = len(picked)
        out.extend(picked)
    if not out:
        raise DataError(
            "no usable conversations in data.sources (" + report.summary() + "); "
            "every record was empty, had no assistant reply, or was skipped."
        )
    return out, report
