"""Prompt sets for evaluation: JSONL prompt files, the embedded sets (MT-Bench, HumanEval), a
run's held-out prompts, and which of them the run trained on (train_ids.json)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dflash_trainer.config import Config
from dflash_trainer.data import embedded  # module: tests patch embedded_prompts
from dflash_trainer.data.chat import prompt_hash
from dflash_trainer.data.sources import BadRecord, parse_record
from dflash_trainer.errors import UserError
from dflash_trainer.layout import RunLayout

log = logging.getLogger(__name__)


def load_prompt_file(path: str | Path, data_format: str = "chat") -> list[tuple[str, list[dict]]]:
    """A JSONL file of prompts, one record per line in any shape data/sources.py reads for
    `data_format` (chat: OpenAI `messages`, content-part lists included, or ShareGPT
    `conversations`; text: `prompt`, the raw text a base model continues)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"eval prompt file '{p}' does not exist; eval.datasets takes "
            "'mt-bench', 'humaneval', 'heldout', 'long[:N]' or a JSONL path."
        )
    if data_format == "text":
        expected = 'expected {"id": ..., "prompt": "..."} (data.format=text)'
        no_prompt = "the record has no 'prompt' to continue"
    else:
        expected = (
            'expected {"id": ..., "messages": [{"role": "user", "content": "..."}]} with roles '
            "system/user/assistant"
        )
        no_prompt = "the conversation has no user turn to answer"
    out = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{p}:{n}: invalid JSON ({e.msg}); one object per line.") from None
        try:
            rid, msgs = parse_record(rec, data_format)
        except BadRecord as e:
            raise UserError(f"{p}:{n}: {expected} ({e.field}: {e.problem}).") from None
        if not msgs:
            raise UserError(f"{p}:{n}: {expected} (the conversation is empty).")
        if not any(m["role"] == "user" for m in msgs):
            raise UserError(f"{p}:{n}: {no_prompt}.")
        out.append((str(rid) if rid is not None else f"{p.name}:{n}", msgs))
    return out


def heldout_file(cfg: Config) -> Path:
    return Path(cfg.eval.heldout_path or RunLayout.of(cfg.run_dir).heldout)


# A long prompt's transcript: about this many characters per token (English text and code under
# the embedded target's tokenizer: 3.6-4.3); the measured context lengths are what tau is
# bucketed by (eval/metrics.py tau_by_context), so the estimate only sizes the set.
_CHARS_PER_TOKEN = 4


def long_prompts(convs: list[tuple[str, list[dict]]], tokens: int) -> list[tuple[str, list]]:
    """Each conversation's first user turn after a transcript of the others (their turns in
    order, answers included, cycling) of about `tokens` tokens, in a system message: one
    question asked at a long context, as after a long chat. (id "long-ID", messages)."""
    out = []
    for i, (cid, msgs) in enumerate(convs):
        question = next((m for m in msgs if m["role"] == "user"), None)
        others = [m for j, (_, ms) in enumerate(convs) if j != i for m in ms]
        if question is None or not others:
            continue
        lines: list[str] = []
        size, k = 0, 0
        while size < tokens * _CHARS_PER_TOKEN:
            m = others[k % len(others)]
            lines.append(f"{m['role']}: {m['content']}")
            size += len(lines[-1]) + 1
            k += 1
        history = {"role": "system", "content": "Earlier conversation:\n" + "\n".join(lines)}
        out.append((f"long-{cid}", [history, {"role": "user", "content": question["content"]}]))
    return out


def load_prompt_set(name: str, cfg: Config) -> list[tuple[str, list[dict]]]:
    """(id, messages) pairs for one entry of eval.datasets. `long` / `long:N`: the held-out
    prompts, each asked after about N (default 4096) tokens of the other held-out conversations
    (long_prompts): acceptance at long contexts, per context-length bucket."""
    kind, colon, size = name.partition(":")
    if kind == "long":
        if colon and not size.isdigit():
            raise UserError(f"eval.datasets: '{name}' is not long or long:N (N tokens).")
        return long_prompts(load_prompt_set("heldout", cfg), int(size) if colon else 4096)
    if name in ("mt-bench", "humaneval"):
        prefix = {"mt-bench": "mtbench-", "humaneval": "humaneval-"}[name]
        convs = [c for c in embedded.embedded_prompts() if c.id.startswith(prefix)]
        if not convs:
            raise UserError(f"no embedded prompts found for eval dataset '{name}'.")
        return [(c.id, c.messages) for c in convs]
    path = heldout_file(cfg) if name == "heldout" else Path(name)
    if name == "heldout" and not path.is_file():
        raise UserError(
            f"eval.datasets=heldout: no held-out prompts at '{path}'. Training writes them "
            "(RUN_DIR/heldout.jsonl, the prompts it never trained on): pass the run's "
            "--run_dir, or set --eval.heldout_path to a JSONL of {id, messages}. "
            "mt-bench/humaneval are not held out from the embedded training data."
        )
    return load_prompt_file(path, cfg.data.format)


def training_ids(cfg: Config) -> tuple[set, set] | None:
    """(ids, prompt hashes) of the run's training conversations (train_ids.json beside the
    held-out file), or None when the run wrote none."""
    path = heldout_file(cfg).parent / "train_ids.json"
    if not path.is_file():
        return None
    d = json.loads(path.read_text(encoding="utf-8"))
    return set(d.get("ids", [])), set(d.get("prompt_hashes", []))


def split_by_training(convs, trained: tuple[set, set]) -> tuple[list, list]:
    """(prompts the run trained on, the rest), by conversation id or prompt hash."""
    ids, hashes = trained
    seen: list = []
    rest: list = []
    for cid, msgs in convs:
        (seen if cid in ids or prompt_hash(msgs) in hashes else rest).append((cid, msgs))
    return seen, rest


def prompt_groups(cfg: Config) -> dict[str, list[tuple[str, list[dict]]]]:
    """The conversations every `eval.datasets` entry decodes, by group name.

    'heldout' is decoded whole. A named set (mt-bench, humaneval, a file) is cut to
    eval.dataset_prompts; where it overlaps the run's training data (train_ids.json), a warning
    gives the overlap and the two parts are separate groups: `NAME:trained` and `NAME:unseen`."""
    trained = training_ids(cfg)
    out: dict[str, list[tuple[str, list[dict]]]] = {}
    for name in cfg.eval.datasets:
        convs = load_prompt_set(name, cfg)
        if name != "heldout":
            convs = convs[: cfg.eval.dataset_prompts]
        parts = {name: convs}
        if name != "heldout" and trained is not None:
            seen, rest = split_by_training(convs, trained)
            if seen:
                log.warning(
                    "eval: %d of %d prompts of '%s' were in this run's training data; "
                    "their tau is reported apart (%s:trained, %s:unseen)",
                    len(seen),
                    len(convs),
                    name,
                    name,
                    name,
                )
                parts = {f"{name}:trained": seen, f"{name}:unseen": rest}
        out.update({k: v for k, v in parts.items() if v})
    return out
