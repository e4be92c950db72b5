"""Records -> the target's token ids + response-only loss masks; the tokenized, cached dataset.

`Rendering` (built from the config by `Rendering.from_config` only) decides how a record becomes
text and ids, the same way in training tokenization, generation (data/generate.py) and evaluation
(eval/evaluation.py), so a drafter trains on exactly the text it serves on:
- data.format=chat: the target's chat template (or data.chat_template's, which replaces it),
  with the template variables of the config (enable_thinking); assistant turns are supervised;
- data.format=text: a base model's raw text, no template: the turns' contents joined as they
  are, the tokenizer's BOS first where it puts one, its EOS after a finished response; the
  response (a document, or a completion after its prompt) is supervised.

How the mask is found (any Jinja chat template, no per-model patterns): render the whole
conversation once as text. For every assistant message i, render

    P_i = template(messages[:i],   add_generation_prompt=True)   # ends right after the header
    Q_i = template(messages[:i+1], add_generation_prompt=False)  # ends after the turn

The supervised characters are Q_i[len(P_i):], minus trailing whitespace when the turn ends with a
special token (the end-of-turn token, e.g. `<|im_end|>` / `<|eot_id|>`; ChatML's "\\n" after it
is not something the model generates). This only works if the template is prefix-stable: P_i
must be a prefix of Q_i, and Q_i a prefix of the full text. Both are checked; a template that
re-renders history (e.g. strips reasoning from earlier turns) raises a UserError, never a wrong
mask. Tool turns (role 'tool') are rendered as context and never supervised; an assistant turn's
tool calls are. A template that refuses a conversation (e.g. one without tool support meeting a
tool turn) raises a UserError naming the conversation.

Characters map to tokens through ONE tokenization of the full text (offset mapping), so the ids
are exactly what the model sees; a token is supervised iff its first character is supervised.
Texts are tokenized in batches (the Rust tokenizer parallelises across a batch).

The cache is one .npz file (no pickle) per key = sha256(conversations, tokenizer, data format,
template text, template kwargs, max_length, overlong, min_supervised, format version), written
atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_trainer.config import Config, DataConfig
from dflash_trainer.errors import UserError
from dflash_trainer.files import atomic_file, cache_root
from dflash_trainer.observe.progress import showing_progress

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
_STAT_KEYS = (
    "examples",
    "dropped_overlong",
    "truncated",
    "dropped_short",
    "tokens",
    "supervised_tokens",
)


@dataclass
class TokenizedExample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 = assistant token (content + end-of-turn)
    truncated: bool = False


def _tok_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def read_chat_template(path: str) -> str | None:
    """The text of the Jinja chat-template file `path` (data.chat_template); None for ''."""
    if not path:
        return None
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(
            f"data.chat_template: '{path}' is not a file. Give the path of a Jinja chat-template "
            "file, or '' to use the target tokenizer's own template."
        )
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"data.chat_template: {p}: not valid UTF-8 (byte offset {e.start}); re-encode it."
        ) from None
    if not text.strip():
        raise UserError(f"data.chat_template: {p} is empty; give a Jinja chat template.")
    return text


@dataclass(frozen=True)
class Rendering:
    """How a record becomes the target's text and token ids (module docstring). Build it with
    `from_config`, the one place the config's format, template and template variables are read;
    `Rendering()` is chat with the tokenizer's own template and thinking off.

    format: 'chat' or 'text'. chat_template: the text of a template that replaces the
    tokenizer's own (None: its own). enable_thinking: the template's thinking switch (templates
    that have none ignore it)."""

    format: str = "chat"
    chat_template: str | None = None
    enable_thinking: bool = False

    @classmethod
    def from_config(cls, cfg: Config) -> Rendering:
        return cls(
            cfg.data.format, read_chat_template(cfg.data.chat_template), cfg.target.enable_thinking
        )

    @property
    def template_kwargs(self) -> dict:
        """The chat template's variables beyond the messages."""
        return {"enable_thinking": self.enable_thinking}

    def template(self, tokenizer) -> str | None:
        """The chat template in use: the replacement, else the tokenizer's own (None in text
        mode, where none is used)."""
        if self.format == "text":
            return None
        return self.chat_template or getattr(tokenizer, "chat_template", None)

    def identity(self) -> dict:
        """What sets this rendering apart from the default `Rendering()` (thinking aside, which
        generation records on its own): for provenance and cache names that must change with
        it and stay the same for the default."""
        out: dict = {}
        if self.format != "chat":
            out["format"] = self.format
        if self.chat_template is not None:
            out["chat_template"] = hashlib.sha256(self.chat_template.encode()).hexdigest()[:16]
        return out

    def check(self, tokenizer) -> None:
        """Chat records need a template: the tokenizer's or data.chat_template's."""
        if self.format == "chat" and not self.template(tokenizer):
            raise UserError(
                f"tokenizer '{_tok_name(tokenizer)}' has no chat template, so chat records "
                "cannot be rendered (a base model?). Either train on raw text: "
                '--data.format=text with records {"text": ...} or {"prompt": ..., '
                '"completion": ...} (no template); or give a template: '
                "--data.chat_template=FILE (a Jinja chat template, e.g. ChatML)."
            )

    def _kwargs(self) -> dict:
        """What apply_chat_template gets besides the messages."""
        kw = self.template_kwargs
        if self.chat_template is not None:
            kw["chat_template"] = self.chat_template
        return kw

    def framing(self, tokenizer) -> tuple[list[int], list[int]]:
        """(ids before the text, ids after a finished response). Text mode: the tokenizer's BOS
        where it puts one before a text by its own convention (Llama, Gemma; GPT-2 and Qwen put
        none), and its EOS, which ends a response the way the target ends one. Chat mode:
        nothing (the template places every special token)."""
        if self.format != "text":
            return [], []
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        own = tokenizer("a", add_special_tokens=True)["input_ids"]
        head = [bos] if bos is not None and own[:1] == [bos] else []
        return head, ([eos] if eos is not None else [])

    def render(
        self,
        tokenizer,
        messages: list[dict],
        specials=None,
        open_last: bool = False,
        where: str = "the conversation",
    ) -> tuple[str, list[tuple[int, int]]]:
        """The text of a whole record and its supervised character spans (framing aside); a
        template's refusal of the record is an error naming `where`."""
        if self.format == "text":
            return render_text(messages)
        return _render_conversation(tokenizer, messages, self._kwargs(), specials, open_last, where)

    def prompt_ids(self, tokenizer, messages: list[dict]) -> list[int]:
        """Token ids of the prompt `messages` as the target answers them (generation,
        evaluation): chat = the template plus its generation prompt; text = the prompt's raw
        text after the framing's BOS."""
        self.check(tokenizer)
        if self.format == "text":
            head, _ = self.framing(tokenizer)
            text = render_text(messages)[0]
            return head + list(tokenizer(text, add_special_tokens=False)["input_ids"])
        text = _render(tokenizer, messages, True, self._kwargs())
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer, messages, gen: bool, kwargs: dict) -> str:
    import jinja2

    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen, **kwargs
        )
    except jinja2.TemplateSyntaxError as e:
        which = (
            "data.chat_template"
            if "chat_template" in kwargs
            else f"the chat template of tokenizer '{_tok_name(tokenizer)}'"
        )
        raise UserError(
            f"{which}: line {e.lineno}: {e.message} (not a valid Jinja template). Fix it, or "
            "give another with --data.chat_template=FILE."
        ) from None


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The prompt side of a conversation: its system/user turns before the first assistant turn
    (later turns depended on the old response; `generate` regenerates from this, and a
    conversation's identity (prompt_hash) is its prompt)."""
    out = []
    for m in messages:
        if m.get("role") == "assistant":
            break
        out.append({"role": m["role"], "content": m["content"]})
    return out


def prompt_hash(messages: list[dict]) -> str:
    """A conversation's identity by content: sha256 of its prompt turns (ids differ between
    files; the text does not)."""
    blob = json.dumps(prompt_messages(messages), ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def render_text(messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Raw text (data.format=text): the turns' contents joined as they are, no template; the
    spans of the response turns (the document, or the completion after its prompt)."""
    parts, spans, pos = [], [], 0
    for m in messages:
        text = m["content"]
        if m["role"] == "assistant" and text:
            spans.append((pos, pos + len(text)))
        parts.append(text)
        pos += len(text)
    return "".join(parts), spans


def _special_strings(tokenizer) -> tuple[str, ...]:
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok))
    return tuple(sorted(s for s in specials if s))


def render_with_spans(
    tokenizer,
    messages: list[dict],
    template_kwargs: dict | None = None,
    specials: tuple[str, ...] | None = None,
    open_last: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
    """Full text and the character spans [start, end) of every supervised assistant turn.

    open_last: the last assistant turn was cut at a generation limit; the text then ends with
    its content, without the end-of-turn token (and whatever the template puts after it)."""
    kw = dict(template_kwargs or {})
    specials = _special_strings(tokenizer) if specials is None else specials
    full = _render(tokenizer, messages, False, kw)
    last_assistant = max(
        (i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1
    )
    spans = []
    for i, m in enumerate(messages):
        # A leading assistant turn has no prompt to condition on: never supervised.
        if m["role"] != "assistant" or i == 0:
            continue
        p = _render(tokenizer, messages[:i], True, kw)
        q = _render(tokenizer, messages[: i + 1], False, kw)
        if not q.startswith(p) or not full.startswith(q):
            which = "the generation prompt" if not q.startswith(p) else f"messages[:{i + 1}]"
            raise UserError(
                f"chat template of tokenizer '{_tok_name(tokenizer)}' is not prefix-stable: "
                f"{which} does not render as a prefix of the conversation at assistant turn "
                f"{i} (the template renders earlier turns differently, e.g. drops reasoning). "
                "Give a template that renders history unchanged (--data.chat_template=FILE), "
                "or use single-turn data."
            )
        start, end = len(p), len(q)
        # Turn = content + end-of-turn special + maybe whitespace ("\n" in ChatML): keep the
        # special, drop the whitespace after it. endswith() over a tuple is O(total special len).
        kept = q[start:end].rstrip()
        if kept.endswith(specials):
            end = start + len(kept)
            if open_last and i == last_assistant:
                sp = max((x for x in specials if kept.endswith(x)), key=len)
                end -= len(sp)
        if end > start:
            spans.append((start, end))
        if open_last and i == last_assistant:
            return full[:end], spans
    return full, spans


def _render_conversation(
    tokenizer,
    messages: list[dict],
    template_kwargs: dict | None,
    specials: tuple[str, ...] | None,
    open_last: bool,
    where: str,
) -> tuple[str, list[tuple[int, int]]]:
    """`render_with_spans`, with the template's own refusal of a conversation (its
    `raise_exception`, or a field it cannot read) turned into an error naming `where`."""
    from jinja2.exceptions import TemplateError  # jinja2 comes with transformers

    try:
        return render_with_spans(tokenizer, messages, template_kwargs, specials, open_last)
    except TemplateError as e:
        tools = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        fix = (
            "It has tool turns (role 'tool' or assistant tool calls), which this template may "
            "not support: drop the tool turns (or the records that have them) from the data, "
            "or use a target whose chat template renders tools."
            if tools
            else "Fix the record, or set `tokenizer.chat_template` to a template that accepts it."
        )
        raise UserError(
            f"chat template of tokenizer '{_tok_name(tokenizer)}' rejected {where}: {e}. {fix}"
        ) from None


def _mask_from_offsets(offsets, spans) -> np.ndarray:
    starts = np.fromiter((o[0] for o in offsets), dtype=np.int64, count=len(offsets))
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for s, e in spans:
        mask[(starts >= s) & (starts < e)] = 1
    return mask


def _finish(
    ids: list[int],
    mask: np.ndarray,
    max_length: int,
    overlong: str,
    min_supervised: int,
    stats: dict | None,
) -> TokenizedExample | None:
    stats = stats if stats is not None else {}
    truncated = False
    if len(ids) > max_length:
        if overlong == "drop":
            stats["dropped_overlong"] = stats.get("dropped_overlong", 0) + 1
            return None
        ids, mask, truncated = ids[:max_length], mask[:max_length], True
    if int(mask.sum()) < min_supervised:
        stats["dropped_short"] = stats.get("dropped_short", 0) + 1
        return None
    if truncated:
        stats["truncated"] = stats.get("truncated", 0) + 1
    return TokenizedExample(list(ids), mask.tolist(), truncated)


def _encode(tokenizer, texts: list[str]):
    if not getattr(tokenizer, "is_fast", True):
        raise UserError(
            f"tokenizer '{_tok_name(tokenizer)}' is a slow (Python) tokenizer; the "
            "loss mask needs offset mappings. Load it with use_fast=True."
        )
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], enc["offset_mapping"]


def _framed(ids, mask: np.ndarray, framing, open_last: bool) -> tuple[list, np.ndarray]:
    """ids and mask with the rendering's framing around them: the head unsupervised, the tail
    (EOS) supervised unless the response was cut at a generation limit."""
    head, tail = framing
    tail = [] if open_last else tail
    if not head and not tail:
        return ids, mask
    mask = np.concatenate(
        [np.zeros(len(head), np.uint8), mask, np.ones(len(tail), np.uint8)]
    ).astype(np.uint8)
    return list(head) + list(ids) + list(tail), mask


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    max_length: int,
    overlong: str,
    min_supervised: int = 2,
    rendering: Rendering | None = None,
    stats: dict | None = None,
    open_last: bool = False,
) -> TokenizedExample | None:
    """One conversation -> ids + response mask, or None (dropped; the reason is counted in stats).

    overlong: 'truncate' keeps the first max_length tokens, 'drop' drops the example.
    rendering: None = `Rendering()` (chat, the tokenizer's own template).
    open_last: the last answer was cut at a generation limit: no end-of-turn token after it.
    """
    rendering = rendering or Rendering()
    rendering.check(tokenizer)
    text, spans = rendering.render(tokenizer, messages, open_last=open_last)
    (ids,), (offs,) = _encode(tokenizer, [text])
    ids, mask = _framed(
        ids, _mask_from_offsets(offs, spans), rendering.framing(tokenizer), open_last
    )
    return _finish(ids, mask, max_length, overlong, min_supervised, stats)


# --------------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------------


class TokenizedDataset:
    """Tokenized conversations: per-example int32 ids, uint8 loss masks, string ids, lengths."""

    def __init__(
        self,
        input_ids: list,
        loss_mask: list,
        ids: list[str],
        stats: dict | None = None,
        pad_id: int = 0,
    ):
        assert len(input_ids) == len(loss_mask) == len(ids)
        self.input_ids = [np.asarray(x, dtype=np.int32) for x in input_ids]
        self.loss_mask = [np.asarray(x, dtype=np.uint8) for x in loss_mask]
        self.ids = list(ids)
        self.lengths = np.array([len(x) for x in self.input_ids], dtype=np.int64)
        self.pad_id = int(pad_id)
        self.stats = dict(stats or {})
        self.stats.setdefault("examples", len(self.ids))
        self.stats.setdefault("tokens", int(self.lengths.sum()))
        self.stats.setdefault("supervised_tokens", int(sum(int(m.sum()) for m in self.loss_mask)))
        # Per example, set by data/prepare.py (not cached): the source stratum and, on the
        # held-out side, the role ('validation' picks best/, 'report' is reported).
        self.sources: list[str] | None = None
        self.roles: list[str] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, indices) -> TokenizedDataset:
        idx = list(indices)
        sub = TokenizedDataset(
            [self.input_ids[i] for i in idx],
            [self.loss_mask[i] for i in idx],
            [self.ids[i] for i in idx],
            None,
            self.pad_id,
        )
        for name in ("sources", "roles"):
            vals = getattr(self, name)
            if vals is not None:
                setattr(sub, name, [vals[i] for i in idx])
        return sub

    def split_heldout(
        self, fraction: float, seed: int = 0
    ) -> tuple[TokenizedDataset, TokenizedDataset]:
        """Split by conversation id (weighted copies share an id and stay on one side)."""
        groups = sorted(set(self.ids))
        n_held = int(round(fraction * len(groups)))
        if fraction > 0 and len(groups) > 1:
            n_held = min(max(n_held, 1), len(groups) - 1)
        rng = np.random.default_rng([seed, 0x5EED])
        held = {groups[i] for i in rng.permutation(len(groups))[:n_held].tolist()}
        train_idx = [i for i, g in enumerate(self.ids) if g not in held]
        held_idx = [i for i, g in enumerate(self.ids) if g in held]
        return self.subset(train_idx), self.subset(held_idx)

    # ---- cache (npz, no pickle) ----
    def save(self, path: Path) -> None:
        flat_ids = np.concatenate(self.input_ids) if self.input_ids else np.zeros(0, np.int32)
        flat_mask = np.concatenate(self.loss_mask) if self.loss_mask else np.zeros(0, np.uint8)
        # atomic: a crash never leaves a half-written cache file
        with atomic_file(path) as f:
            np.savez(
                f,
                input_ids=flat_ids,
                loss_mask=flat_mask,
                lengths=self.lengths,
                ids=np.array(self.ids, dtype=np.str_),
                meta=np.array(
                    json.dumps({"stats": self.stats, "pad_id": self.pad_id, "format": CACHE_FORMAT})
                ),
            )

    @classmethod
    def load(cls, path: Path) -> TokenizedDataset:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            bounds = np.cumsum(z["lengths"])[:-1]
            ids = np.split(z["input_ids"], bounds) if len(z["lengths"]) else []
            mask = np.split(z["loss_mask"], bounds) if len(z["lengths"]) else []
            return cls(ids, mask, z["ids"].tolist(), meta["stats"], meta["pad_id"])


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256(_tok_name(tokenizer).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())  # vocab, merges, normalizer, special tokens
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return h.hexdigest()


def cache_key(data_cfg: DataConfig, tokenizer, conversations, rendering: Rendering) -> str:
    conv_h = hashlib.sha256()
    for c in conversations:
        rec = [c.id, c.messages] + (["truncated"] if getattr(c, "truncated", False) else [])
        conv_h.update(json.dumps(rec, ensure_ascii=False, sort_keys=True).encode())
        conv_h.update(b"\x00")
    key = {
        "format": CACHE_FORMAT,
        "conversations": conv_h.hexdigest(),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "data_format": rendering.format,
        "template": rendering.template(tokenizer),
        "max_length": data_cfg.max_length,
        "overlong": data_cfg.overlong,
        "min_supervised": data_cfg.min_supervised,
        "truncated": getattr(data_cfg, "truncated", "keep_open"),
        "template_kwargs": rendering.template_kwargs if rendering.format == "chat" else {},
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def tokenized_dir(data_cfg: DataConfig, cache_dir: str = "") -> Path:
    """Where tokenized data sets are cached: data.cache_dir, else CACHE_ROOT/tokenized, the root
    being the one every cache shares (files.cache_root of target.cache_dir: `cache_dir`)."""
    if data_cfg.cache_dir:
        return Path(data_cfg.cache_dir).expanduser()
    return cache_root(cache_dir) / "tokenized"


def _tokenize_all(
    tokenizer,
    conversations,
    data_cfg: DataConfig,
    rendering: Rendering,
    chunk: int = 512,
    progress: bool = True,
):
    """Tokenize every conversation (no cache). Returns (ids, masks, conv ids, stats).
    `progress`: a bar over conversations, tokens kept so far in its postfix."""
    rendering.check(tokenizer)
    specials = _special_strings(tokenizer)
    framing = rendering.framing(tokenizer)
    stats = {k: 0 for k in _STAT_KEYS}
    policy = getattr(data_cfg, "truncated", "keep_open")
    if policy == "drop":
        kept = [c for c in conversations if not getattr(c, "truncated", False)]
        stats["dropped_truncated"] = len(conversations) - len(kept)
        conversations = kept
    else:
        stats["open_ended"] = sum(bool(getattr(c, "truncated", False)) for c in conversations)
    out_ids, out_mask, out_cid = [], [], []
    tokens = 0  # kept so far: the bar's postfix
    with showing_progress(
        len(conversations), desc="tokenize", unit="conversation", enabled=progress
    ) as bar:
        for lo in range(0, len(conversations), chunk):
            part = conversations[lo : lo + chunk]
            open_last = [bool(getattr(c, "truncated", False)) for c in part]
            rendered = [
                rendering.render(
                    tokenizer, c.messages, specials, o, f"conversation '{c.id}' of {c.source}"
                )
                for c, o in zip(part, open_last)
            ]
            all_ids, all_offs = _encode(tokenizer, [t for t, _ in rendered])
            for c, o, (_, spans), ids, offs in zip(part, open_last, rendered, all_ids, all_offs):
                ids, mask = _framed(ids, _mask_from_offsets(offs, spans), framing, o)
                ex = _finish(
                    ids,
                    mask,
                    data_cfg.max_length,
                    data_cfg.overlong,
                    data_cfg.min_supervised,
                    stats,
                )
                if ex is None:
                    continue
                out_ids.append(np.asarray(ex.input_ids, dtype=np.int32))
                out_mask.append(np.asarray(ex.loss_mask, dtype=np.uint8))
                out_cid.append(c.id)
                tokens += len(ex.input_ids)
            bar.update(len(part))
            bar.set_postfix(tokens=tokens, refresh=False)
    stats["examples"] = len(out_ids)
    stats["tokens"] = int(sum(len(x) for x in out_ids))
    stats["supervised_tokens"] = int(sum(int(m.sum()) for m in out_mask))
    return out_ids, out_mask, out_cid, stats


def pad_token_id(tokenizer) -> int:
    pid = getattr(tokenizer, "pad_token_id", None)
    return int(pid) if pid is not None else 0


def build_dataset(
    data_cfg: DataConfig,
    tokenizer,
    conversations,
    cache_dir=None,
    rendering: Rendering | None = None,
    progress: bool = True,
) -> TokenizedDataset:
    """Tokenize (or load from the disk cache) all conversations, rendered by `rendering`
    (`Rendering.from_config(cfg)`; None = `Rendering()`: chat, the tokenizer's own template).
    `progress`: a bar while tokenizing (observe/progress.py; drawn only when stderr is a
    terminal)."""
    rendering = rendering or Rendering()
    rendering.check(tokenizer)
    root = Path(cache_dir).expanduser() if cache_dir else tokenized_dir(data_cfg)
    path = root / f"{cache_key(data_cfg, tokenizer, conversations, rendering)}.npz"
    if path.exists():
        try:
            ds = TokenizedDataset.load(path)
            log.info("tokenized data: cache hit %s (%d examples)", path, len(ds))
            return ds
        except Exception as e:  # a corrupt cache is rebuilt, never trusted
            log.warning("tokenized data: ignoring unreadable cache %s (%s)", path, e)
    ids, masks, cids, stats = _tokenize_all(
        tokenizer, conversations, data_cfg, rendering, progress=progress
    )
    if not ids:
        raise UserError(
            f"no conversation survived tokenization ({stats}); raise data.max_length, "
            "use data.overlong=truncate or lower data.min_supervised."
        )
    ds = TokenizedDataset(ids, masks, cids, stats, pad_token_id(tokenizer))
    ds.save(path)
    log.info("tokenized data: %s -> %s", stats, path)
    return ds
