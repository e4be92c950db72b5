"""The target's decoding forward on CPU in float32 as one lean pass: for a Llama-shaped target
(Llama, Mistral, Qwen2, Qwen3 without sliding windows), the decode loop's forwards run here
instead of through transformers' modules.

Why: a single-stream decode step reads every weight once, so its floor is the weights' bytes over
the memory bandwidth. Through transformers' layers a step of SmolLM2-135M (30 layers, 538 MB of
fp32 weights) took 23-25 ms on a 2-core EPYC under AVX2 of which the linear layers were ~15:
the rest was Python and dispatch in ~1,100 small ops per token (attention-interface lookup,
rotary per layer, separate q/k/v and gate/up projections, keyword plumbing). Here a layer is
~15 ops: q/k/v as one prepacked GEMM, gate/up as another, rotary as two multiplies over q and
k together, attention as one SDPA call over the KV cache's buffers. Measured: 17 ms a token,
the linear layers ~16 of it (bench/LOG.md).

Same arithmetic as transformers', op for op where it matters: RMSNorm with fp32 statistics
(`F.rms_norm`, the norm's own eps), the model's own rotary module for cos/sin (so every RoPE
scaling transformers implements applies unchanged), rotate_half as a roll against a sign-folded
sin (the same products), SDPA with the layer's `scaling`. The q/k/v and gate/up GEMMs stack
their rows, so each output is still one dot product of a weight row and the input; a different
kernel may sum it in another order (last-bit differences, as with any fp32 kernel:
models/packed_linear.py). Tested against transformers' forward on tiny models of each family
(tests/test_lean_forward.py).

The KV cache is the decode loop's (models/kv_cache.py): each layer's `update` writes the new keys
and values in place and hands back views of the filled part, so crop, row selection and the
left-padded batch layout work unchanged. Taps are the residual stream after each tapped layer,
what the target's hooks capture.

Weights: the stacked, prepacked copies are a second copy of the decoder's linear weights while
the scope that built them lasts (as packed_linears' are; the LM head is the model's own module,
packed by packed_linears in that scope); built in well under a second.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trainer.models.packed_linear import available as packed_available
from dflash_trainer.models.target_layout import has_windowed_layers

log = logging.getLogger(__name__)

# model_type values whose decoder layer is the Llama block (pre-norm RMSNorm, rotary on q and k,
# SwiGLU MLP); Qwen3 adds an RMSNorm over each head of q and k before rotary.
LLAMA_SHAPED = ("llama", "mistral", "qwen2", "qwen3")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _stack_bias(*linears: nn.Linear) -> torch.Tensor | None:
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [
            b.detach() if b is not None else m.weight.new_zeros(m.out_features)
            for b, m in zip(biases, linears)
        ]
    )


def _bias(m: nn.Linear) -> torch.Tensor | None:
    return None if m.bias is None else m.bias.detach()


@dataclass
class _Layer:
    norm1: torch.Tensor
    norm2: torch.Tensor
    qkv: torch.Tensor  # prepacked [q; k; v] rows
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # prepacked [gate; up] rows
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # Qwen3: the q_norm and k_norm weights, a row per head


def unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot decode through LeanForward (None: it can)."""
    cfg: Any = getattr(model, "config", None)
    if cfg is None:
        return "no config"
    kind = getattr(cfg, "model_type", None)
    if kind not in LLAMA_SHAPED:
        return f"model_type {kind!r} is not one of {', '.join(LLAMA_SHAPED)}"
    if has_windowed_layers(cfg):
        return "it has sliding-window layers"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(cfg, 'hidden_act', None)!r} is not silu"
    if int(getattr(cfg, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1"
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu" or p.dtype != torch.float32:
        return "it is not a float32 CPU model"
    if not packed_available():
        return "oneDNN's prepacked linear is unavailable in this torch build"
    backbone = getattr(model, "model", None)
    if not all(hasattr(backbone, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "its backbone is not laid out as transformers' Llama model"
    for layer in backbone.layers:  # type: ignore[union-attr]
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not _linears(attn, "q_proj", "k_proj", "v_proj", "o_proj") or not _linears(
            mlp, "gate_proj", "up_proj", "down_proj"
        ):
            return f"decoder layer {type(layer).__name__} is not laid out as Llama's"
    return None


def _linears(module: nn.Module | None, *names: str) -> bool:
    return module is not None and all(
        isinstance(getattr(module, n, None), nn.Linear) for n in names
    )


class LeanForward:
    """TargetModel.forward's arithmetic for a Llama-shaped float32 CPU target (module
    docstring). Built once per decoding scope (`TargetModel.decoding`); call it as the forward."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"LeanForward cannot run {type(model).__name__}: {why}")
        hf: Any = model
        self.backbone = hf.model
        self.lm_head = hf.get_output_embeddings()
        cfg = hf.config
        self.hidden = int(cfg.hidden_size)
        self.eps = float(self.backbone.norm.variance_epsilon)
        first = self.backbone.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.n_q = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.scaling = float(first.scaling)
        self.intermediate = int(self.backbone.layers[0].mlp.gate_proj.out_features)
        self.taps = {lid: k for k, lid in enumerate(layer_ids)}
        with torch.no_grad():
            self.layers = [self._layer(la) for la in self.backbone.layers]

    def _layer(self, la: Any) -> _Layer:  # a Llama-shaped decoder layer (unsupported checked it)
        a, f = la.self_attn, la.mlp
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        return _Layer(
            norm1=la.input_layernorm.weight.detach(),
            norm2=la.post_attention_layernorm.weight.detach(),
            qkv=_pack(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
            qkv_bias=_stack_bias(a.q_proj, a.k_proj, a.v_proj),
            o=_pack(a.o_proj.weight),
            o_bias=_bias(a.o_proj),
            gate_up=_pack(torch.cat([f.gate_proj.weight, f.up_proj.weight])),
            gate_up_bias=_stack_bias(f.gate_proj, f.up_proj),
            down=_pack(f.down_proj.weight),
            down_bias=_bias(f.down_proj),
            qk_norm=None if qn is None or kn is None else self._head_norms(qn, kn),
        )

    def _head_norms(self, qn: Any, kn: Any) -> torch.Tensor:
        rows = [qn.weight.detach()] * self.n_q + [kn.weight.detach()] * self.n_kv
        return torch.stack(rows)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor):
        """cos and the sign-folded sin [B, Q, 1, D]: rotate_half(t) * sin == roll(t) * sin_s."""
        cos, sin = self.backbone.rotary_emb(x, positions)
        half = self.head_dim // 2
        sin_s = torch.cat([-sin[..., :half], sin[..., half:]], -1)
        return cos[:, :, None, :], sin_s[:, :, None, :]

    @staticmethod
    def _mask(cached: int, q: int, padding: torch.Tensor | None, device) -> torch.Tensor | None:
        """Which keys each query attends to [B or 1, 1, Q, cached + Q] (True = attend), None
        where every query sees every key (one new position and no padding)."""
        if q == 1 and padding is None:
            return None
        keys = torch.arange(cached + q, device=device)
        allowed = keys[None, :] <= (cached + torch.arange(q, device=device))[:, None]
        allowed = allowed[None, None]
        if padding is not None:
            allowed = allowed & padding.bool()[:, None, None, :]
        return allowed

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        *,
        taps: bool,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """TargetModel.forward's contract: (logits, taps [B, Q, n*H] or None)."""
        b, q = ids.shape
        x = F.embedding(ids, self.backbone.embed_tokens.weight)
        cos, sin_s = self._rotary(x, positions)
        mask = self._mask(cache.get_seq_length(), q, attention_mask, ids.device)
        slots: list[torch.Tensor | None] = [None] * len(self.taps)
        for i, la in enumerate(self.layers):
            x = self._block(x, la, cache.layers[i], cos, sin_s, mask, b, q)
            k = self.taps.get(i)
            if k is not None:
                slots[k] = x
        feats = torch.cat(slots, -1) if taps else None  # type: ignore[arg-type]
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        x = F.rms_norm(x, (self.hidden,), self.backbone.norm.weight, self.eps)
        return self.lm_head(x), feats

    def _block(self, x, la: _Layer, layer_cache, cos, sin_s, mask, b: int, q: int):
        h, d, nq, nkv = self.hidden, self.head_dim, self.n_q, self.n_kv
        y = F.rms_norm(x, (h,), la.norm1, self.eps)
        qkv = _linear(y.view(b * q, h), la.qkv, la.qkv_bias).view(b, q, nq + 2 * nkv, d)
        qk, v = qkv[:, :, : nq + nkv], qkv[:, :, nq + nkv :]
        if la.qk_norm is not None:  # Qwen3: each head of q and k normed, weights stacked
            qk = F.rms_norm(qk, (d,), None, self.eps) * la.qk_norm
        qk = qk * cos + torch.roll(qk, d // 2, -1) * sin_s
        keys, values = layer_cache.update(qk[:, :, nq:].transpose(1, 2), v.transpose(1, 2))
        att = F.scaled_dot_product_attention(
            qk[:, :, :nq].transpose(1, 2),
            keys,
            values,
            attn_mask=mask,
            scale=self.scaling,
            enable_gqa=nq != nkv,
        )
        x = x + _linear(att.transpose(1, 2).reshape(b * q, nq * d), la.o, la.o_bias).view(b, q, h)
        y = F.rms_norm(x, (h,), la.norm2, self.eps).view(b * q, h)
        gu = _linear(y, la.gate_up, la.gate_up_bias)
        act = F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate :]
        return x + _linear(act, la.down, la.down_bias).view(b, q, h)


def lean_forward(model: nn.Module, layer_ids: list[int]) -> LeanForward | None:
    """A LeanForward for `model` tapping `layer_ids`, or None (logged at debug) where it cannot
    run and transformers' forward stays."""
    why = unsupported(model)
    if why is not None:
        log.debug("decoding through transformers' forward: %s", why)
        return None
    return LeanForward(model, layer_ids)
