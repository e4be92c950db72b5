"""Conversation sources: JSONL / JSON / Parquet files and HF `save_to_disk` dirs -> `Conversation`s.

Two record shapes are accepted:

    ShareGPT  {"id"?: ..., "conversations": [{"from": "human|user|gpt|assistant|system",
                                              "value": str}]}
    OpenAI    {"id"?: ..., "messages":      [{"role": "system|user|assistant", "content": str}]}

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_trainer.errors import DataError, UserError

SKIP_HINT = "set data.on_bad_record=skip to skip such records"

# ShareGPT speaker names -> OpenAI roles.
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_OPENAI_ROLES = ("system", "user", "assistant")


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # [{"role": "system|user|assistant", "content": str}]
    source: str  # the file/dir it came from
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
            "paths are relative to the working directory)."
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


def _reader_for(p: Path):
    if p.is_dir():
        if (
            (p / "dataset_info.json").exists()
            or (p / "state.json").exists()
            or (p / "dataset_dict.json").exists()
        ):
            return _read_hf_dir
        raise UserError(
            f"data.sources: '{p}' is a directory but not a dataset saved with "
            "datasets.save_to_disk (no dataset_info.json/state.json); list the files "
            "instead."
        )
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl
    if suffix == ".json":
        return _read_json
    if suffix in (".parquet", ".pq"):
        return _read_parquet
    raise UserError(
        f"data.sources: '{p}' has an unknown extension '{p.suffix}'; use .jsonl, "
        ".json, .parquet or a save_to_disk dir."
    )


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
        key, role_key, text_key, roles = "messages", "role", "content", None
    elif "conversations" in rec and rec["conversations"] is not None:
        key, role_key, text_key, roles = "conversations", "from", "value", _SHAREGPT_ROLES
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
        if role_key not in t:
            raise BadRecord(f"{where}.{role_key}", "missing")
        role = t[role_key]
        if not isinstance(role, str):
            raise BadRecord(f"{where}.{role_key}", f"expected a string, got {type(role).__name__}")
        if roles is None:
            if role not in _OPENAI_ROLES:
                raise BadRecord(
                    f"{where}.{role_key}",
                    f"unknown role {role!r} (expected one of {', '.join(_OPENAI_ROLES)})",
                )
        else:
            if role not in roles:
                raise BadRecord(
                    f"{where}.{role_key}",
                    f"unknown speaker {role!r} (expected one of {', '.join(roles)})",
                )
            role = roles[role]
        if text_key not in t:
            raise BadRecord(f"{where}.{text_key}", "missing")
        messages.append({"role": role, "content": _content(t[text_key], f"{where}.{text_key}")})
    rid = rec.get("id")
    if rid is not None and not isinstance(rid, (str, int)):
        raise BadRecord("id", f"expected a string or integer, got {type(rid).__name__}")
    return rid, messages


def finish_reason(rec: dict) -> str | None:
    """How the record's last answer ended, where the record says: `finish_reason` at the top
    level or in `provenance` (what `dflash-trainer generate` writes): "stop" or "length"."""
    prov = rec.get("provenance")
    value = rec.get("finish_reason")
    if value is None and isinstance(prov, dict):
        value = prov.get("finish_reason")
    return value if isinstance(value, str) else None


def _has_response(messages: list[dict]) -> bool:
    return any(
        m["role"] == "assistant" and m["content"] and not m["content"].isspace() for m in messages
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
    p = _resolve(str(path), roots)
    stats = stats if stats is not None else SourceStats(str(path), 1.0)
    stem = p.stem if p.is_file() else p.name
    out: list[Conversation] = []
    for loc, rec in _reader_for(p)(p):
        stats.read += 1
        try:
            if isinstance(rec, BadRecord):
                raise rec
            rid, messages = parse_record(rec)
        except BadRecord as e:
            msg = f"{p}: {loc}: field '{e.field}': {e.problem}."
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
        raise DataError(f"{p}: the source is empty (no records). Remove it from data.sources.")
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
