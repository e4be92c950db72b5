"""Tiny random targets of every decoder family the serving engines serve (no download): the
same small shape for each (hidden 64, 4 layers, 4 query heads / 2 KV heads x 16), with each
family's own conventions kept (Gemma 3: sliding and full layers with local and global RoPE
bases, offset norms, sandwich norms, GeLU-tanh, embedding scale; Phi-3: fused projections;
Qwen2: attention biases, set non-zero as a trained Qwen2's are)."""

from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "qwen3_moe")

# How drafter.init=target treats each (docs/guides/families.md): mapped exactly, or refused.
MAPPED = {"llama", "qwen3", "mistral", "phi3"}

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_family_model(family: str, vocab: int = 160, seed: int = 0):
    """A random HF causal LM of `family` with the shapes above."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = dict(COMMON, vocab_size=vocab)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**kw))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**kw))
        with torch.no_grad():  # HF initialises biases to 0; a trained Qwen2's are not
            for layer in model.model.layers:
                for name in ("q_proj", "k_proj", "v_proj"):
                    getattr(layer.self_attn, name).bias.normal_(0.0, 0.5)
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, **kw))
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(head_dim=16, sliding_window=64, **kw))
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            **kw,
        )
        model = tf.Gemma3ForCausalLM(cfg)
        with torch.no_grad():  # offset norms initialise to 0 (scale 1); trained ones are not
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
    elif family == "phi3":
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**kw))
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **kw
        )
        model = tf.Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(family)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.eval()
