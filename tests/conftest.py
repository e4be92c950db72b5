"""Shared fixtures: tiny local tokenizers with real chat templates (no model hub), and the CPU
kind every test runs under.

What `auto` picks (target.dtype, pipeline.precision) depends on the CPU: bf16 where it has bf16
matmuls (AVX512-BF16, AMX), fp32 elsewhere (precision.py). So that the suite computes the
same on every machine, the whole session answers the probe one way through its one seam,
DFLASH_TRAINER_CPU_NATIVE_BF16 (inherited by the CLI subprocesses tests start):
`--native-bf16=0` (default: an AVX2-only CPU), `=1` (a bf16-native CPU), `=probe` (this machine's
own answer). A test whose expectation depends on the answer takes the `cpu_native_bf16` fixture
and runs under both answers on every machine, asserting what each kind must do.
"""

from __future__ import annotations

import os

import pytest
import torch

from dflash_trainer.precision import NATIVE_BF16_ENV


def pytest_addoption(parser):
    parser.addoption(
        "--native-bf16",
        choices=["0", "1", "probe"],
        default="0",
        help="the CPU kind the suite simulates: 0 = no native bf16 (AVX2), 1 = AVX512-BF16/AMX, "
        "probe = this machine's own answer (default 0)",
    )


def pytest_configure(config):
    # Session-wide, before any fixture (module-scoped targets are loaded under it too).
    answer = config.getoption("--native-bf16")
    if answer == "probe":
        os.environ.pop(NATIVE_BF16_ENV, None)
    else:
        os.environ[NATIVE_BF16_ENV] = answer


@pytest.fixture(params=[False, True], ids=["cpu-fp32", "cpu-bf16"])
def cpu_native_bf16(request, monkeypatch) -> bool:
    """Run the test once as on a CPU without native bf16 and once as on one with it."""
    monkeypatch.setenv(NATIVE_BF16_ENV, "1" if request.param else "0")
    return request.param


CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# SmolLM2/Qwen-style ChatML, with SmolLM2's default system prompt when none is given.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

WORDS = (
    "system user assistant You are a helpful Hello Hi there How is it going Fine thanks "
    "Tell me joke no Bye see you what 2 + 3 5 ? ! . , 0 1 4 6 7 8 9 long text word"
).split()


def word_tokenizer(specials: list[str], template: str | None, bos: str | None = None):
    """WordLevel tokenizer: words, single punctuation and whitespace runs are tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {}
    for w in ["[UNK]", *specials, " ", "\n", "\n\n", *WORDS]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+|\w+|[^\w\s]"), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token=bos, pad_token=specials[0]
    )
    fast.add_special_tokens({"additional_special_tokens": specials})
    fast.chat_template = template
    return fast


@pytest.fixture(scope="session")
def chatml_tokenizer():
    return word_tokenizer(CHATML_SPECIALS, CHATML_TEMPLATE)


@pytest.fixture(scope="session")
def llama3_tokenizer():
    return word_tokenizer(LLAMA3_SPECIALS, LLAMA3_TEMPLATE, bos="<|begin_of_text|>")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add sync cost (and CI boxes are small)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def memorised(tmp_path_factory):
    """A drafter memorised on a few embedded conversations (tests/memorised.py), trained once per
    session for every test that needs one."""
    from memorised import memorise

    return memorise(tmp_path_factory.mktemp("memorise"))
