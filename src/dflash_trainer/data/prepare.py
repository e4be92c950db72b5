"""From `data.*` config to (train, held-out) tokenized datasets, resolving the embedded source.

The held-out conversations' prompts are also written to `{run_dir}/heldout.jsonl` so that
`dflash-trainer eval` (eval.datasets = heldout) measures acceptance on prompts never trained on.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from dflash_trainer.data.chat import build_dataset
from dflash_trainer.data.generate import ensure_embedded_responses
from dflash_trainer.data.sources import load_sources, parse_source_spec

log = logging.getLogger(__name__)


def resolve_sources(cfg, target=None) -> list[str]:
    """Replace `embedded[@W]` by the cached JSONL of target-regenerated responses."""
    out = []
    for spec in cfg.data.sources:
        path, weight = parse_source_spec(spec)
        if path == "embedded":
            resolved = ensure_embedded_responses(cfg, target=target)
            out.append(f"{resolved}@{weight}" if weight != 1.0 else str(resolved))
        else:
            out.append(spec)
    return out


def prepare_data(cfg, tokenizer, target=None):
    sources = resolve_sources(cfg, target)
    convs, report = load_sources(
        sources, cfg.data.on_bad_record, tuple(cfg.data.roots), seed=cfg.pipeline.seed
    )
    log.info("data: %s", report.summary() if hasattr(report, "summary") else report)
    dataset = build_dataset(cfg.data, tokenizer, convs)
    log.info("tokenized: %s", dataset.stats)
    train, heldout = dataset.split_heldout(cfg.data.eval_fraction, cfg.pipeline.seed)
    write_heldout_prompts(Path(cfg.run_dir) / "heldout.jsonl", convs, heldout.ids)
    return train, heldout


def write_heldout_prompts(path: Path, convs, held_ids) -> None:
    """The user side of each held-out conversation (assistant turns are regenerated at eval)."""
    wanted = set(held_ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    seen = set()
    with open(tmp, "w", encoding="utf-8") as f:
        for c in convs:
            if c.id in wanted and c.id not in seen:
                seen.add(c.id)
                msgs = [m for m in c.messages if m["role"] != "assistant"]
                f.write(json.dumps({"id": c.id, "messages": msgs}) + "\n")
    os.replace(tmp, path)
