"""Where a drafter starts: from the target (`drafter.init = target`) or from a published
drafter (`drafter.init_from = DIR`, fine-tuning).

The drafter has the target's hidden size and by default (shape fields 0) its head layout
and MLP width. So:
  - drafter layer i starts as a copy of target layer s + i (attention and MLP weights and both
    layer norms; q_norm/k_norm too where the target has them, e.g. Qwen3; a Llama target has
    none and they stay at 1). By default s = L - n: the target's last n layers, fed by the
    deepest tap. With `drafter.init_tap = t`, s = layer_ids[t] + 1: the layers right after
    tapped layer t, fed by that tap (shallower layers, closer to token-level work such as
    copying from the context);
  - `norm` starts as the target's final norm (the drafter's output feeds the target's LM head);
  - `fc` starts by passing the chosen tapped feature through (identity on its slice, zero
    elsewhere) and `hidden_norm` as the input norm of the first copied layer, so the fused
    context starts as what that layer would have read at those positions.
Tensors are paired by what they compute (models/layer_map.py: offset norms become plain
weights, fused projections are split), and every copied layer is then run beside its target
layer on the same input: a family whose layers the drafter's Qwen3-style layer cannot compute
(Gemma 3's sandwich norms and GeLU, a mixture-of-experts MLP, Qwen2's attention biases) is
refused with what differs, before any training. docs/guides/families.md has the table.
The architecture and export format are the published ones: only the starting values differ.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from dflash_trainer.config import DrafterConfig
from dflash_trainer.errors import UserError
from dflash_trainer.models import variants
from dflash_trainer.models.drafter import DFlashDrafter, convert_variant
from dflash_trainer.models.export import load_drafter
from dflash_trainer.models.layer_map import (
    LAYER_TOL,
    Unmappable,
    differences,
    has_qk_norm,
    layer_error,
    norm_scale,
    source_tensors,
)
from dflash_trainer.models.target_layout import (
    first_source_layer,
    layer_type,
    rope_theta,
    target_shapes,
    text_config,
)

log = logging.getLogger(__name__)

__all__ = ["first_source_layer", "init_from_target", "warm_start"]


def _family(target) -> str:
    return type(target.model).__name__


def _shape_hint(tcfg) -> str:
    flags = " ".join(f"--drafter.{k}={v}" for k, v in target_shapes(tcfg).items())
    return f"pass the target's: {flags} (or leave them at 0, the target's), or drafter.init=random"


def target_init_pairs(drafter: DFlashDrafter, target, start: int):
    """Every (drafter tensor, source value, drafter tensor name) the target init sets, checked:
    Unmappable names a layer part with no counterpart (models/layer_map.py), ValueError a
    shape that differs (with the values to pass). Drafter layer i copies target layer
    start + i."""
    tcfg = target.model.config
    H = drafter.config.hidden_size
    pairs = []
    for i in range(len(drafter.layers)):
        src = start + i
        try:
            sources = source_tensors(target.layers[src], tcfg, H)
        except Unmappable as e:
            raise Unmappable(f"{_family(target)} layer {src}: {e}") from None
        d_params = dict(drafter.layers[i].named_parameters())
        for rel, s in sources.items():
            dst, name = d_params[rel], f"layers.{i}.{rel}"
            if tuple(dst.shape) != tuple(s.shape):
                raise ValueError(
                    f"{name} has shape {tuple(dst.shape)}, target layer {src}'s is "
                    f"{tuple(s.shape)}: {_shape_hint(tcfg)}"
                )
            pairs.append((dst, s, name))
    final = target.final_norm
    if final is None or getattr(final, "weight", None) is None:
        raise Unmappable("the target has no final norm to start the drafter's norm from")
    pairs.append((drafter.norm.weight, norm_scale(final, H, "the final norm"), "norm.weight"))
    # hidden_norm: the fused context starts as what the first copied layer reads
    hidden = norm_scale(target.layers[start].input_layernorm, H, "input_layernorm")
    pairs.append((drafter.hidden_norm.weight, hidden, "hidden_norm.weight"))
    return pairs


def check_copied_layers(drafter: DFlashDrafter, target, start: int) -> list[float]:
    """layer_error for every copied layer; Unmappable naming what differs where one does not
    compute its target layer's function. Returns the errors."""
    errs = []
    for i, d_layer in enumerate(drafter.layers):
        src = start + i
        err = layer_error(d_layer, target.layers[src], target.model, src, drafter.rope_cos_sin)
        errs.append(err)
        if err > LAYER_TOL:
            tcfg = target.model.config
            scaling = drafter.config.rope_scaling
            kind = scaling["rope_type"] if scaling else "default"
            why = differences(target.layers[src], tcfg, src, kind)
            theta, ours = rope_theta(tcfg, layer_type(tcfg, src))[0], drafter.config.rope_theta
            if theta != ours:
                why.insert(0, f"RoPE base {ours:g} (the target's layer {src} uses {theta:g})")
            why = why or [
                "for a reason this check does not name (an unknown family: please report it "
                "with the model name)"
            ]
            raise Unmappable(
                f"{_family(target)} layer {src} copied into drafter layer {i} does not compute "
                f"what the target layer computes (relative difference {err:.2g} > {LAYER_TOL:g} "
                f"on the same input): {'; '.join(why)}"
            )
    return errs


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, target, init_tap: int = -1) -> list[str]:
    """Start the drafter from the target (see the module docstring): its last layers
    (init_tap -1), or those right after tapped layer init_tap; then check that every copied
    layer computes its target layer's function (models/layer_map.py). Raises Unmappable (the
    family cannot start the drafter: what differs) or ValueError (shapes, layer range).
    Returns the names of the tensors set."""
    layer_ids = list(drafter.config.target_layer_ids)
    start = first_source_layer(len(drafter.layers), len(target.layers), layer_ids, init_tap)
    pairs = target_init_pairs(drafter, target, start)
    for dst, s, _ in pairs:
        dst.copy_(s.to(dst.dtype))
    H = drafter.config.hidden_size
    nf = drafter.config.num_features
    tap = nf - 1 if init_tap < 0 else init_tap  # the feature slice fc passes through
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, tap * H : (tap + 1) * H].copy_(torch.eye(H, dtype=drafter.fc.weight.dtype))
    errs = check_copied_layers(drafter, target, start)
    log.info(
        "drafter.init=target: %s layers %d..%d copied and checked (largest relative difference "
        "%.1e)",
        _family(target),
        start,
        start + len(drafter.layers) - 1,
        max(errs),
    )
    if not has_qk_norm(target.layers[start]):
        log.warning(
            "drafter.init=target: %s layers have no q/k norm; the drafter's (Qwen3-style, "
            "weight 1) normalise q and k per head, which the target does not. That is the one "
            "part of the copied layers not equal to the target's; training adjusts it.",
            _family(target),
        )
    window = getattr(text_config(target.model.config), "sliding_window", None)
    if window and getattr(text_config(target.model.config), "use_sliding_window", True):
        log.info(
            "drafter.init=target: the target's sliding-window layers see %d positions; the "
            "drafter attends to its whole context (equal within the window)",
            int(window),
        )
    return [name for _, _, name in pairs] + ["fc.weight"]


def warm_start(path, drafter_cfg: DrafterConfig, target) -> DFlashDrafter:
    """A drafter that starts from the published-format export at `path` (fine-tuning).

    The export's architecture is kept (layers, heads, MLP width, tapped layers, mask token,
    RoPE base): those are what its weights mean. Checked against the target and the run's
    drafter settings, with a message naming what differs. Only the training block size and
    attention implementation come from the run (block size does not change any tensor).
    """
    pub = load_drafter(path, "cpu")  # strict: every tensor present, shapes checked, finite
    pc = pub.config
    where = f"drafter.init_from={path}"
    if pc.num_layers != drafter_cfg.num_layers:
        raise UserError(
            f"{where} has {pc.num_layers} layers but drafter.num_layers={drafter_cfg.num_layers}; "
            f"set drafter.num_layers={pc.num_layers} (a drafter cannot start from one with "
            "another layer count)."
        )
    if list(pc.target_layer_ids) != list(target.layer_ids):
        raise UserError(
            f"{where} was trained on target layers {list(pc.target_layer_ids)}, but the target "
            f"taps {list(target.layer_ids)}; set target.taps={list(pc.target_layer_ids)} or use "
            "the target it was trained for."
        )
    if pc.hidden_size != int(target.hidden_size) or pc.vocab_size != int(target.vocab_size):
        raise UserError(
            f"{where} has hidden size {pc.hidden_size} and vocabulary {pc.vocab_size}; the target "
            f"has {target.hidden_size} and {target.vocab_size}: it was trained for another target."
        )
    for name in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
        ours, theirs = getattr(drafter_cfg, name), getattr(pc, name)
        if ours != theirs:
            log.warning(
                "%s: using its %s=%s (drafter.%s=%s is ignored)", where, name, theirs, name, ours
            )
    want = variants.get(drafter_cfg.variant)
    if want.name != pc.variant and pc.variant in want.warm_starts_from:  # e.g. DFlash -> DFlash2
        options = want.options_from(drafter_cfg)
        drafter = convert_variant(pub, want.name, options, drafter_cfg.block_size)
        drafter.config.attention = drafter_cfg.attention
        log.info("drafter starts from %s export %s as %s", pc.variant, path, want.name)
        return drafter
    if want.name != pc.variant:
        raise UserError(
            f"{where} is a {pc.variant} drafter but drafter.variant={want.name}; set "
            f"drafter.variant={pc.variant} (a {want.name} drafter starts from "
            f"{list(want.warm_starts_from) or 'no other variant'})."
        )
    cfg = dataclasses.replace(
        pc, block_size=drafter_cfg.block_size, attention=drafter_cfg.attention
    )
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(pub.state_dict(), strict=True)
    log.info("drafter starts from %s (mask token %d)", path, cfg.mask_token_id)
    return drafter
