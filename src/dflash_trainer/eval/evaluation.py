"""Speculative decoding evaluated over prompts: the drafter runs and the plain baseline of each
prompt (`evaluate`), multi-turn conversations (`run_conversations`), every `eval.datasets` entry
(`evaluate_datasets`), and the exported drafter loaded with its target (`load_eval_pair`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from dflash_trainer.config import Config, SamplingConfig
from dflash_trainer.data.chat import Rendering
from dflash_trainer.decode.draft import Drafter
from dflash_trainer.decode.loop import GenResult, decode
from dflash_trainer.errors import UserError
from dflash_trainer.eval.dtype import drafter_in, target_in
from dflash_trainer.eval.metrics import EvalSummary, summarize
from dflash_trainer.eval.prompts import load_prompt_set, split_by_training, training_ids
from dflash_trainer.models.export import load_drafter
from dflash_trainer.models.packed_linear import packed_linears
from dflash_trainer.models.target import TargetModel
from dflash_trainer.observe.progress import showing_progress
from dflash_trainer.precision import dtype_label, module_dtype

log = logging.getLogger(__name__)


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


def _sampling_seed(seed: int) -> int:
    """The sampling seed of prompt seed `seed` (drawn from a generator seeded with it)."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(seed)))


def _unwrap(drafter: Any) -> Any:
    return getattr(drafter, "module", drafter)  # DDP / FSDP wrappers keep the model in .module


def evaluate(
    target: Any,
    drafter: Drafter | None,
    prompts: Sequence[Any],
    max_new_tokens: int,
    block_size: int,
    sampling: SamplingConfig | None = None,
    stop_ids: Sequence[int] | None = None,
    seed: int = 0,
    baseline: bool = True,
    warmup: bool = True,
    progress: bool = True,
    verify: str = "full",
    packed: bool = True,
) -> EvalSummary:
    """Run spec decoding (and the AR baseline) over prompts (token id lists or [1,P] tensors).

    `target` is a TargetModel, decoded through decode/loop.py `decode` one prompt at a time. The
    spec and AR run of a prompt share a seed, so in sampling mode they also produce comparable
    (identical, when lossless) outputs.
    `progress`: a bar over prompts (observe/progress.py; drawn only when stderr is a terminal).
    `verify`: the drafter runs' verify policy ("full" = the published loop; decode).
    `packed`: float32 CPU linear layers of target and drafter run oneDNN's prepacked GEMM
    (models/packed_linear.py; target.packed_linear), for the spec and the AR runs alike.
    """
    drafter = _unwrap(drafter)
    device = _target_device(target)
    stop = list(target.eos_token_ids if stop_ids is None else stop_ids)
    sampled = sampling is not None and not sampling.greedy

    def run(ids: torch.Tensor, n: int, seed: int, spec: bool) -> GenResult:
        """One prompt decoded: with the drafter (`spec`) or plainly (block 1, no drafter)."""
        return decode(
            target,
            ids.tolist(),
            n,
            sampling,
            seeds=[_sampling_seed(seed) if sampled else 0],
            stop_ids=stop,
            drafter=drafter if spec else None,
            block_size=block_size if spec else 1,
            verify=verify if spec else "full",
        )[0]

    spec, ar = [], []
    with (
        _eval_mode(target.model, drafter),
        packed_linears(
            target.model, target.lm_head, cast(nn.Module | None, drafter), enabled=packed
        ),
        showing_progress(len(prompts), desc="eval", unit="prompt", enabled=progress) as bar,
    ):
        if warmup and prompts:  # first calls pay one-off costs (allocator, kernels); keep them out
            w = _as_prompt(prompts[0], device)
            run(w, min(8, max_new_tokens), seed, spec=True)
            if baseline:
                run(w, min(8, max_new_tokens), seed, spec=False)
        for i, p in enumerate(prompts):
            ids = _as_prompt(p, device)
            spec.append(run(ids, max_new_tokens, seed + i, spec=True))
            if baseline:
                ar.append(run(ids, max_new_tokens, seed + i, spec=False))
            bar.update(1)
        s = summarize(spec, ar or None, block_size)
        s.decode_dtype = dtype_label(module_dtype(target.model))
        s.prompts = [_as_prompt(p, device)[0].tolist() for p in prompts]
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


def run_conversations(
    target: Any,
    drafter: Drafter,
    convs: Sequence[tuple[str, list[dict]]],
    max_new_tokens: int,
    block_size: int,
    sampling: SamplingConfig | None,
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
    spec: list[GenResult] = []
    ar: list[GenResult] = []
    gaps: list[float] = []
    prompts: list = []
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
                    sampling,
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
    out.decode_dtype = dtype_label(module_dtype(target.model))
    out.tie_gaps = gaps
    out.prompts = prompts
    return out


def load_eval_pair(cfg: Config, drafter_dir: Path, device: torch.device) -> tuple[Any, Any, int]:
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


def evaluate_datasets(cfg: Config, target: Any, drafter: Any, block_size: int) -> dict:
    """Speculative decoding on every `eval.datasets` entry: name -> EvalSummary.

    'heldout' is decoded whole. A named set (mt-bench, humaneval, a file) is cut to
    eval.dataset_prompts; where it overlaps the run's training data (train_ids.json), a warning
    gives the overlap and tau is reported separately: `NAME:trained` and `NAME:unseen`."""
    trained = training_ids(cfg)
    rendering = Rendering.from_config(cfg)
    results = {}
    for name in cfg.eval.datasets:
        convs = load_prompt_set(name, cfg)
        parts = {name: convs}
        if name != "heldout":
            convs = convs[: cfg.eval.dataset_prompts]
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
                cfg.eval.sampling,
                rendering,
                seed=cfg.eval.seed,
                progress=cfg.metrics.console,
                desc=f"eval {key}",
                verify=cfg.eval.verify,
                packed=cfg.target.packed_linear,
            )
    return results
