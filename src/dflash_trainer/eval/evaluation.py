"""Speculative decoding evaluated over prompts: the drafter runs and the plain baseline of each
prompt (`evaluate`), multi-turn conversations (`run_conversations`), every `eval.datasets` entry
(`evaluate_datasets`), and the exported drafter loaded with its target (`load_eval_pair`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from dflash_trainer.config import Config, SamplingConfig
from dflash_trainer.data.chat import Rendering
from dflash_trainer.decode.draft import Drafter
from dflash_trainer.decode.loop import GenResult, decode
from dflash_trainer.errors import UserError
from dflash_trainer.eval.metrics import EvalSummary, summarize
from dflash_trainer.eval.prompts import prompt_groups
from dflash_trainer.models.export import load_drafter
from dflash_trainer.models.target import TargetModel
from dflash_trainer.observe.progress import showing_progress
from dflash_trainer.precision import dtype_label, eval_dtype, resolve_dtype

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
    stop = list(target.eos_token_ids if stop_ids is None else stop_ids)
    one = PromptDecoder(target, drafter, block_size, sampling, stop, verify)
    with _decoding(target, drafter, packed, len(prompts), "eval", "prompt", progress) as bar:
        return one.summary(prompts, max_new_tokens, seed, baseline, warmup, bar)


@contextmanager
def _decoding(
    target: Any, drafter: Any, packed: bool, total: int, desc: str, unit: str, progress: bool
):
    """Target and drafter in eval mode with prepacked linears (restored after), and a progress
    bar over `total` `unit`s named `desc`."""
    with (
        _eval_mode(target.model, drafter),
        target.decoding(cast(nn.Module | None, drafter), packed=packed),
        showing_progress(total, desc=desc, unit=unit, enabled=progress) as bar,
    ):
        yield bar


@dataclass
class PromptDecoder:
    """Prompts decoded one at a time with the drafter (spec) and plainly (block 1, no drafter,
    the baseline); the two runs of a prompt share its sampling seed."""

    target: Any
    drafter: Drafter | None
    block_size: int
    sampling: SamplingConfig | None
    stop: list[int]
    verify: str

    def run(self, ids: torch.Tensor, n: int, seed: int, spec: bool) -> GenResult:
        sampled = self.sampling is not None and not self.sampling.greedy
        return decode(
            self.target,
            ids.tolist(),
            n,
            self.sampling,
            seeds=[_sampling_seed(seed) if sampled else 0],
            stop_ids=self.stop,
            drafter=self.drafter if spec else None,
            block_size=self.block_size if spec else 1,
            verify=self.verify if spec else "full",
        )[0]

    def summary(
        self,
        prompts: Sequence[Any],
        max_new_tokens: int,
        seed: int,
        baseline: bool,
        warmup: bool,
        bar: Any = None,
    ) -> EvalSummary:
        """Each prompt decoded (prompt i with seed + i), `bar` advanced per prompt; a short
        `warmup` decode first keeps one-off costs (allocator, kernels) out of the timings."""
        device = _target_device(self.target)
        spec, ar = [], []
        if warmup and prompts:
            w = _as_prompt(prompts[0], device)
            self.run(w, min(8, max_new_tokens), seed, spec=True)
            if baseline:
                self.run(w, min(8, max_new_tokens), seed, spec=False)
        for i, p in enumerate(prompts):
            ids = _as_prompt(p, device)
            spec.append(self.run(ids, max_new_tokens, seed + i, spec=True))
            if baseline:
                ar.append(self.run(ids, max_new_tokens, seed + i, spec=False))
            if bar is not None:
                bar.update(1)
        s = summarize(spec, ar or None, self.block_size)
        s.decode_dtype = dtype_label(self.target.dtype)
        s.prompts = [_as_prompt(p, device)[0].tolist() for p in prompts]
        model = self.target.model
        for p, a, b in zip(prompts, spec, ar):
            if a.tokens != b.tokens:
                s.tie_gaps.append(divergence_gap(model, _as_prompt(p, device), a, b))
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
    progress: bool = True,
    desc: str = "eval",
    verify: str = "full",
    packed: bool = True,
) -> EvalSummary:
    """Answer every user turn of each conversation in order (multi-turn, like the z-lab benchmark):
    each turn is one response; the history carries the spec-decoded answers, not the file's own.
    Prompts are rendered as in training (`rendering`: Rendering.from_config(cfg)); a raw-text
    prompt (data.format=text) is one user turn, continued once.

    Target and drafter decode as given (load_eval_pair loads them in eval.dtype). `progress`: a
    bar named `desc` over conversations (drawn only when stderr is a terminal)."""
    tok = target.tokenizer
    drafter = _unwrap(drafter)
    one = PromptDecoder(target, drafter, block_size, sampling, list(target.eos_token_ids), verify)
    spec: list[GenResult] = []
    ar: list[GenResult] = []
    gaps: list[float] = []
    prompts: list = []
    with _decoding(target, drafter, packed, len(convs), desc, "conversation", progress) as bar:
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
                turn_seed = seed + 1000 * ci + len(history)
                s = one.summary([ids], max_new_tokens, turn_seed, baseline=True, warmup=not spec)
                spec += s.spec_results
                ar += s.ar_results
                gaps += s.tie_gaps
                text = tok.decode(s.spec_results[0].tokens, skip_special_tokens=True)
                history.append({"role": "assistant", "content": text})
            bar.update(1)
    out = summarize(spec, ar, block_size)
    out.decode_dtype = dtype_label(target.dtype)
    out.tie_gaps = gaps
    out.prompts = prompts
    return out


def load_eval_pair(cfg: Config, drafter_dir: Path, device: torch.device) -> tuple[Any, Any, int]:
    """(target, drafter, block size) for evaluating the exported drafter in `drafter_dir`,
    checked to belong together (taps, hidden size, block size), both loaded in eval.dtype
    (precision.eval_dtype)."""
    if not drafter_dir.is_dir():
        raise UserError(
            f"no exported drafter at '{drafter_dir}'; train first or pass --drafter DIR."
        )
    # loaded in the dtype it decodes in: no cast copy of the whole model, and the weights a
    # server loads from the same directory in that dtype
    dtype = eval_dtype(cfg.eval.dtype, device, resolve_dtype(cfg.target.dtype, device))
    target = TargetModel.load(cfg.target, device, dtype)
    if cfg.target.check_taps:  # wrong features would show only as a low tau
        # the hooks decoding taps with (one capture for training and decoding)
        target.check_taps()
    drafter = load_drafter(drafter_dir, device, dtype)
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
    """Speculative decoding on every group of `eval.datasets` prompts (eval/prompts.py
    prompt_groups): group name -> EvalSummary."""
    groups = prompt_groups(cfg)
    rendering = Rendering.from_config(cfg)
    results = {}
    for key, part in groups.items():
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
