"""What a target's config says about its decoder layers: head layout and MLP width (the drafter's
shapes default to them), which layers `drafter.init = target` copies, and the RoPE base of each
layer type (Gemma 3's sliding layers use a local base, its full-attention layers a global one).

Plain reading of an HF config (any family); no weights, no torch.
"""

from __future__ import annotations

DEFAULT_ROPE_THETA = 10000.0  # transformers' default where a config names no base

SHAPE_FIELDS = ("num_heads", "num_kv_heads", "head_dim", "intermediate_size")


def text_config(tcfg):
    """The decoder's config (a multimodal config nests it)."""
    return tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg


def target_shapes(tcfg) -> dict[str, int]:
    """The target's layer shapes under the drafter's field names."""
    c = text_config(tcfg)
    heads = int(c.num_attention_heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    return {
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": int(c.intermediate_size),
    }


def first_source_layer(n: int, num_target_layers: int, layer_ids, init_tap: int) -> int:
    """The target layer that drafter layer 0 starts from with init=target: the last n layers
    (init_tap -1), or those right after tapped layer init_tap."""
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


def layer_type(tcfg, i: int) -> str | None:
    """`config.layer_types[i]` (sliding_attention / full_attention ...) where the family has it."""
    types = getattr(text_config(tcfg), "layer_types", None)
    return types[i] if types and i < len(types) else None


def has_windowed_layers(tcfg) -> bool:
    """Does any decoder layer attend to less than its whole causal past: a layer type other than
    full attention (sliding windows in Gemma 2/3, gpt-oss, Qwen2 with windows; Llama 4's chunks;
    linear attention), or, in a family without layer types, a sliding window on every layer
    (Mistral, Phi-3, where `sliding_window` is set)? Such a target builds its masks per layer
    type: one causal mask handed to it would replace every window."""
    c = text_config(tcfg)
    types = getattr(c, "layer_types", None)
    if types:
        return any(t != "full_attention" for t in types)
    return bool(getattr(c, "sliding_window", None)) and getattr(c, "use_sliding_window", True)


def rope_params(tcfg, ltype: str | None) -> tuple[dict, str]:
    """(RoPE parameters, where they were read) for layers of type `ltype` (None: the model's
    global ones, the full-attention layers' where the family has several)."""
    c = text_config(tcfg)
    rp = getattr(c, "rope_parameters", None)  # transformers 5; 4.x keeps rope_theta top-level
    if isinstance(rp, dict):
        per_type = {k: v for k, v in rp.items() if isinstance(v, dict)}
        if per_type:
            key = ltype if ltype in per_type else "full_attention"
            if key not in per_type:
                key = sorted(per_type)[0]
            return per_type[key], f"rope_parameters[{key!r}]"
        return rp, "rope_parameters"
    theta = getattr(c, "rope_theta", None)
    return ({"rope_theta": theta} if theta else {}), "rope_theta"


def rope_theta(tcfg, ltype: str | None = None) -> tuple[float, str]:
    """(the RoPE base for layers of type `ltype`, a note saying where it came from)."""
    params, where = rope_params(tcfg, ltype)
    theta = params.get("rope_theta")
    if theta:
        return float(theta), f"the target's {where}"
    return DEFAULT_ROPE_THETA, (
        f"the target's config names no RoPE base; {DEFAULT_ROPE_THETA:g} is transformers' default"
    )
