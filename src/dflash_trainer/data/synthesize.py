"""Prompts without a hub (Magpie-style): the target writes the user turns itself.

The target's chat template is rendered up to the start of a user turn (after the template's own
system prompt, or `synth.system_prompt`), optionally followed by an opening of the turn
(`synth.hints`, e.g. a code request), and the target samples the rest of the turn until its
end-of-turn token. What it writes is kept only if it is a clean, plausible prompt:

- it ended with a stop token within `synth.max_tokens` (a cut turn is dropped);
- it is long enough (`synth.min_chars` of its own text), printable, mostly letters, mostly
  ASCII letters (the evaluation is English), not a repetition loop, and holds no role header or
  template marker leaking from the template;
- it is neither an exact nor a near duplicate (word 3-gram Jaccard >= `synth.near_duplicate`,
  after normalising case, punctuation and spacing) of a prompt kept before;
- it is not equal or near to any prompt of `synth.exclude` (the held-out sets): there the
  containment of its 3-grams in the excluded prompt counts too, so a fragment copied out of an
  MT-Bench question is refused as well.

Deterministic under `synth.seed` on the project's loop (one dtype): it draws from a seed per
(seed, round, hint, copy). vLLM's engine is seeded per round but its CPU build takes no
per-request seed (models/vllm_worker.py), and its samples were not reproducible across runs:
two runs of the same settings on one machine shared 223 of 1,200 prompts (2026-12-06). The
cached prompts file is the record to keep for a reproducible data set. Each prompt record
carries its provenance (synthesised, seed, round, temperature, top_p, top_k, hint, engine,
target, revision, dtype). The output is a JSONL of prompt records
`{id, messages, source: "synth", provenance}` that `generate` answers like any prompt file; a
file made with the same settings is reused (`synthesize_prompts`).
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
import unicodedata
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

from dflash_trainer.config import RENAMED_VALUES, Config, SamplingConfig, SynthConfig
from dflash_trainer.data.chat import Rendering
from dflash_trainer.data.generate import (
    choose_engine,
    decode_batch,
    generate_with,
    load_prompts,
    print_summary,
    read_done_ids,
    settings_digest,
)
from dflash_trainer.data.sources import Conversation
from dflash_trainer.decode.sampler import hash32_int
from dflash_trainer.errors import UserError
from dflash_trainer.files import cache_root, write_atomic
from dflash_trainer.models.target import TargetModel
from dflash_trainer.precision import dtype_label, dtype_name

log = logging.getLogger(__name__)

SOURCE = "synth"
_SENTINEL = "\x00SYNTH-USER-TURN\x00"
_HF_BATCH = 64  # rows per decode of the project's loop (data/generate.py's batch for the demo)
_ROLE_LINE = re.compile(r"^\s*(system|user|assistant|human|gpt)\s*:?\s*$", re.I | re.M)


# ---------------------------------------------------------------------------------- similarity


def normalise(text: str) -> str:
    """Lower case, letters and digits only, single spaces: what near-duplicates share."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.sub(r"[^\w]+", " ", text).split())


def shingles(text: str) -> frozenset:
    """Word 3-grams of the normalised text (the words themselves, joined, below three)."""
    words = normalise(text).split()
    if len(words) < 3:
        return frozenset([" ".join(words)])
    return frozenset(" ".join(words[i : i + 3]) for i in range(len(words) - 2))


class NearDuplicates:
    """Prompts seen so far, found again by exact normalised text or shingle overlap: an inverted
    index from 3-gram to prompt, so a lookup costs the prompts sharing a 3-gram, not all."""

    def __init__(self, threshold: float, containment: bool = False):
        self.threshold = threshold
        self.containment = containment  # also |A & B| / |A| (A: the prompt looked up)
        self._exact: set[str] = set()
        self._sets: list[frozenset] = []
        self._post: dict[str, list[int]] = defaultdict(list)

    def __len__(self) -> int:
        return len(self._sets)

    def add(self, text: str) -> None:
        s = shingles(text)
        self._exact.add(normalise(text))
        for g in s:
            self._post[g].append(len(self._sets))
        self._sets.append(s)

    def similarity(self, text: str) -> float:
        """Largest similarity of `text` to a prompt added: 1.0 for the same normalised text."""
        if normalise(text) in self._exact:
            return 1.0
        a = shingles(text)
        shared = Counter(i for g in a for i in self._post.get(g, ()))
        best = 0.0
        for i, c in shared.items():
            b = len(self._sets[i])
            sim = c / (len(a) + b - c)
            if self.containment:
                sim = max(sim, c / len(a))
            best = max(best, sim)
        return best

    def near(self, text: str) -> bool:
        return self.similarity(text) >= self.threshold


# -------------------------------------------------------------------------------------- filters


def reject_reason(text: str, own: str, stopped: bool, min_chars: int) -> str | None:
    """Why a sampled user turn is not a usable prompt (None: it is). `text`: the whole turn
    (hint + sampled part); `own`: the sampled part alone."""
    if not stopped:
        return "cut"  # no end-of-turn within synth.max_tokens: not a whole prompt
    if len(own.strip()) < min_chars:
        return "short"
    if "\ufffd" in text or any(
        unicodedata.category(ch) == "Cc" and ch not in "\n\t" for ch in text
    ):
        return "garbage"
    if "<|" in text or "|>" in text or _ROLE_LINE.search(text):
        return "template"  # a role header or a special token's text leaking from the template
    visible = [ch for ch in text if not ch.isspace()]
    letters = [ch for ch in visible if ch.isalpha()]
    if len(letters) < 0.5 * len(visible):
        return "garbage"
    if sum(ch.isascii() for ch in letters) < 0.9 * len(letters):
        return "language"
    words = normalise(text).split()
    grams = Counter(" ".join(words[i : i + 3]) for i in range(len(words) - 2))
    if grams and grams.most_common(1)[0][1] > 3:
        return "loop"
    if len(words) >= 12 and len(set(words)) < 0.3 * len(words):
        return "loop"
    return None


def user_text(messages: list[dict]) -> str:
    """The user side of a prompt, as compared against the held-out prompts."""
    return "\n".join(str(m.get("content", "")) for m in messages if m.get("role") == "user")


def excluded_prompts(cfg: Config) -> NearDuplicates:
    """Every prompt of `synth.exclude` ('embedded', heldout.jsonl, ...), indexed for lookups."""
    index = NearDuplicates(cfg.synth.near_duplicate, containment=True)
    for spec in cfg.synth.exclude:
        for conv in load_prompts(spec, cfg):
            text = user_text(conv.messages)
            if text.strip():
                index.add(text)
    return index


# ------------------------------------------------------------------------------------- sampling


def pre_query_ids(tokenizer, rendering: Rendering, system_prompt: str, hint: str) -> list[int]:
    """Token ids of the template up to the start of a user turn's text, then `hint`."""
    if rendering.format != "chat":
        raise UserError(
            "synth.prompts needs a chat template (the target writes a user turn); "
            "data.format=text has none. Use --data.format=chat, or give prompts with --prompts."
        )
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    text, _ = rendering.render(
        tokenizer, msgs + [{"role": "user", "content": _SENTINEL}], where="synth"
    )
    cut = text.find(_SENTINEL)
    if cut < 0:
        raise UserError(
            "synth: the chat template does not render a user turn's text verbatim, so where "
            "a user turn starts is unknown; give prompts with --prompts instead."
        )
    return list(tokenizer(text[:cut] + hint, add_special_tokens=False)["input_ids"])


def _sample_project(target, row: list[int], count: int, s, stop, seed: int) -> list[tuple]:
    """`count` continuations of one pre-query with the project's decode loop: (tokens, ended).
    The sampler is keyed by (seed, position): each copy of the row gets its own seed."""
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else stop[0]
    out: list[tuple] = []
    for c0 in range(0, count, _HF_BATCH):
        n = min(_HF_BATCH, count - c0)
        seeds = [hash32_int(seed * 1_000_003 + c0 + i) for i in range(n)]
        out += decode_batch(target, [row] * n, s.max_tokens, s.sampling, seeds, pad, list(stop))
    return out


def _sample_vllm(vllm, rows: list[list[int]], count: int, s, stop, seed: int) -> list[list]:
    """`count` continuations of each row from one vLLM call: per row [(tokens, ended)]."""
    res = vllm.run(
        rows,
        s.max_tokens,
        stop_ids=stop,
        sampling=s.sampling,
        seed=seed,
        mode="generate",
        n=count,
    )
    out = []
    for r in res["results"]:
        samples = r.get("samples") or [r["tokens"]]
        per = []
        for t in samples:
            t = [int(x) for x in t]
            ended = bool(t) and t[-1] in stop
            per.append((t[:-1] if ended else t, ended))
        out.append(per)
    return out


def sample_turns(target, rows, count, s, engine, vllm, seed) -> list[list[tuple]]:
    """Per pre-query row, `count` sampled continuations (token ids without the stop, ended on a
    stop id); seeded by (seed, row)."""
    stop = [int(x) for x in target.eos_token_ids]
    if engine == "vllm":
        return _sample_vllm(vllm, rows, count, s, stop, seed)
    return [_sample_project(target, r, count, s, stop, seed * 7919 + i) for i, r in enumerate(rows)]


def _sample_rounds(target, rows, hints, s: SynthConfig, engine, vllm, screen) -> tuple[int, int]:
    """Sample user turns round after round until `screen` keeps s.prompts of them or
    s.max_rounds have run; each round asks for what is missing at the last round's keep rate.
    Returns (candidates offered, rounds run)."""
    tok = target.tokenizer
    candidates, rate, rounds = 0, 0.5, 0
    while len(screen.records) < s.prompts and rounds < s.max_rounds:
        before = len(screen.records)
        per_hint = max(1, math.ceil((s.prompts - before) / max(rate, 0.05) / len(hints)))
        # far apart per round (the project's loop seeds each copy with seed + its index)
        seed = (s.seed * 1_000 + rounds) * 1_000_003
        sampled = sample_turns(target, rows, per_hint, s, engine, vllm, seed)
        for k in range(per_hint):  # hints interleaved, so a short run keeps their mix
            for h, hint in enumerate(hints):
                if len(screen.records) < s.prompts:
                    ids, ended = sampled[h][k]
                    candidates += 1
                    screen.offer(hint, tok.decode(ids, skip_special_tokens=True), ended, rounds)
        rate = max((len(screen.records) - before) / (per_hint * len(hints)), 0.01)
        rounds += 1
    return candidates, rounds


# ------------------------------------------------------------------------------------------ entry


class _Screen:
    """The filters, the held-out exclusion and the deduplication, in that order, over sampled
    user turns; the kept ones become prompt records."""

    def __init__(self, cfg: Config, prov: dict):
        self.s, self.prov = cfg.synth, prov
        self.banned = excluded_prompts(cfg)
        self.kept = NearDuplicates(cfg.synth.near_duplicate)
        self.records: list[dict] = []
        self.reasons: Counter = Counter()

    def offer(self, hint: str, own: str, ended: bool, round_: int) -> bool:
        text = (hint + own).strip()
        why = reject_reason(text, own, ended, self.s.min_chars)
        if why is None and self.banned.near(text):
            why = "held_out"
        if why is None and self.kept.near(text):
            why = "duplicate"
        if why:
            self.reasons[why] += 1
            return False
        self.kept.add(text)
        self.records.append(
            {
                "id": f"synth-{self.s.seed}-{len(self.records)}",
                "messages": [{"role": "user", "content": text}],
                "source": SOURCE,
                "provenance": {**self.prov, "round": round_, "hint": hint},
            }
        )
        return True


def synth_provenance(cfg: Config, engine: str, dtype: str) -> dict:
    """What made a synthesised prompt (each record's `provenance`, minus its round and hint); a
    prompt file is reused only when this matches."""
    s = cfg.synth
    return {
        "synthesised": True,
        "seed": s.seed,
        "temperature": s.sampling.temperature,
        "top_p": s.sampling.top_p,
        "top_k": s.sampling.top_k,
        "max_tokens": s.max_tokens,
        "min_chars": s.min_chars,
        "near_duplicate": s.near_duplicate,
        "system_prompt": s.system_prompt,
        "exclude": list(s.exclude),
        "engine": engine,
        "target": cfg.target.model,
        "target_revision": cfg.target.revision,
        "dtype": dtype,
        **Rendering.from_config(cfg).identity(),
    }


def _made_as(record: dict, prov: dict) -> bool:
    """`record` was made with the settings `prov`. An engine recorded under a name it has since
    lost (generate.engine's renamed values: "hf", the project's loop) is the same engine."""
    got = {k: record.get("provenance", {}).get(k) for k in prov}
    engine = got.get("engine")
    got["engine"] = RENAMED_VALUES.get(("generate.engine", str(engine)), engine)
    return got == prov


def _reusable(path: Path, prov: dict, count: int) -> list[dict] | None:
    """The first `count` records of an earlier file made with the same settings, else None."""
    if not path.is_file():
        return None
    recs = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    same = all(_made_as(r, prov) for r in recs)
    return recs[:count] if same and len(recs) >= count else None


def synthesize_prompts(cfg: Config, target, out_path, engine_choice: str = "auto") -> dict:
    """Write `cfg.synth.prompts` synthesised prompt records to `out_path` (JSONL; module
    docstring) and return counts: kept, candidates, rejected per reason, rounds, seconds.

    `engine_choice`: project | vllm | auto (data/generate.choose_engine: vLLM where installed and
    the job pays for its start). Reuses `out_path` when it holds enough prompts made with the same
    settings (synth_provenance)."""
    s, t0 = cfg.synth, time.perf_counter()
    if s.prompts < 1:
        raise UserError("synth.prompts must be >= 1 to synthesise prompts.")
    hints = list(s.hints) or [""]
    engine, vllm = choose_engine(cfg, engine_choice, s.prompts * s.max_tokens)
    dtype = vllm.dtype if vllm is not None else dtype_label(target.dtype)
    prov = synth_provenance(cfg, engine, dtype)
    path = Path(out_path)
    old = _reusable(path, prov, s.prompts)
    if old is not None:
        log.info("synth: reusing %d prompts from %s", len(old), path)
        return {"kept": len(old), "reused": True, "output": str(path), "engine": engine}
    rendering, tok = Rendering.from_config(cfg), target.tokenizer
    rows = [pre_query_ids(tok, rendering, s.system_prompt, h) for h in hints]
    screen = _Screen(cfg, prov)
    # the project's loop on a float32 CPU target: oneDNN's prepacked GEMM, packed once
    with target.decoding(packed=engine == "project" and cfg.target.packed_linear):
        candidates, rounds = _sample_rounds(target, rows, hints, s, engine, vllm, screen)
    records, reasons = screen.records, screen.reasons
    if not records:
        raise UserError(
            f"synth: none of {candidates} sampled user turns passed the filters ("
            + ", ".join(f"{k} {v}" for k, v in reasons.most_common())
            + "). Raise synth.max_tokens, lower synth.min_chars, or give prompts with --prompts."
        )
    if len(records) < s.prompts:
        log.warning(
            "synth: %d of %d prompts after %d rounds (%d candidates); raise synth.max_rounds",
            len(records),
            s.prompts,
            rounds,
            candidates,
        )
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return {
        "kept": len(records),
        "candidates": candidates,
        "rejected": dict(reasons),
        "rounds": rounds,
        "engine": engine,
        "seconds": time.perf_counter() - t0,
        "output": str(path),
        "reused": False,
    }


def as_prompts(path) -> list[Conversation]:
    """The prompt records of a synthesised file, as `generate` answers them."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            out.append(Conversation(id=r["id"], messages=r["messages"], source=SOURCE))
    return out


def synth_cache_paths(cfg: Config) -> tuple[Path, Path]:
    """(prompts, answers) of the `synth` data source in the cache, each named by every setting
    that makes it: greedy and sampled answers (synth.answer_sampling) share one prompts file."""
    s, g = cfg.synth, cfg.generate
    dtype = dtype_name(cfg.target.dtype, cfg.pipeline.target_devices[0])
    made = {**synth_provenance(cfg, g.engine, dtype), "prompts": s.prompts, "hints": list(s.hints)}
    answered = {**made, "answer_tokens": g.max_new_tokens, "batch_size": g.batch_size}
    answered.update(answer_sampling(s).record(), answer_seed=cfg.seed)
    root = cache_root(cfg.target.cache_dir) / "synth"
    return (
        root / f"{settings_digest(made)}.prompts.jsonl",
        root / f"{settings_digest(answered)}.answers.jsonl",
    )


def answer_sampling(s: SynthConfig) -> SamplingConfig:
    """How the synthesised prompts are answered: synth.answer_sampling, any greedy one read as
    plain greedy (its top_p and top_k change nothing, so they do not split the cache)."""
    a = s.answer_sampling
    return a if not a.greedy else SamplingConfig()


def ensure_synth_responses(cfg: Config, target=None, capture=None) -> Path:
    """The `synth` data source: synth.prompts prompts the target writes (synthesize_prompts),
    answered by the target with [generate]'s length, batch and engine and synth.answer_sampling's
    sampling; both cached and resumed by settings (synth_cache_paths). Returns the answers'
    JSONL. The target is loaded only when something is missing; `capture`: generate_with."""
    if cfg.synth.prompts < 1:
        raise UserError(
            "data.sources has 'synth' but synth.prompts is 0: set --synth.prompts=N (how many "
            "prompts the target writes), or drop 'synth' from data.sources."
        )
    prompts_file, answers = synth_cache_paths(cfg)
    if prompts_file.is_file() and {r.id for r in as_prompts(prompts_file)} <= read_done_ids(
        answers
    ):
        return answers
    if target is None:
        target = TargetModel.load(cfg.target, cfg.pipeline.target_devices[0])
    prompts = synthesized_prompts(cfg, target, prompts_file, cfg.generate.engine)
    sampling = answer_sampling(cfg.synth)
    g = replace(cfg.generate, sampling=sampling)
    how = "greedy" if sampling.greedy else f"T={sampling.temperature:g}, top-p {sampling.top_p:g}"
    print(
        f"dflash-trainer: answering the synthesised prompts with {cfg.target.model} ({how}) into "
        f"{answers} (one time; resumable)",
        file=sys.stderr,
        flush=True,
    )
    stats = generate_with(replace(cfg, generate=g), target, prompts, answers, capture)
    print_summary(stats)
    return answers


def prompts_path(answers: str | Path) -> Path:
    """Where `generate` keeps the synthesised prompts of an answers file: beside it."""
    p = Path(answers)
    return p.with_name(p.stem + ".prompts.jsonl")


def synthesized_prompts(cfg: Config, target, path: str | Path, engine_choice: str = "auto") -> list:
    """synth.prompts prompts synthesised into (or reused from) `path`, said on stdout, as
    Conversations to answer (`generate`'s prompt-synthesis mode and the `synth` data source)."""
    stats = synthesize_prompts(cfg, target, path, engine_choice)
    print(
        f"synth: {stats['kept']} prompts -> {path}"
        + (
            " (reused)"
            if stats["reused"]
            else f" from {stats['candidates']} sampled turns "
            f"in {stats['seconds']:.1f} s on {stats['engine']}; rejected {stats['rejected']}"
        ),
        flush=True,
    )
    return as_prompts(path)
