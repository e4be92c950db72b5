"""Speculative decoding evaluation: spec vs AR runs over prompt sets, and the `eval` command's sets.

The loop itself is decode/loop.py (one loop for greedy, sampled and speculative decoding);
`spec_generate` / `ar_generate` are its one-prompt form over a bare HF model, kept for the
callers written against them. Per-cycle host syncs are inherent in speculative decoding (the
accepted length decides control flow). This module is eval-only; it never runs inside a training
step: periodic evaluation (run/evaluation.py) calls `evaluate` between steps.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_trainer.data import embedded  # module: tests patch embedded_prompts
from dflash_trainer.data.chat import Rendering
from dflash_trainer.data.prepare import prompt_hash
from dflash_trainer.data.sources import BadRecord, parse_record
from dflash_trainer.decode.draft import Drafter
from dflash_trainer.decode.loop import GenResult, decode
from dflash_trainer.decode.sampler import Sampler
from dflash_trainer.errors import UserError
from dflash_trainer.eval.dtype import drafter_in, dtype_label, model_dtype, target_in
from dflash_trainer.eval.metrics import EvalSummary, summarize
from dflash_trainer.models.export import load_drafter
from dflash_trainer.models.packed_linear import packed_linears
from dflash_trainer.models.target import TargetModel
from dflash_trainer.observe.progress import showing_progress

log = logging.getLogger(__name__)

__all__ = ["Drafter", "GenResult", "ar_generate", "evaluate", "spec_generate"]


def _draw_seed(generator: torch.Generator | None) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


def spec_generate(
    target_model: nn.Module,
    layer_ids: Sequence[int],
    embed_weight: torch.Tensor,
    lm_head: nn.Module,
    drafter: Drafter | None,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    verify: str = "full",
) -> GenResult:
    """decode/loop.decode on one prompt input_ids [1, P] of a bare HF model: draft-verify cycles
    of block_size (1: plain autoregressive decoding, drafter may be None). `embed_weight` and
    `lm_head` are what the drafter embeds and proposes with. `generator` draws the sampling seed
    (temperature > 0 only); equal generator states give equal samples for spec and AR runs."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [1, P] with P >= 1, got {tuple(input_ids.shape)}")
    sampler = Sampler(temperature, top_p)
    seed = _draw_seed(generator) if temperature > 0 else 0
    # AR decoding taps nothing; the TargetModel still needs one valid tap layer
    target = TargetModel.from_hf(target_model, None, list(layer_ids) or [0])
    target.embed_weight, target.lm_head = embed_weight, lm_head
    try:
        return decode(
            target,
            input_ids.tolist(),
            max_new_tokens,
            sampler,
            seeds=[seed],
            stop_ids=stop_ids,
            drafter=drafter,
            block_size=block_size,
            verify=verify,
        )[0]
    finally:
        target.close()  # its hooks off the caller's model


def ar_generate(
    target_model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> GenResult:
    """Plain autoregressive decoding: `spec_generate` with block_size=1 and no drafter."""
    return spec_generate(
        target_model,
        [],
        target_model.get_input_embeddings().weight,
        target_model.get_output_embeddings(),
        None,
        input_ids,
        max_new_tokens,
        1,
        temperature,
        top_p,
        stop_ids,
        generator,
    )


# --------------------------------------------------------------------------------------------
# Evaluation over prompt sets
# --------------------------------------------------------------------------------------------


def _as_prompt(ids: Any, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long, device=device)
    return t.view(1, -1)


def _target_device(target: Any) -> torch.device:
    return next(target.model.parameters()).device


@contextmanager
def _eval_mode(*modules: Any):
    """Put modules in eval mode, then restore their modes (the trainer's drafter is training)."""
    mods = [m for m in modules if isinstance(m, nn.Module)]
    was = [m.training for m in mods]
    try:
        for m in mods:
            m.eval()
        yield
    finally:
        for m, w in zip(mods, was):
            m.train(w)


def _unwrap(drafter: Any) -> Any:
    return getattr(drafter, "module", drafter)  # DDP / FSDP wrappers keep the model in .module


def evaluate(
    target: Any,
    drafter: Drafter | None,
    prompts: Sequence[Any],
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] | None = None,
    seed: int = 0,
    baseline: bool = True,
    warmup: bool = True,
    generate_fn: Callable[..., GenResult] = spec_generate,
    progress: bool = True,
    verify: str = "full",
    packed: bool = True,
) -> EvalSummary:
    """Run spec decoding (and the AR baseline) over prompts (token id lists or [1,P] tensors).

    `target` is a TargetModel. The spec and AR run of a prompt share a seed, so in
    sampling mode they also produce comparable (identical, when lossless) outputs.
    `progress`: a bar over prompts (observe/progress.py; drawn only when stderr is a terminal).
    `verify`: the drafter runs' verify policy (spec_generate; "full" = the published loop).
    `packed`: float32 CPU linear layers of target and drafter run oneDNN's prepacked GEMM
    (models/packed_linear.py; target.packed_linear), for the spec and the AR runs alike.
    """
    drafter = _unwrap(drafter)
    how = {} if verify == "full" else {"verify": verify}  # custom generate_fns need not know it
    device = _target_device(target)
    stop = list(target.eos_token_ids if stop_ids is None else stop_ids)
    args = (target.model, target.layer_ids, target.embed_weight, target.lm_head)
    spec, ar = [], []
    with (
        _eval_mode(target.model, drafter),
        packed_linears(target.model, target.lm_head, drafter, enabled=packed),
        showing_progress(len(prompts), desc="eval", unit="prompt", enabled=progress) as bar,
    ):
        if warmup and prompts:  # first calls pay one-off costs (allocator, kernels); keep them out
            w = _as_prompt(prompts[0], device)
            generate_fn(
                *args,
                drafter,
                w,
                min(8, max_new_tokens),
                block_size,
                temperature,
                top_p,
                stop,
                torch.Generator().manual_seed(seed),
                **how,
            )
            if baseline:
                generate_fn(
                    *args,
                    None,
                    w,
                    min(8, max_new_tokens),
                    1,
                    temperature,
                    top_p,
                    stop,
                    torch.Generator().manual_seed(seed),
                )
        for i, p in enumerate(prompts):
            ids = _as_prompt(p, device)
            spec.append(
                generate_fn(
                    *args,
                    drafter,
                    ids,
                    max_new_tokens,
                    block_size,
                    temperature,
                    top_p,
                    stop,
                    torch.Generator().manual_seed(seed + i),
                    **how,
                )
            )
            if baseline:
                ar.append(
                    generate_fn(
                        *args,
                        None,
                        ids,
                        max_new_tokens,
                        1,
                        temperature,
                        top_p,
                        stop,
                        torch.Generator().manual_seed(seed + i),
                    )
                )
            bar.update(1)
        s = summarize(spec, ar or None, block_size)
        s.decode_dtype = dtype_label(model_dtype(target.model))
        for p, a, b in zip(prompts, spec, ar):
            if a.tokens != b.tokens:
                s.tie_gaps.append(divergence_gap(target.model, _as_prompt(p, device), a, b))
    return s


@torch.no_grad()
def divergence_gap(model: nn.Module, prompt: torch.Tensor, a: GenResult, b: GenResult) -> float:
    """|logit(a's token) - logit(b's token)| at the first position where the two generations of
    `prompt` differ, from one plain forward over the common prefix: small for a near-tie that
    reduced-precision rounding flipped, large for a real divergence."""
    j = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
    if j is None:  # one is a prefix of the other: it stopped where the other went on
        j = min(len(a.tokens), len(b.tokens))
        if j >= max(len(a.tokens), len(b.tokens)):
            return 0.0
    ids = torch.cat(
        [prompt, torch.tensor([a.tokens[:j]], dtype=torch.long, device=prompt.device)], 1
    )
    logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
    x = a.tokens[j] if j < len(a.tokens) else None
    y = b.tokens[j] if j < len(b.tokens) else None
    if x is None or y is None:  # one ended on the token limit: no second choice to compare
        return 0.0
    return float((logits[x] - logits[y]).abs())


# --------------------------------------------------------------------------------------------
# Prompt sets and the `eval` command
# --------------------------------------------------------------------------------------------


def load_prompt_file(path: str | Path, data_format: str = "chat") -> list[tuple[str, list[dict]]]:
    """A JSONL file of prompts, one record per line in any shape data/sources.py reads for
    `data_format` (chat: OpenAI `messages`, content-part lists included, or ShareGPT
    `conversations`; text: `prompt`, the raw text a base model continues)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"eval prompt file '{p}' does not exist; eval.datasets takes "
            "'mt-bench', 'humaneval', 'heldout' or a JSONL path."
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


def heldout_file(cfg: Any) -> Path:
    return Path(cfg.eval.heldout_path or Path(cfg.run_dir) / "heldout.jsonl")


def load_prompt_set(name: str, cfg: Any) -> list[tuple[str, list[dict]]]:
    """(id, messages) pairs for one entry of eval.datasets."""
    if name in ("mt-bench", "humaneval"):
        prefix = {"mt-bench": "mtbench-", "humaneval": "humaneval-"}[name]
        convs = [c for c in embedded.embedded_prompts() if c.id.startswith(prefix)]
        if not convs:
            raise UserError(f"no embedded prompts found for eval dataset '{name}'.")
        return [(c.id, c.messages) for c in convs]
    if name == "heldout":
        path = heldout_file(cfg)
        if not path.is_file():
            raise UserError(
                f"eval.datasets=heldout: no held-out prompts at '{path}'. Training writes them "
                "(RUN_DIR/heldout.jsonl, the prompts it never trained on): pass the run's "
                "--run_dir, or set --eval.heldout_path to a JSONL of {id, messages}. "
                "mt-bench/humaneval are not held out from the embedded training data."
            )
        return load_prompt_file(path, cfg.data.format)
    return load_prompt_file(name, cfg.data.format)


def training_ids(cfg: Any) -> tuple[set, set] | None:
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
    seen, rest = [], []
    for cid, msgs in convs:
        (seen if cid in ids or prompt_hash(msgs) in hashes else rest).append((cid, msgs))
    return seen, rest


def run_conversations(
    target: Any,
    drafter: Drafter,
    convs: Sequence[tuple[str, list[dict]]],
    max_new_tokens: int,
    block_size: int,
    temperature: float,
    top_p: float,
    rendering: Rendering,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    desc: str = "eval",
    verify: str = "full",
    packed: bool = True,
) -> EvalSummary:
    """Answer every user turn of each conversation in order (multi-turn, like the z-lab benchmark):
    each turn is one response; the history carries the spec-decoded answers, not the file's own.
    Prompts are rendered as in training (`rendering`: Rendering.from_config(cfg)); a raw-text
    prompt (data.format=text) is one user turn, continued once.

    dtype: decode in this dtype (eval.dtype resolved, eval/dtype.py: eval_dtype), on cast copies
    of target and drafter where they differ; None = as given. `progress`: a bar named `desc`
    over conversations (drawn only when stderr is a terminal)."""
    if dtype is not None:
        target, drafter = target_in(target, dtype), drafter_in(drafter, dtype)
    tok = target.tokenizer
    spec, ar, gaps, prompts = [], [], [], []
    with (
        # packed once for all turns: the per-prompt evaluate calls inside find them packed
        packed_linears(target.model, target.lm_head, _unwrap(drafter), enabled=packed),
        showing_progress(len(convs), desc=desc, unit="conversation", enabled=progress) as bar,
    ):
        for ci, (_cid, msgs) in enumerate(convs):
            history: list[dict] = []
            for m in msgs:
                if m["role"] == "assistant":
                    continue  # regenerated below
                history.append(m)
                if m["role"] != "user":
                    continue
                ids = rendering.prompt_ids(tok, history)
                prompts.append(list(ids))
                s = evaluate(
                    target,
                    drafter,
                    [ids],
                    max_new_tokens,
                    block_size,
                    temperature,
                    top_p,
                    seed=seed + 1000 * ci + len(history),
                    warmup=not spec,
                    progress=False,  # one prompt per call: the bar counts conversations
                    verify=verify,
                    packed=packed,
                )
                spec += s.spec_results
                ar += s.ar_results
                gaps += s.tie_gaps
                text = tok.decode(s.spec_results[0].tokens, skip_special_tokens=True)
                history.append({"role": "assistant", "content": text})
            bar.update(1)
    out = summarize(spec, ar, block_size)
    out.decode_dtype = dtype_label(model_dtype(target.model))
    out.tie_gaps = gaps
    out.prompts = prompts
    return out


def load_eval_pair(cfg: Any, drafter_dir: Path, device: torch.device) -> tuple[Any, Any, int]:
    """(target, drafter, block size) for evaluating the exported drafter in `drafter_dir`,
    checked to belong together (taps, hidden size, block size)."""
    if not drafter_dir.is_dir():
        raise UserError(
            f"no exported drafter at '{drafter_dir}'; train first or pass --drafter DIR."
        )
    target = TargetModel.load(cfg.target, device)
    if cfg.target.check_taps:  # wrong features would show only as a low tau
        # the hooks decoding taps with (one capture for training and decoding)
        target.check_taps()
    drafter = load_drafter(drafter_dir, device)
    dc = drafter.config
    if list(dc.target_layer_ids) != list(target.layer_ids) or dc.hidden_size != target.hidden_size:
        raise UserError(
            f"drafter '{drafter_dir}' was trained on target layers "
            f"{list(dc.target_layer_ids)} (hidden {dc.hidden_size}), but "
            f"target.model={cfg.target.model} taps {list(target.layer_ids)} (hidden "
            f"{target.hidden_size}); use the drafter's target, or set --target.taps."
        )
    block_size = cfg.eval.block_size or dc.block_size
    if block_size > dc.block_size:
        raise UserError(
            f"eval.block_size={block_size} exceeds the drafter's trained block size "
            f"{dc.block_size}; use a value <= {dc.block_size} (0 = trained size)."
        )
    return target, drafter, block_size


def evaluate_datasets(cfg: Any, target: Any, drafter: Any, block_size: int) -> dict:
    """Speculative decoding on every `eval.datasets` entry: name -> EvalSummary.

    'heldout' is decoded whole. A named set (mt-bench, humaneval, a file) is cut to
    eval.num_prompts; where it overlaps the run's training data (train_ids.json), a warning
    gives the overlap and tau is reported separately: `NAME:trained` and `NAME:unseen`."""
    trained = training_ids(cfg)
    rendering = Rendering.from_config(cfg)
    results = {}
    for name in cfg.eval.datasets:
        convs = load_prompt_set(name, cfg)
        parts = {name: convs}
        if name != "heldout":
            convs = convs[: cfg.eval.num_prompts]
            parts = {name: convs}
            if trained is not None:
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
        for key, part in parts.items():
            if not part:
                continue
            log.info("eval: %s, %d conversations, block %d", key, len(part), block_size)
            results[key] = run_conversations(
                target,
                drafter,
                part,
                cfg.eval.max_new_tokens,
                block_size,
                cfg.eval.temperature,
                cfg.eval.top_p,
                rendering,
                seed=cfg.eval.seed,
                progress=cfg.metrics.console,
                desc=f"eval {key}",
                verify=cfg.eval.verify,
                packed=cfg.target.packed_linear,
            )
    return results
