"""From `data.*` config to (train, held-out) tokenized datasets, resolving the embedded source.

The held-out split is stratified by source (the embedded data: MT-Bench and HumanEval, told apart
by the id prefix; user data: each source file) and drawn with `seed`; the held-out set
is kept in a seeded shuffled order (never length order, so "the first N" is not "the N
shortest"). The held-out side is split once more: a small validation subset (stratified the same
way, `eval.validation_fraction` or `eval.validation_prompts`) picks `best/` during training; the
rest is reported and never selects anything. Files written beside the run:

    heldout.jsonl     the reported held-out prompts: {id, messages (no assistant turns), source};
                      with data.format=text {id, prompt, source} (documents, which have no
                      prompt, are left out)
    validation.jsonl  the validation prompts, same shape
    train_ids.json    the training conversations' ids and prompt hashes, so that evaluating a
                      named data set can say which of its prompts were trained on
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from dflash_trainer.config import Config, EvalConfig
from dflash_trainer.data.chat import (
    Rendering,
    build_dataset,
    prompt_hash,
    prompt_messages,
    render_text,
    tokenized_dir,
)
from dflash_trainer.data.generate import ensure_embedded_responses
from dflash_trainer.data.sources import load_sources, parse_source_spec
from dflash_trainer.data.synthesize import ensure_synth_responses
from dflash_trainer.errors import UserError
from dflash_trainer.files import write_atomic
from dflash_trainer.layout import RunLayout

log = logging.getLogger(__name__)

EMBEDDED_SOURCES = {"mtbench-": "mt-bench", "humaneval-": "humaneval"}
VALIDATION, REPORT = "validation", "report"


# the data sources the target writes itself, each cached by its settings (`capture`: the taps it
# computes while writing them, data/generate.generate_with)
TARGET_WRITTEN = {"embedded": ensure_embedded_responses, "synth": ensure_synth_responses}


def resolve_sources(cfg: Config, target=None, capture=None) -> list[str]:
    """Replace `embedded[@W]` and `synth[@W]` by the cached JSONL of the target's answers."""
    out = []
    for spec in cfg.data.sources:
        path, weight = parse_source_spec(spec)
        if path in TARGET_WRITTEN:
            resolved = TARGET_WRITTEN[path](cfg, target=target, capture=capture)
            out.append(f"{resolved}@{weight}" if weight != 1.0 else str(resolved))
        else:
            out.append(spec)
    return out


def source_label(conv_id: str, source: str, written: dict[str, str]) -> str:
    """The stratum of one conversation: mt-bench / humaneval for the embedded data, `synth` for
    the synthesised prompts (`written`: the target-written files -> their source name), else
    the source file's name."""
    kind = written.get(source)
    if kind == "embedded":
        for prefix, name in EMBEDDED_SOURCES.items():
            if conv_id.startswith(prefix):
                return name
    return kind if kind == "synth" else Path(source).name


def _stratum_rng(seed: int, salt: int, stratum: str) -> np.random.Generator:
    return np.random.default_rng([seed, salt, zlib.crc32(stratum.encode())])


def stratified_pick(
    strata: dict[str, list[str]],
    fraction: float,
    seed: int,
    salt: int,
    count: int = 0,
    subset: bool = False,
) -> set[str]:
    """Ids drawn from every stratum: round(fraction * n) of each (at least one of a stratum with
    two or more when fraction > 0, never all of it), or `count` in total shared in proportion
    to the strata's sizes. `subset` (a sample of a pool, e.g. periodic evaluation's prompts):
    exactly `count` (all when fewer), one per stratum first while `count` allows, then in
    proportion (`_apportion`); a stratum may be taken whole. Seeded per (seed, salt, stratum
    name): adding a source does not reshuffle the others."""
    total = sum(len(v) for v in strata.values())
    if total == 0 or (fraction <= 0 and count <= 0):
        return set()
    pools = {name: sorted(set(strata[name])) for name in sorted(strata)}
    take = _apportion({k: len(v) for k, v in pools.items()}, count) if subset else {}
    picked: set[str] = set()
    for name, ids in pools.items():
        n = len(ids)
        if subset:
            k = take[name]
        else:  # a split: every stratum of two or more on both sides
            k = round(count * n / total) if count > 0 else round(fraction * n)
            k = min(max(k, 1), n - 1) if n > 1 else 0
        order = _stratum_rng(seed, salt, name).permutation(n)[:k]
        picked.update(ids[i] for i in order.tolist())
    return picked


def _apportion(sizes: dict[str, int], count: int) -> dict[str, int]:
    """`count` draws (at most every item) shared among strata of `sizes`: Huntington-Hill
    priority n / sqrt(k (k + 1)), infinite at k = 0, so every stratum gets one before any gets
    a second, then each next draw goes where it keeps the shares nearest proportional."""
    k = dict.fromkeys(sizes, 0)
    for _ in range(min(count, sum(sizes.values()))):
        open_ = [s for s in sorted(sizes) if k[s] < sizes[s]]
        best = max(
            open_, key=lambda s: sizes[s] / math.sqrt(k[s] * (k[s] + 1)) if k[s] else math.inf
        )
        k[best] += 1
    return k


def split_roles(ids: list[str], sources: list[str], eval_cfg: EvalConfig, seed: int) -> list[str]:
    """Per held-out example: 'validation' (picks best/) or 'report' (the reported figure)."""
    strata: dict[str, list[str]] = defaultdict(list)
    for i, s in zip(ids, sources):
        strata[s].append(i)
    val = stratified_pick(
        strata, eval_cfg.validation_fraction, seed, 0x7A11D, eval_cfg.validation_prompts
    )
    return [VALIDATION if i in val else REPORT for i in ids]


def prepare_data(cfg: Config, tokenizer, target=None, capture=None):
    rendering = Rendering.from_config(cfg)  # a bad data.chat_template stops before generation
    sources = resolve_sources(cfg, target, capture)
    written = {
        parse_source_spec(s)[0]: parse_source_spec(spec)[0]
        for s, spec in zip(sources, cfg.data.sources)
        if spec != s
    }
    convs, report = load_sources(
        sources,
        cfg.data.on_bad_record,
        tuple(cfg.data.roots),
        seed=cfg.seed,
        data_format=cfg.data.format,
    )
    log.info("data: %s", report.summary() if hasattr(report, "summary") else report)
    dataset = build_dataset(
        cfg.data,
        tokenizer,
        convs,
        cache_dir=tokenized_dir(cfg.data, cfg.target.cache_dir),
        rendering=rendering,
        progress=cfg.metrics.console,
    )
    log.info("tokenized: %s", dataset.stats)
    label = {c.id: source_label(c.id, c.source, written) for c in convs}
    train, heldout = split_dataset(
        dataset, label, cfg.data.eval_fraction, cfg.seed, cfg.eval, cfg.data.report_sources
    )
    run_dir = Path(cfg.run_dir)
    write_split_files(run_dir, convs, train, heldout, cfg.data.format)
    counts: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0])
    for s, r in zip(heldout.sources, heldout.roles):
        counts[s][r == VALIDATION] += 1
    log.info(
        "held out (seed %d, stratified by source): %s; files in %s",
        cfg.seed,
        ", ".join(f"{s}: {a} reported + {b} validation" for s, (a, b) in sorted(counts.items()))
        or "none",
        run_dir,
    )
    return train, heldout


def split_dataset(
    dataset, label: dict[str, str], fraction: float, seed: int, eval_cfg: EvalConfig, report=()
):
    """(train, held-out) by conversation id, stratified by `label[id]`. Weighted copies share an
    id and stay on one side; the held-out side keeps one copy of each, in a seeded order, with
    `.sources` and `.roles` (validation / report) set. `report` (data.report_sources): strata
    whose reported prompts are kept; the reported share of any other stratum goes back to
    training (its validation prompts stay held out: they are drawn as if it were reported, so the
    validation set is the same either way)."""
    strata: dict[str, list[str]] = defaultdict(list)
    for cid in dict.fromkeys(dataset.ids):
        strata[label.get(cid, "data")].append(cid)
    unknown = sorted(set(report) - set(strata))
    if unknown:
        raise UserError(
            f"data.report_sources names {', '.join(unknown)}: no such stratum in the data (they "
            f"are {', '.join(sorted(strata))}); fix the name, or [] to report every stratum"
        )
    held = sorted(stratified_pick(strata, fraction, seed, 0x5EED))
    # roles are drawn on the whole held-out share (order-free), before any goes back to training
    role = dict(zip(held, split_roles(held, [label.get(g, "data") for g in held], eval_cfg, seed)))
    if report:
        role = {g: r for g, r in role.items() if r != REPORT or label.get(g, "data") in report}
    train_idx = [i for i, g in enumerate(dataset.ids) if g not in role]
    first: dict[str, int] = {}
    for i, g in enumerate(dataset.ids):
        if g in role:
            first.setdefault(g, i)
    held_idx = list(first.values())
    order = np.random.default_rng([seed, 0x0DE5]).permutation(len(held_idx)).tolist()
    held_idx = [held_idx[k] for k in order]
    train, heldout = dataset.subset(train_idx), dataset.subset(held_idx)
    heldout.sources = [label.get(g, "data") for g in heldout.ids]
    heldout.roles = [role[g] for g in heldout.ids]
    train.sources = [label.get(g, "data") for g in train.ids]
    return train, heldout


def prompt_record(cid: str, messages: list[dict], source: str, data_format: str) -> dict | None:
    """A held-out prompt as eval reads it back (eval/prompts.py: load_prompt_file): the
    conversation without its assistant turns, or with data.format=text its prompt's raw text
    (None for a document: nothing to continue)."""
    if data_format == "text":
        prompt = render_text(prompt_messages(messages))[0]
        return {"id": cid, "prompt": prompt, "source": source} if prompt else None
    msgs = [m for m in messages if m["role"] != "assistant"]
    return {"id": cid, "messages": msgs, "source": source}


def write_split_files(run_dir: Path, convs, train, heldout, data_format: str = "chat") -> None:
    by_id: dict[str, Any] = {}
    for c in convs:
        by_id.setdefault(c.id, c)
    lines: dict[str, list[str]] = {REPORT: [], VALIDATION: []}
    for cid, src, role in zip(heldout.ids, heldout.sources, heldout.roles):
        c = by_id.get(cid)
        if c is None:
            continue
        rec = prompt_record(cid, c.messages, src, data_format)
        if rec is not None:
            lines[role].append(json.dumps(rec))
    layout = RunLayout.of(run_dir)
    write_atomic(layout.heldout, "".join(x + "\n" for x in lines[REPORT]))
    write_atomic(layout.validation, "".join(x + "\n" for x in lines[VALIDATION]))
    trained = dict.fromkeys(train.ids)
    write_atomic(
        layout.train_ids,
        json.dumps(
            {
                "ids": list(trained),
                "prompt_hashes": sorted({prompt_hash(by_id[i].messages) for i in trained}),
            }
        ),
    )


def write_heldout_prompts(path: Path, convs, held_ids) -> None:
    """The user side of each held-out conversation (assistant turns are regenerated at eval)."""
    wanted = set(held_ids)
    lines, seen = [], set()
    for c in convs:
        if c.id in wanted and c.id not in seen:
            seen.add(c.id)
            msgs = [m for m in c.messages if m["role"] != "assistant"]
            lines.append(json.dumps({"id": c.id, "messages": msgs}) + "\n")
    write_atomic(path, "".join(lines))
