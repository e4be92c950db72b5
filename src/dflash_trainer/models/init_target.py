"""Where a drafter starts: from the target (`drafter.init = target`) or from a published
drafter (`drafter.init_from = DIR`, fine-tuning).

The drafter has the target's hidden size and, in the presets, its head layout. So:
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
The architecture and export format are the published ones: only the starting values differ.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from dflash_trainer.errors import UserError
from dflash_trainer.models.drafter import DFlashDrafter
from dflash_trainer.models.export import load_drafter

log = logging.getLogger(__name__)

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")


def _layer_pairs(d_layer: nn.Module, t_layer: nn.Module, i: int):
    """(drafter tensor, target tensor, drafter tensor name) for one decoder layer."""
    out = []
    for name in _ATTN:
        out.append(
            (
                getattr(d_layer.self_attn, name).weight,
                getattr(getattr(t_layer.self_attn, name, None), "weight", None),
                f"layers.{i}.self_attn.{name}.weight",
            )
        )
    for name in ("q_norm", "k_norm"):
        t = getattr(t_layer.self_attn, name, None)
        if t is not None:
            out.append(
                (
                    getattr(d_layer.self_attn, name).weight,
                    t.weight,
                    f"layers.{i}.self_attn.{name}.weight",
                )
            )
    for name in _MLP:
        out.append(
            (
                getattr(d_layer.mlp, name).weight,
                getattr(getattr(t_layer.mlp, name, None), "weight", None),
                f"layers.{i}.mlp.{name}.weight",
            )
        )
    for name in _NORMS:
        out.append(
            (
                getattr(d_layer, name).weight,
                getattr(getattr(t_layer, name, None), "weight", None),
                f"layers.{i}.{name}.weight",
            )
        )
    return out


def first_source_layer(n: int, num_target_layers: int, layer_ids, init_tap: int) -> int:
    """The target layer that drafter layer 0 starts from (see the module docstring)."""
    L = num_target_layers
    if n > L:
        raise ValueError(f"the drafter has {n} layers but the target only {L}")
    if init_tap < 0:
        return L - n
    if init_tap >= len(layer_ids):
        raise ValueError(
            f"init_tap={init_tap} but the target has {len(layer_ids)} tapped layers "
            f"{list(layer_ids)}: use 0..{len(layer_ids) - 1}, or -1 for its last layers"
        )
    start = layer_ids[init_tap] + 1
    if start + n > L:
        raise ValueError(
            f"init_tap={init_tap}: {n} layers after tapped layer {layer_ids[init_tap]} run past "
            f"the target's {L} layers; choose a shallower tap or fewer drafter layers"
        )
    return start


def target_init_pairs(drafter: nn.Module, target_layers, final_norm: nn.Module | None, start: int):
    """Every (drafter tensor, source tensor, name) the target init copies, checked: raises
    ValueError naming the first tensor whose source is missing or has another shape. Drafter
    layer i copies target layer start + i (first_source_layer)."""
    n = len(drafter.layers)
    pairs = []
    for i in range(n):
        src = start + i
        for dst, s, name in _layer_pairs(drafter.layers[i], target_layers[src], i):
            if s is None:
                raise ValueError(
                    f"{name}: target layer {src} has no such weight (not a "
                    "Llama/Qwen-style decoder layer)"
                )
            if tuple(dst.shape) != tuple(s.shape):
                raise ValueError(
                    f"{name} has shape {tuple(dst.shape)}, target layer {src}'s is "
                    f"{tuple(s.shape)}: set drafter.num_heads/num_kv_heads/head_dim/"
                    "intermediate_size to the target's"
                )
            pairs.append((dst, s, name))
    if final_norm is None or getattr(final_norm, "weight", None) is None:
        raise ValueError("norm.weight: the target has no final norm to start from")
    if tuple(final_norm.weight.shape) != tuple(drafter.norm.weight.shape):
        raise ValueError(
            f"norm.weight: the target's final norm has shape {tuple(final_norm.weight.shape)}"
        )
    pairs.append((drafter.norm.weight, final_norm.weight, "norm.weight"))
    pairs.append(
        (
            drafter.hidden_norm.weight,
            target_layers[start].input_layernorm.weight,
            "hidden_norm.weight",
        )
    )
    return pairs


@torch.no_grad()
def init_from_target(
    drafter: nn.Module, target_layers, final_norm: nn.Module | None, init_tap: int = -1
) -> list[str]:
    """Copy target layers into the drafter (see the module docstring): its last layers
    (init_tap -1), or those right after tapped layer init_tap. Returns the names of the tensors
    set."""
    layer_ids = list(drafter.config.target_layer_ids)
    start = first_source_layer(len(drafter.layers), len(target_layers), layer_ids, init_tap)
    pairs = target_init_pairs(drafter, target_layers, final_norm, start)
    for dst, s, _ in pairs:
        dst.copy_(s.to(dst.dtype))
    H = drafter.config.hidden_size
    nf = drafter.config.num_features
    tap = nf - 1 if init_tap < 0 else init_tap  # the feature slice fc passes through
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, tap * H : (tap + 1) * H].copy_(torch.eye(H, dtype=drafter.fc.weight.dtype))
    return [name for _, _, name in pairs] + ["fc.weight"]


def warm_start(path, drafter_cfg, target) -> DFlashDrafter:
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
    cfg = dataclasses.replace(
        pc, block_size=drafter_cfg.block_size, attention=drafter_cfg.attention
    )
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(pub.state_dict(), strict=True)
    log.info("drafter starts from %s (mask token %d)", path, cfg.mask_token_id)
    return drafter
