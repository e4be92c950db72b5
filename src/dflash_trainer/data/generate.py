"""Regenerate assistant responses with the target (dflash-method.md §2.6: train on the
target's own outputs).

Output is JSONL in the data format's record shape, one record per prompt:
    chat  {"id", "messages": [...prompt..., {"role": "assistant", "content"}], "provenance": {...}}
    text  {"id", "prompt", "completion", "provenance": {...}}   (a base model continues raw text)

Resumable and crash-safe: each batch is appended as whole lines, then flushed and fsync'ed. On
start the file is read back; a torn last line (a crash mid-write) is truncated away, and prompts
whose id is already present are skipped. So a rerun after a kill never duplicates or loses a record.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from dflash_trainer.config import Config, SamplingConfig, engine_args
from dflash_trainer.data import embedded  # module: tests patch embedded_prompts
from dflash_trainer.data.chat import Rendering, prompt_messages, render_text
from dflash_trainer.data.sources import load_sources
from dflash_trainer.decode.loop import decode
from dflash_trainer.decode.sampler import hash32_int
from dflash_trainer.errors import UserError
from dflash_trainer.files import cache_root
from dflash_trainer.models.target import TargetModel
from dflash_trainer.models.vllm_engine import VLLMEngine, engine_for_config
from dflash_trainer.observe.progress import showing_progress
from dflash_trainer.precision import dtype_label, dtype_name

log = logging.getLogger(__name__)

# Settings a resumed file must share; format / chat_template only where they differ from the
# default rendering (Rendering.identity), so files from before them still resume.
_PROVENANCE_KEYS = (
    "target",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "thinking",
    "format",
    "chat_template",
    "sampler",
)
# The sampler a sampled file's answers come from, in its provenance (absent when greedy: greedy
# answers do not depend on it). Files sampled before the position-keyed sampler (decode/sampler.py)
# have no such key, so a resume refuses to mix them with new samples.
SAMPLER = "position-keyed-v1"


# ------------------------------------------------------------------------------------ resumable IO


def read_done_ids(out_path: str | Path, expect: dict | None = None) -> set[str]:
    """Ids already in `out_path`; truncates a torn last line. `expect`: provenance to match."""
    path = Path(out_path)
    if not path.exists():
        return set()
    with path.open("rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning(
                "%s: dropping a torn last line (%d bytes) left by an interrupted run",
                path,
                len(data) - end,
            )
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    done: set[str] = set()
    for lineno, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            rid = rec["id"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(
                f"{path}:{lineno}: not a generate record (bad JSON or no 'id'). Delete "
                "that line, or choose another generate.out."
            ) from None
        if expect is not None:
            prov = rec.get("provenance", {})
            diff = [
                k
                for k in _PROVENANCE_KEYS
                if (k in expect or k in prov) and prov.get(k) != expect.get(k)
            ]
            if diff:
                raise UserError(
                    f"{path}:{lineno}: made with different settings ("
                    + ", ".join(f"{k}={prov.get(k)!r}, now {expect.get(k)!r}" for k in diff)
                    + "). Resuming would mix them: choose another generate.out or delete the file."
                )
        done.add(str(rid))
    return done


def _append_records(path: Path, records: list[dict]) -> None:
    """One write of whole lines, then flush + fsync: at worst the last line is torn."""
    blob = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    with path.open("a", encoding="utf-8") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------- prompt shaping


def answer_record(rendering: Rendering, pid: str, prompt: list[dict], answer: str, prov: dict):
    """The record of one answered prompt, in the shape data/sources.py reads back in the same
    data format."""
    if rendering.format == "text":
        return {
            "id": pid,
            "prompt": render_text(prompt)[0],
            "completion": answer,
            "provenance": prov,
        }
    return {
        "id": pid,
        "messages": prompt + [{"role": "assistant", "content": answer}],
        "provenance": prov,
    }


# -------------------------------------------------------------------------------------- generation


def _todo(prompts, done: set, tokenizer, rendering: Rendering) -> list[tuple]:
    """(id, prompt messages, prompt ids) of the prompts not done yet, shortest first (a batch
    then wastes little padding)."""
    todo, seen = [], set(done)
    for p in prompts:
        if p.id in seen:
            continue
        seen.add(p.id)
        msgs = prompt_messages(p.messages)
        if not msgs:
            log.warning(
                "prompt %s has no prompt before its response (no user turn before the first "
                "assistant turn; a raw-text document); skipped",
                p.id,
            )
            continue
        todo.append((p.id, msgs, rendering.prompt_ids(tokenizer, msgs)))
    todo.sort(key=lambda t: len(t[2]))
    return todo


def decode_batch(
    target: TargetModel,
    rows: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig | None,
    seeds: list[int],
    pad_id: int,
    stop_ids: list[int] | None = None,
    capture: Any = None,
) -> list[tuple[list[int], bool]]:
    """(new tokens, ended on a stop id) per prompt row, from the decode loop (decode/loop.py:
    one left-padded prefill, then one forward per step for the rows still running). The stop
    id itself is not in the returned tokens; `stop_ids`: default the target's eos ids.
    `capture`: a pipeline.feature_cache.CapturedFeatures that keeps each row's taps of prompt
    + new tokens (stop id included), keyed by those ids."""
    out = decode(
        target, rows, max_new_tokens, sampling, seeds=seeds, stop_ids=stop_ids, pad_id=pad_id,
        keep_features=capture is not None,
    )  # fmt: skip
    if capture is not None:
        for row, r in zip(rows, out):
            capture.add(list(row) + r.tokens, r.features)
    return [(r.tokens[:-1] if r.stopped else r.tokens, r.stopped) for r in out]


def in_shard(pid: str, shard: int, shards: int) -> bool:
    """Is prompt `pid` in shard `shard` of `shards` (generate.shard)? A function of the id
    alone, so every process of a sharded job agrees without talking to the others."""
    return zlib.crc32(pid.encode()) % shards == shard


def row_seed(seed: int, pid: str) -> int:
    """A prompt's sampling seed: a function of the run's seed and the prompt id only, so a
    sampled answer does not depend on the batch it ran in (resumed runs are reproducible)."""
    return hash32_int(seed ^ zlib.crc32(pid.encode()))


def _generate_batch(
    target, chunk, max_new_tokens, sampling, pad_id, seed, provenance, rendering, capture=None
) -> tuple:
    """Records for one batch of prompts, and the new tokens they hold (`capture`: decode_batch)."""
    tok = target.tokenizer
    decoded = decode_batch(
        target,
        [t[2] for t in chunk],
        max_new_tokens,
        sampling,
        [row_seed(seed, t[0]) for t in chunk],
        pad_id,
        capture=capture,
    )
    records, new_tokens = [], 0
    for (pid, msgs, _), (row, stopped) in zip(chunk, decoded):
        text = tok.decode(row, skip_special_tokens=True)
        prov = {**provenance, "finish_reason": "stop" if stopped else "length"}
        records.append(answer_record(rendering, pid, msgs, text, prov))
        new_tokens += len(row) + int(stopped)
    return records, new_tokens


def _generate_vllm(
    vllm, target, todo, max_new_tokens, sampling, seed, provenance, rendering, path, stats, bar,
    chunk: int,
):  # fmt: skip
    """Every prompt of `todo` through one vLLM engine, generated in chunks of `chunk` prompts;
    each chunk's records are appended to `path` as it lands (a kill
    loses at most one chunk), counted into `stats` (new tokens: the stop token counted, as in the
    loop's path)."""
    if vllm is None:
        raise UserError("generate: engine vllm needs a vLLM engine (models/vllm_engine.py).")
    stop = [int(s) for s in target.eos_token_ids]
    tok = target.tokenizer
    made_by = {
        "engine": "vllm",
        "dtype": vllm.dtype,
        "sampling": {
            **sampling.record(),
            "max_tokens": max_new_tokens,
            "seed": seed,
            "stop_token_ids": stop,
        },
    }
    t0 = time.perf_counter()

    def write(results: list[tuple[int, dict]]) -> None:
        records, new_tokens = [], 0
        for i, r in results:
            pid, msgs, _ = todo[i]
            row = [int(t) for t in r["tokens"]]
            stopped = bool(row) and row[-1] in stop
            text = tok.decode(row[:-1] if stopped else row, skip_special_tokens=True)
            made = {"vllm_version": r.get("vllm_version"), **made_by}
            fin = {"finish_reason": "stop" if stopped else "length"}
            records.append(answer_record(rendering, pid, msgs, text, {**provenance, **made, **fin}))
            new_tokens += len(row)
        _append_records(path, records)
        _count_batch(stats, len(records), new_tokens, t0)
        bar.update(len(records))
        bar.set_postfix(tok_s=f"{stats['new_tokens'] / max(stats['seconds'], 1e-9):.0f}")

    res = vllm.generate(
        [t[2] for t in todo],
        max_new_tokens,
        write,
        chunk=chunk,
        stop_ids=stop,
        sampling=sampling,
        seed=seed,
    )
    log.info(
        "generate: vLLM %s, engine start %.0f s, %d prompts in chunks of %d",
        res.get("vllm_version"),
        res.get("startup_s", 0.0),
        len(todo),
        chunk,
    )


def generate_responses(
    target,
    prompts,
    out_path: str | Path,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    sampling: SamplingConfig | None = None,
    rendering: Rendering | None = None,
    seed: int = 0,
    progress: bool = True,
    engine: str = "project",
    vllm: Any = None,
    extra_provenance: dict | None = None,
    capture: Any = None,
    chunk_prompts: int = 512,
    packed: bool = True,
) -> dict:
    """Append one record per not-yet-done prompt to `out_path`. Returns counts and tokens/s.

    `prompts`: objects with `.id` and `.messages` (data.sources.Conversation). `rendering`:
    how prompts become ids and answers records (`Rendering.from_config(cfg)`; None =
    `Rendering()`, chat). `sampling`: how tokens are chosen (None = greedy).
    Batches are left padded; prompts are sorted by length so a batch wastes little padding.
    `progress`: a bar over prompts (observe/progress.py; drawn only when stderr is a terminal).
    `engine`: "project" = the project's decode loop (decode/loop.py), batched; "vllm" = vLLM's
    offline engine (`vllm`: a models/vllm_engine.VLLMEngine serving this target), one engine for all
    prompts, its records appended every `chunk_prompts` prompts (a kill loses at most one chunk),
    its sampling parameters in each record's provenance.
    Every record's provenance names the engine, the seed and the target's dtype (a sampled
    answer is reproducible from them), plus `extra_provenance` (e.g. the target revision).
    `capture` (engine project): a pipeline.feature_cache.CapturedFeatures kept for training's first
    epoch (decode_batch). `packed` (engine project): a float32 CPU target's linear layers run
    oneDNN's prepacked GEMM (models/packed_linear.py; target.packed_linear), packed once here.
    """
    rendering = rendering or Rendering()
    if max_new_tokens < 1 or batch_size < 1:
        raise UserError("generate: generate.max_new_tokens and generate.batch_size must be >= 1.")
    sampling = sampling or SamplingConfig()
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = {"max_new_tokens": max_new_tokens, **sampling.record()}
    provenance = _provenance(target, settings, rendering, engine, seed, extra_provenance)
    done = read_done_ids(path, expect=provenance)
    todo = _todo(prompts, done, target.tokenizer, rendering)
    stats: dict[str, Any] = dict(skipped_done=len(done), written=0, new_tokens=0, seconds=0.0)
    stats.update(tokens_per_s=0.0, output=str(path))
    if not todo:
        return stats

    tok = target.tokenizer
    eos = list(target.eos_token_ids)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    t0 = time.perf_counter()
    if engine not in ("project", "vllm"):
        raise UserError(f"generate: engine '{engine}' is not one of project, vllm.")
    with showing_progress(
        len(todo) + len(done), initial=len(done), desc="generate", unit="prompt", enabled=progress
    ) as bar:
        if engine == "vllm":
            how = (max_new_tokens, sampling, seed, provenance, rendering, path, stats, bar)
            _generate_vllm(vllm, target, todo, *how, chunk_prompts)
            return _timed(stats, t0)
        with target.decoding(packed=packed):
            for b in range(0, len(todo), batch_size):
                chunk = todo[b : b + batch_size]
                records, new_tokens = _generate_batch(
                    target, chunk, max_new_tokens, sampling, pad_id, seed, provenance, rendering,
                    capture,
                )  # fmt: skip
                _append_records(path, records)
                _count_batch(stats, len(records), new_tokens, t0)
                bar.update(len(chunk))
                bar.set_postfix(tok_s=f"{stats['new_tokens'] / max(stats['seconds'], 1e-9):.0f}")
    return _timed(stats, t0)


def _count_batch(stats: dict, written: int, new_tokens: int, t0: float) -> None:
    """A written batch's records and new tokens into generate's running counts."""
    stats["written"] += written
    stats["new_tokens"] += new_tokens
    stats["seconds"] = time.perf_counter() - t0


def _provenance(
    target, settings: dict, rendering: Rendering, engine: str, seed: int, extra: dict | None
) -> dict:
    """What every answer record says made it (and a resumed file must match where it counts)."""
    return {
        "target": target.name,
        **settings,  # max_new_tokens, temperature, top_p (and top_k where set)
        "thinking": rendering.enable_thinking,
        **rendering.identity(),
        # not settings a resumed file must share (_PROVENANCE_KEYS): files from before them resume
        "engine": engine,
        "seed": seed,
        "dtype": dtype_label(target.dtype),
        **(extra or {}),
        # sampled answers come from one engine's sampler: a resume never mixes two streams
        **(
            {"sampler": SAMPLER if engine == "project" else engine}
            if settings["temperature"] > 0
            else {}
        ),
    }


def _timed(stats: dict, t0: float) -> dict:
    """`stats` with the seconds since `t0` and the new tokens per second."""
    stats["seconds"] = time.perf_counter() - t0
    stats["tokens_per_s"] = stats["new_tokens"] / max(stats["seconds"], 1e-9)
    return stats


# ------------------------------------------------------------------------------------------ entries


def load_prompts(spec: str, cfg: Config) -> list:
    """Prompts to answer: 'embedded' (MT-Bench + HumanEval) or a file of data.format records,
    read by data/sources.py like any training source (records without a response too)."""
    if spec == "embedded":
        return embedded.embedded_prompts()
    convs, _ = load_sources(
        [spec],
        cfg.data.on_bad_record,
        cfg.data.roots,
        data_format=cfg.data.format,
        prompts_only=True,
    )
    return convs


def print_summary(stats: dict) -> None:
    print(
        f"generate: {stats['written']} new records ({stats['skipped_done']} already done) -> "
        f"{stats['output']}; {stats['new_tokens']} tokens in {stats['seconds']:.1f} s = "
        f"{stats['tokens_per_s']:.1f} tokens/s",
        flush=True,
    )


def embedded_responses_path(cfg: Config) -> Path:
    """Cache path of the embedded data set for this target and these generation settings."""

    key = {
        "target": cfg.target.model,
        # only when set, so the caches made before target.revision existed stay valid
        **({"revision": cfg.target.revision} if cfg.target.revision else {}),
        # the dtype the answers are computed in ('auto' differs between machines)
        "dtype": dtype_name(cfg.target.dtype, cfg.pipeline.target_devices[0]),
        "thinking": cfg.target.enable_thinking,
        "seed": cfg.seed,
        **gen_settings(cfg),
        **Rendering.from_config(cfg).identity(),
    }
    return cache_root(cfg.target.cache_dir) / "responses" / f"{settings_digest(key)}.jsonl"


def settings_digest(key: dict) -> str:
    """A cache file's name: the digest of every setting that made its contents."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def ensure_embedded_responses(cfg: Config, target=None, capture=None) -> Path:
    """MT-Bench + HumanEval prompts answered by the target, cached (and resumed) by settings.

    Returns the JSONL path. The target is loaded only when some responses are missing; pass an
    already-loaded `target` to reuse it (and `capture`: generate_with).
    """
    path = embedded_responses_path(cfg)
    prompts = embedded.embedded_prompts()
    if {p.id for p in prompts} <= read_done_ids(path):
        return path
    if target is None:
        target = TargetModel.load(cfg.target, cfg.pipeline.target_devices[0])
    print(
        f"dflash-trainer: regenerating the embedded data set with {cfg.target.model} into "
        f"{path} (one time; resumable)",
        file=sys.stderr,
        flush=True,
    )
    # The demo's data: vLLM where it is installed and pays (choose_engine), else the loop here.
    stats = generate_with(cfg, target, prompts, path, capture)
    print_summary(stats)
    return path


# generate.engine=auto picks vLLM where it is installed and the job is large enough to pay for its
# engine start (~20-55 s on 2 cores). Measured on the embedded data set (244 prompts x 192
# tokens, bf16, 2 busy cores): vLLM's CPU build 222.7 tokens/s including the start, the project's
# batched loop (batch 64) 35.9 tokens/s; on 6 prompts x 24 tokens the loop won (6.1 vs 2.7).
# Break-even near 1,200 generated tokens: below this budget (prompts x max_new_tokens) auto
# stays with the loop. In float32 auto keeps the loop too: there it hands the taps it computes
# while writing to the first epoch (pipeline.capture_features, 1.46x that epoch's tokens/s), which
# vLLM cannot, and on prepacked linears it writes the demo's answers at 222.7 tokens/s (AVX2
# simulated on a Zen 4 EPYC) where vLLM's fp32 CPU build ran 295.1 natively (bench/RESULTS.md).
AUTO_VLLM_MIN_BUDGET = 2048


def choose_engine(cfg: Config, choice: str, budget: int) -> tuple[str, VLLMEngine | None]:
    """("project" | "vllm", the vLLM engine). auto = vLLM where it is installed, the target is not
    decoded in float32 and `budget` (prompts x max_new_tokens) >= AUTO_VLLM_MIN_BUDGET, else the
    project's loop."""
    dtype = dtype_name(cfg.target.dtype, cfg.pipeline.target_devices[0])
    if choice == "project" or (
        choice == "auto" and (budget < AUTO_VLLM_MIN_BUDGET or dtype == "float32")
    ):
        return "project", None
    needed = "generate --generate.engine=vllm" if choice == "vllm" else ""
    eng, why = engine_for_config(cfg, dtype, required=needed)
    if eng is None:
        log.info("generate: vLLM not available (%s); the project's decode loop", why)
        return "project", None
    eng.engine_args = engine_args(cfg.generate.vllm_args)
    log.info("generate: vLLM (%s) serving %s in %s", eng.python, eng.target, dtype)
    return "vllm", eng


def gen_settings(cfg: Config) -> dict:
    """The [generate] settings that decide the answers (the embedded data set's cache key)."""
    g = cfg.generate
    return {"max_new_tokens": g.max_new_tokens, "batch_size": g.batch_size, **g.sampling.record()}


def generate_with(cfg: Config, target, prompts, out, capture=None) -> dict:
    """generate_responses with cfg's [generate] settings, on the engine that
    generate.engine (project | vllm | auto: choose_engine) picks for this job; under auto, a target
    vLLM cannot serve falls back to the project's loop (vLLM wrote nothing). `capture`: the
    loop's taps kept for training (generate_responses; vLLM keeps none)."""
    choice = cfg.generate.engine
    revision = {"target_revision": cfg.target.revision} if cfg.target.revision else {}
    how = dict(
        max_new_tokens=cfg.generate.max_new_tokens,
        batch_size=cfg.generate.batch_size,
        sampling=cfg.generate.sampling,
        extra_provenance=revision,
        rendering=Rendering.from_config(cfg),
        seed=cfg.seed,
        progress=cfg.metrics.console,
        capture=capture,
        chunk_prompts=cfg.generate.chunk_prompts,
        packed=cfg.target.packed_linear,
    )
    engine, vllm = choose_engine(cfg, choice, len(prompts) * cfg.generate.max_new_tokens)
    try:
        return generate_responses(target, prompts, out, engine=engine, vllm=vllm, **how)
    except UserError as e:
        if choice != "auto" or engine != "vllm":
            raise
        log.warning("generate: vLLM failed, using the project's decode loop instead: %s", e)
        return generate_responses(target, prompts, out, **how)
