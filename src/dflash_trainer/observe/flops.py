"""Analytic FLOP counts for TFLOP/s and MFU (torchtitan convention: 2 FLOPs per MAC).

Target (frozen, forward only, stops after the last tapped layer), per token of context length S:
    2 * N_target_matmul  +  2 * L * d_attn * S
(QK^T and PV cost 2*d*kv each; causal attention averages kv = S/2.)

Drafter (trained, forward + backward = 3x forward), per *query* token (anchors x block_size):
    6 * N_drafter_matmul  +  12 * L * d_attn * (S/2 + block)  +  4 * H * V (frozen lm_head:
    forward + input gradient, no weight gradient)
plus, per *context* token, 6 * N_context (fc projection of the tapped features + each drafter
layer's K/V projection of the context).

Peak TFLOP/s per device comes from a small table (bf16 dense) or the configured value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# bf16 dense peaks (vendor datasheets), matched as substrings of the device name, first hit wins.
PEAK_TFLOPS_BF16 = (
    ("H100 PCIe", 756.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
)


def peak_tflops_for_name(name: str) -> float:
    for key, value in PEAK_TFLOPS_BF16:
        if key.lower() in name.lower():
            return value
    return 0.0


def peak_tflops(device, configured: float = 0.0) -> float:
    """Configured value if > 0, else the table entry for this CUDA device; 0 = unknown (no MFU)."""
    if configured > 0:
        return float(configured)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0.0
    return peak_tflops_for_name(torch.cuda.get_device_name(device))


def _get(model_config: object, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(model_config, n, None)
        if v is not None:
            return v
    if default is not None:
        return default
    raise ValueError(f"config {type(model_config).__name__} lacks any of {names}")


def layer_shape(model_config: object) -> tuple[int, int, int, int]:
    """(hidden, attn_dim = heads*head_dim, kv_dim, intermediate) of an HF-style or DFlash config."""
    hidden = int(_get(model_config, "hidden_size"))
    heads = int(_get(model_config, "num_attention_heads", "num_heads"))
    kv_heads = int(_get(model_config, "num_key_value_heads", "num_kv_heads", default=heads))
    head_dim = int(getattr(model_config, "head_dim", None) or hidden // heads)
    inter = int(_get(model_config, "intermediate_size"))
    return hidden, heads * head_dim, kv_heads * head_dim, inter


def layer_matmul_params(model_config: object) -> int:
    """q, k, v, o projections + gated MLP (gate, up, down) of one decoder layer."""
    hidden, attn, kv, inter = layer_shape(model_config)
    return hidden * attn + 2 * hidden * kv + attn * hidden + 3 * hidden * inter


@dataclass
class FlopsModel:
    target_params_matmul: float  # matmul params of the target layers actually run
    target_layers: int  # layers run (last tapped layer + 1)
    target_attn_dim: int  # heads * head_dim
    drafter_params_matmul: float  # drafter layer matmul params applied per query token (mean)
    drafter_layers: int
    drafter_attn_dim: int
    drafter_context_params: float = 0.0  # fc + per-layer context K/V, applied per context token
    lm_head_params: float = 0.0  # hidden * vocab of the frozen head per query token (mean)
    block_size: int = 16
    seq_len: float = 1024.0  # default context length for the attention terms
    attention_layers: float = 0.0  # drafter layers' attention per query (0 = drafter_layers)

    def target_flops_per_token(self, seq_len: float | None = None) -> float:
        s = self.seq_len if seq_len is None else seq_len
        return 2.0 * self.target_params_matmul + 2.0 * self.target_layers * self.target_attn_dim * s

    def drafter_flops_per_query(self, seq_len: float | None = None) -> float:
        s = self.seq_len if seq_len is None else seq_len
        layers = self.attention_layers or self.drafter_layers
        attn = 12.0 * layers * self.drafter_attn_dim * (s / 2.0 + self.block_size)
        return 6.0 * self.drafter_params_matmul + attn + 4.0 * self.lm_head_params

    def drafter_flops_per_context_token(self) -> float:
        return 6.0 * self.drafter_context_params

    @classmethod
    def from_configs(
        cls,
        target_config: object,
        target_layers_run: int,
        drafter_config: object,
        seq_len: float = 1024.0,
        block_size: int | None = None,
        loss_slots: int = 0,
        read_slots: int = 0,
    ) -> FlopsModel:
        """From an HF target config (or anything with those attribute names) and a DFlash config.

        `target_layers_run` = last tapped layer + 1 (the target forward stops there).
        `loss_slots`: slots per block that go through the LM head (0 = every slot);
        `read_slots`: slots per block whose last-layer query, attention and MLP are computed
        (0 = every slot; DFlashDrafter.last_layer_slots). The per-query figures are averages over a
        block's slots, so MFU counts what the step computes.
        """
        t_hidden, t_attn, _, _ = layer_shape(target_config)
        d_hidden, d_attn, d_kv, _ = layer_shape(drafter_config)
        d_layers = int(_get(drafter_config, "num_layers", "num_hidden_layers"))
        taps = getattr(drafter_config, "target_layer_ids", None)
        n_taps = len(taps) if taps else 1
        vocab = int(_get(target_config, "vocab_size"))
        context = n_taps * t_hidden * d_hidden + d_layers * 2 * d_hidden * d_kv
        bs = block_size or int(_get(drafter_config, "block_size", default=16))
        per_layer = layer_matmul_params(drafter_config)
        # The last layer's block K/V cover every slot; its query, output and MLP only the read ones.
        skipped = (1.0 - (read_slots or bs) / bs) * (per_layer - 2 * d_hidden * d_kv)
        return cls(
            target_params_matmul=float(target_layers_run * layer_matmul_params(target_config)),
            target_layers=int(target_layers_run),
            target_attn_dim=t_attn,
            drafter_params_matmul=float(d_layers * per_layer - skipped),
            drafter_layers=d_layers,
            drafter_attn_dim=d_attn,
            drafter_context_params=float(context),
            lm_head_params=float(d_hidden * vocab) * (loss_slots or bs) / bs,
            block_size=bs,
            seq_len=float(seq_len),
            attention_layers=d_layers - 1 + (read_slots or bs) / bs,
        )
