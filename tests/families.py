"""Tiny random targets of every decoder family the serving engines serve (no download): the
same small shape for each (hidden 64, 4 layers, 4 query heads / 2 KV heads x 16), with each
family's own conventions kept (Gemma 3: sliding and full layers with local and global RoPE
bases, offset norms, sandwich norms, GeLU-tanh, embedding scale; Phi-3: fused projections;
Qwen2: attention biases, set non-zero as a trained Qwen2's are; Llama 3.x: its `llama3`
frequency scaling; gpt-oss: YaRN, attention biases and sinks, sliding and full layers, MoE).

`SERVED_SHAPE` is the shape vLLM's CPU build can serve (tests/test_vllm_families.py): its CPU
attention takes head sizes 32, 64, 80, ... only (v1/attention/backends/cpu_attn.py
get_supported_head_sizes), so 2 query heads / 1 KV head x 32 at the same hidden size."""

from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "qwen3_moe")

# The served matrix's shape (module docstring): head_dim = hidden / heads = 32. Built here beyond
# FAMILIES: "llama3" (Llama 3.x's scaled RoPE) and "gpt_oss" (a gpt-oss-like MoE target).
SERVED_SHAPE = dict(num_attention_heads=2, num_key_value_heads=1)

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


def tiny_family_model(
    family: str, vocab: int = 160, seed: int = 0, init_std: float = 0.02, **shape
):
    """A random HF causal LM of `family` with the shapes above (`shape`: COMMON's keys to
    override, e.g. SERVED_SHAPE), its weights drawn with std `init_std` (0.02, transformers'
    default, gives a random target whose greedy answer repeats one token; ~0.3 gives varied
    answers)."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = dict(COMMON, vocab_size=vocab, initializer_range=init_std, **shape)
    head_dim = kw["hidden_size"] // kw["num_attention_heads"]
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**kw))
    elif family == "llama3":  # Llama 3.x: its frequency scaling, from position 16 on
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
        rope.update(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(rope_parameters=rope, **kw))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**kw))
        with torch.no_grad():  # HF initialises biases to 0; a trained Qwen2's are not
            for layer in model.model.layers:
                for name in ("q_proj", "k_proj", "v_proj"):
                    getattr(layer.self_attn, name).bias.normal_(0.0, 0.5)
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=head_dim, **kw))
    elif family == "mistral":
        kw.setdefault("sliding_window", 64)
        model = tf.MistralForCausalLM(tf.MistralConfig(head_dim=head_dim, **kw))
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
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
            head_dim=head_dim, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **kw
        )
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif family == "gpt_oss":
        # gpt-oss-20b's kind: YaRN, attention biases and sinks, sliding / full layers, MoE
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0}
        rope.update(beta_slow=1.0, truncate=False, original_max_position_embeddings=16)
        kw.update(intermediate_size=64, tie_word_embeddings=False)
        cfg = tf.GptOssConfig(
            head_dim=head_dim,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"] * (kw["num_hidden_layers"] // 2),
            sliding_window=8,
            attention_bias=True,
            rope_parameters=rope,
            **kw,
        )
        model = tf.GptOssForCausalLM(cfg)
    else:
        raise ValueError(family)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.eval()
