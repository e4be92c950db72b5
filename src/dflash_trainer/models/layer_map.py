"""One target decoder layer onto one drafter layer: the tensors `drafter.init = target` copies,
and the start-up check that the copy computes what the target layer computes.

Tensors are paired by what they do, not only by name:
  - norms are read through their function: a norm module is run on random rows and its
    per-channel scale measured, so an offset norm (Gemma's `x * (1 + w)`) becomes the drafter's
    `x * w'` with w' = 1 + w, and a norm that is not an RMSNorm (mean-subtracting LayerNorm) is
    refused;
  - fused projections are split (Phi-3's qkv_proj into q/k/v, gate_up_proj into gate/up);
  - an MLP without gate/up/down (a mixture of experts) has nothing to pair and is refused.

Names alone cannot prove the math: Gemma 3's post_attention_layernorm pairs by name with the
drafter's pre-MLP norm but normalises the attention output. So after the copy, `layer_error`
runs the target layer and the copied drafter layer (fp32 copies) on the same random hidden
states at the same positions, the drafter in plain causal self-attention and with the target's
RoPE for that layer's type, and compares what each adds to the residual stream. A family this
module has never seen is caught there instead of trusted. `differences` names what a refused
layer does differently (activation, sandwich norms, biases, RoPE variant, attention scale) for
the error message; it never decides.

The one difference the drafter's architecture imposes is q_norm/k_norm: the published
(Qwen3-style) drafter always normalises q and k per head. A target without them (Llama,
Mistral, Phi-3) leaves them at weight 1, which changes the attention temperature; the check
compares everything else (those norms bypassed) and the caller says so in the log.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trainer.models.target_layout import layer_type, rope_params, text_config

LAYER_TOL = 1e-3  # relative, fp32 copies: a kernel's rounding is ~1e-6, a real mismatch O(1)
NORM_TOL = 1e-4


class Unmappable(ValueError):
    """The target layer cannot start the drafter's; the message names why."""


# ------------------------------------------------------------------------------------- norms


@torch.no_grad()
def norm_scale(norm: nn.Module, dim: int, what: str) -> torch.Tensor:
    """The per-channel scale s with norm(x) = s * x / rms(x) (fp32), measured by running the
    module: any weight convention (w, 1 + w) comes out as the drafter's plain weight. Raises
    Unmappable when the module is not an RMSNorm (its output is not such a rescaling)."""
    m = copy.deepcopy(norm).to("cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, dim, generator=g) * 3.0
    y = m(x).float()
    eps = float(getattr(m, "eps", getattr(m, "variance_epsilon", 1e-6)) or 0.0)
    unit = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    s = (y / unit).median(dim=0).values  # robust to a channel where unit is ~0 in one row
    err = float((s * unit - y).abs().max() / y.abs().max().clamp_min(1e-6))
    if not torch.isfinite(s).all() or err > NORM_TOL:
        raise Unmappable(
            f"{what} ({type(norm).__name__}) is not an RMSNorm (its output is not a per-channel "
            f"rescaling of x / rms(x): relative error {err:.1e}); the drafter's norms are RMSNorms"
        )
    return s


# ------------------------------------------------------------------------------------- tensors


def _weight(module: nn.Module, name: str) -> torch.Tensor | None:
    sub = getattr(module, name, None)
    return getattr(sub, "weight", None) if isinstance(sub, nn.Module) else None


def source_tensors(t_layer: nn.Module, tcfg, hidden: int) -> dict[str, torch.Tensor]:
    """{drafter tensor name within a layer: the value it starts from} for one target layer.
    Raises Unmappable naming the part that has no counterpart."""
    c = text_config(tcfg)
    attn, mlp = getattr(t_layer, "self_attn", None), getattr(t_layer, "mlp", None)
    kind = type(t_layer).__name__
    if attn is None or mlp is None:
        raise Unmappable(f"{kind} has no self_attn/mlp (not a Llama-style decoder layer)")
    out: dict[str, torch.Tensor] = {}
    qkv = _weight(attn, "qkv_proj")
    if qkv is not None:  # Phi-3: q, k, v stacked on the output dim
        heads, kv = int(c.num_attention_heads), int(c.num_key_value_heads or c.num_attention_heads)
        hd = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
        q, k, v = qkv.split([heads * hd, kv * hd, kv * hd], dim=0)
        out.update({"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k})
        out["self_attn.v_proj.weight"] = v
    for name in ("q_proj", "k_proj", "v_proj"):
        w = _weight(attn, name)
        if w is not None:
            out[f"self_attn.{name}.weight"] = w
    o_proj = _weight(attn, "o_proj")
    if o_proj is not None:
        out["self_attn.o_proj.weight"] = o_proj
    missing = [
        n for n in ("q_proj", "k_proj", "v_proj", "o_proj") if f"self_attn.{n}.weight" not in out
    ]
    if missing:
        raise Unmappable(
            f"its attention ({type(attn).__name__}) has no {'/'.join(missing)} to copy"
        )
    gate_up = _weight(mlp, "gate_up_proj")
    if gate_up is not None and _weight(mlp, "down_proj") is not None:
        gate, up = gate_up.chunk(2, dim=0)  # Phi-3: gate first
        out.update({"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up})
    for name in ("gate_proj", "up_proj", "down_proj"):
        w = _weight(mlp, name)
        if w is not None:
            out[f"mlp.{name}.weight"] = w
    if not all(f"mlp.{n}.weight" in out for n in ("gate_proj", "up_proj", "down_proj")):
        experts = hasattr(mlp, "experts") or hasattr(mlp, "gate") and not hasattr(mlp, "up_proj")
        what = "a mixture of experts" if experts else "not a gate/up/down MLP"
        raise Unmappable(
            f"its MLP ({type(mlp).__name__}) is {what}; the drafter's is one dense SwiGLU MLP"
        )
    for name in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(t_layer, name, None)
        if norm is None:
            raise Unmappable(f"{kind} has no {name}")
        out[f"{name}.weight"] = norm_scale(norm, hidden, name)
    for name in ("q_norm", "k_norm"):
        norm = getattr(attn, name, None)
        if norm is not None:
            dim = int(out["self_attn.q_proj.weight"].shape[0] // int(c.num_attention_heads))
            out[f"self_attn.{name}.weight"] = norm_scale(norm, dim, f"self_attn.{name}")
    return out


def has_qk_norm(t_layer: nn.Module) -> bool:
    return getattr(t_layer.self_attn, "q_norm", None) is not None


# ------------------------------------------------------------------------------- the check


def _rotary(target_model: nn.Module) -> nn.Module:
    for mod in target_model.modules():
        if type(mod).__name__.endswith("RotaryEmbedding") and hasattr(mod, "forward"):
            return mod
    raise Unmappable("the target has no rotary embedding module (the drafter uses RoPE)")


@torch.no_grad()
def layer_error(
    d_layer: nn.Module,
    t_layer: nn.Module,
    target_model: nn.Module,
    layer_idx: int,
    rope_cos_sin: Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]],
    seq_len: int = 12,
    seed: int = 0,
) -> float:
    """Relative difference between what the target layer and the copied drafter layer add to
    the residual stream, on the same random hidden states at positions 0..seq_len-1 (causal
    attention; fp32 copies of both; within every sliding window). See the module docstring."""
    tcfg = target_model.config
    # Any: HF's layer classes and ours, reached by attribute (nn.Module's __getattr__ is untyped)
    t: Any = copy.deepcopy(t_layer).to("cpu", torch.float32).eval()
    d: Any = copy.deepcopy(d_layer).to("cpu", torch.float32).eval()
    acfg = getattr(t.self_attn, "config", None)
    if acfg is not None:  # eager: the copy returns its attention probabilities
        acfg._attn_implementation = "eager"
    window = getattr(text_config(tcfg), "sliding_window", None)
    S = min(seq_len, int(window)) if window else seq_len
    H = int(d.input_layernorm.weight.shape[0])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, S, H, generator=g)
    pos = torch.arange(S)[None]

    rot = copy.deepcopy(_rotary(target_model)).to("cpu")
    kw = {}
    if "layer_type" in inspect.signature(rot.forward).parameters:
        kw["layer_type"] = layer_type(tcfg, layer_idx)
    cos, sin = rot(x, pos, **kw)
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
    probs: dict[str, Any] = {}  # "want": the target's attention probabilities, "got": ours
    hook = t.self_attn.register_forward_hook(
        lambda _m, _i, o: probs.__setitem__("want", o[1] if isinstance(o, tuple) else None)
    )
    out = t(
        hidden_states=x,
        position_embeddings=(cos.float(), sin.float()),
        attention_mask=mask,
        position_ids=pos,
    )
    hook.remove()
    want = (out[0] if isinstance(out, tuple) else out) - x

    if not has_qk_norm(t):  # the drafter's one imposed difference (module docstring)
        d.self_attn.q_norm, d.self_attn.k_norm = nn.Identity(), nn.Identity()
    rope = rope_cos_sin(pos, torch.float32)  # the drafter's own (DFlashDrafter.rope_cos_sin)

    def attend(q, k, v):  # plain causal attention, its probabilities kept
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        p = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask, dim=-1)
        probs["got"] = p
        return p @ v

    got = d(x, rope, attend) - x
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
    if probs.get("want") is not None:
        # A random-initialised target's attention is nearly uniform, so its output hardly
        # depends on the scores; its attention logits still do (RoPE base, scale, q/k norms).
        err = max(err, _logit_error(probs["got"], probs["want"].float()))
    return err


def _logit_error(p_got: torch.Tensor, p_want: torch.Tensor) -> float:
    """Relative difference of two causal attention maps' logits (log-probabilities centred per
    row over the visible positions)."""
    S = p_want.shape[-1]
    seen = torch.ones(S, S, dtype=torch.bool).tril()
    n = seen.sum(-1, keepdim=True)

    def centred(p):
        lp = torch.where(seen, p.clamp_min(1e-30).log(), 0.0)
        return torch.where(seen, lp - lp.sum(-1, keepdim=True) / n, 0.0)

    a, b = centred(p_got), centred(p_want)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


# ------------------------------------------------------------------------- naming the cause


def differences(
    t_layer: nn.Module, tcfg, layer_idx: int, drafter_rope_type: str = "default"
) -> list[str]:
    """What a target layer computes that the drafter's Qwen3-style layer does not (for the
    refusal message; `layer_error` decides). `drafter_rope_type`: the drafter's RoPE form."""
    c = text_config(tcfg)
    attn, mlp, out = t_layer.self_attn, t_layer.mlp, []
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    if callable(act):
        z = torch.linspace(-4, 4, 33)
        if not torch.allclose(act(z), F.silu(z), atol=1e-5):
            name = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None)
            out.append(f"MLP activation {name or type(act).__name__} (the drafter's is SiLU)")
    sandwich = [
        n
        for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        if hasattr(t_layer, n)
    ]
    if sandwich:
        out.append(
            "sandwich norms: post_attention_layernorm normalises the attention output and "
            f"{' / '.join(sandwich)} wrap the MLP (the drafter has one pre-norm per sublayer)"
        )
    biased = [
        n
        for n in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
        if getattr(getattr(attn, n, None), "bias", None) is not None
        and bool(getattr(attn, n).bias.detach().abs().max() > 0)
    ]
    if biased:
        out.append(f"biases on {'/'.join(biased)} (the drafter's projections have none)")
    params, _ = rope_params(tcfg, layer_type(tcfg, layer_idx))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (None, "default") and rope_type != drafter_rope_type:
        out.append(
            f"RoPE type {rope_type!r} (the drafter's is {drafter_rope_type!r}: "
            "--drafter.rope=target gives it the target's)"
        )
    partial = params.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))
    if partial is not None and float(partial) < 1.0:
        out.append(f"partial rotary (factor {partial}; the drafter rotates the whole head)")
    hd = getattr(attn, "head_dim", None)
    scaling = getattr(attn, "scaling", None)
    if hd and scaling and abs(float(scaling) * float(hd) ** 0.5 - 1.0) > 1e-6:
        out.append(f"attention scale {float(scaling):.4g} (the drafter's is 1/sqrt(head_dim))")
    for key in ("attn_logit_softcapping",):
        if getattr(c, key, None):
            out.append(f"{key}={getattr(c, key)} (the drafter has none)")
    return out
