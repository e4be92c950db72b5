"""The drafter's rotary embedding, as its config declares it: plain RoPE at a base, or a scaled
form (YaRN, Llama 3's, linear, ...) with its parameters. The frequencies and the cos/sin scale come
from transformers' own RoPE initialisers, the code every engine (vLLM, SGLang) and the `dflash`
reference package reproduce, so a drafter computes here what it computes where it is served.

`scaling` is the declared form without the base: None for plain RoPE, else a dict with
`rope_type` and that type's parameters (transformers-5 `rope_parameters` minus `rope_theta`).

Types whose frequencies change with the sequence length at run time (`dynamic`, `longrope`) are
refused: a drafter sees its context in pieces, so it could not match what an engine computes.
"""

from __future__ import annotations

from typing import Any

import torch

# Types with fixed frequencies; what transformers calls each (rope_type) is the key.
STATIC_TYPES = ("default", "linear", "yarn", "llama3", "proportional")


def normalise_scaling(declared: Any, where: str) -> dict[str, Any] | None:
    """The scaling form of a config's `rope_parameters` or older `rope_scaling` (`type` read as
    `rope_type`), without the base; None for plain RoPE. ValueError naming `where` for a form
    this drafter cannot compute the way engines do."""
    if not declared:
        return None
    if not isinstance(declared, dict):
        raise ValueError(f"{where} is {declared!r}, not a mapping")
    d = {k: v for k, v in declared.items() if k not in ("rope_theta", "type")}
    kind = declared.get("rope_type", declared.get("type", "default"))
    if kind == "default":
        extra = sorted(set(d) - {"rope_type", "partial_rotary_factor"})
        if extra or float(d.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"{where}: plain RoPE with {extra or 'a partial rotary factor'}")
        return None
    if kind not in STATIC_TYPES:
        raise ValueError(
            f"{where}: rope_type {kind!r} is not supported (its frequencies change with the "
            f"sequence length at run time); supported: {', '.join(STATIC_TYPES)}"
        )
    if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor {d['partial_rotary_factor']} != 1")
    return {**d, "rope_type": kind}


def rope_parameters(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The transformers-5 `rope_parameters` of a base and a scaling form."""
    return {"rope_type": "default", "rope_theta": theta, **(scaling or {})}


def frequencies(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    max_position_embeddings: int,
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] fp32, the factor cos/sin are multiplied by)."""
    if scaling is None:
        exps = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        return 1.0 / (theta**exps), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = Qwen3Config(
        hidden_size=head_dim,
        num_attention_heads=1,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope_parameters(theta, scaling),
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [*positions.shape, head_dim] for integer positions (any shape), computed in fp32."""
    ang = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat([ang, ang], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
