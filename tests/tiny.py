"""Tiny random targets and synthetic datasets for pipeline tests (CPU, seconds)."""

from __future__ import annotations

import numpy as np
import torch

from dflash_trainer.config import Config
from dflash_trainer.data.chat import TokenizedDataset
from dflash_trainer.models.target import TargetModel


def tiny_target(
    arch: str = "llama",
    layers: int = 4,
    hidden: int = 64,
    vocab: int = 128,
    seed: int = 0,
    tokenizer=None,
) -> TargetModel:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, **kw))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kw))
    return TargetModel.from_hf(model, tokenizer, [1, layers - 2])


def base_tokenizer(bos_first: bool = True):
    """A base model's character tokenizer: no chat template; ids 0 <pad>, 1 <s> (BOS), 2 </s>
    (EOS, as tiny_target's generation config has it), then printable ASCII and newline (< 128
    ids). bos_first: it puts BOS before every text (Llama's convention; GPT-2's puts none)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", *chars])}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.decoder = decoders.Fuse()
    if bos_first:
        tk.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 1)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


STEPS = [0]  # repeated tokens: learnable in a few dozen steps by a 1-layer drafter


def tiny_dataset(
    n: int = 24, vocab: int = 128, seed: int = 0, min_len: int = 24, max_len: int = 80
) -> TokenizedDataset:
    """Learnable 'conversations': a prompt (loss 0) then a response (loss 1), tokens >= 3.

    Each row is an arithmetic progression mod (vocab - 3) with a random start and a step from a
    small set, so a drafter can learn to continue it from the anchor token and the context.
    """
    rng = np.random.default_rng(seed)
    ids, masks, names = [], [], []
    for i in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        prompt = int(rng.integers(4, length // 2))
        start, step = int(rng.integers(0, vocab - 3)), int(rng.choice(STEPS))
        ids.append((3 + (start + step * np.arange(length)) % (vocab - 3)).astype(np.int32))
        m = np.zeros(length, np.uint8)
        m[prompt:] = 1
        masks.append(m)
        names.append(f"s{i}")
    return TokenizedDataset(ids, masks, names)


def tiny_config(tmp_path, **over) -> Config:
    from dflash_trainer.config_io import load_config

    flags = {
        "run_dir": str(tmp_path / "run"),
        "drafter.num_layers": 1,
        "drafter.num_heads": 4,
        "drafter.num_kv_heads": 2,
        "drafter.head_dim": 16,
        "drafter.intermediate_size": 64,
        "drafter.block_size": 4,
        "objective.num_anchors": 8,
        "drafter.mask_token_id": 0,
        "checkpoint.export_dtype": "float32",  # exact exports: tests compare them to the drafter
        "batching.max_tokens": 256,
        "batching.max_batch_size": 4,
        "batching.num_buckets": 2,
        "batching.pad_multiple": 8,
        "optim.epochs": 2,
        "optim.lr": 3e-3,
        "optim.warmup_ratio": 0.0,
        "pipeline.cpu_threads": 2,
        "pipeline.poll_s": 0.05,
        "metrics.tick_s": 0.05,
        "metrics.log_every_s": 0.2,
        "metrics.wandb": "off",
        "metrics.tensorboard": False,
        "metrics.console": False,
        "checkpoint.keep_last": 2,
    }
    flags.update(over)
    return load_config(None, None, [f"--{k}={v}" for k, v in flags.items()])
