"""The family x vLLM matrix: for every target family vLLM 0.32's CPU build serves a DFlash drafter
beside, a tiny random target (tests/families.py, SERVED_SHAPE), a drafter memorised on the
target's greedy answers to a few prompts through the real training path (`generate` writes the
answers, `train` trains and exports, as tests/memorised.py does for SmolLM2), and its export served
by vLLM (models/vllm_engine.py, eval/served.py, float32): vLLM's tau must equal the project's loop
(eval.evaluation.evaluate) within eval/parity.py's PARITY_TOLERANCE, and vLLM's output must be
identical to plain greedy decoding (the answers `generate` wrote, which our loop's output must
equal too). A negative control serves the same export with its RoPE altered by hand in config.json
(a plain RoPE's base 100x smaller; a scaled one's scaling dropped), once per RoPE form (CONTROLS):
vLLM's tau must drop clearly, so the match is evidence that vLLM applies the RoPE the export
declares, not a coincidence. Llama 3's `llama3` and gpt-oss's YaRN are trained with
`--drafter.rope=target`: the scaled RoPE the export declares is what vLLM serves.

Which families (read in .venv-vllm, vLLM 0.32.0): vLLM feeds a DFlash drafter the target's
auxiliary hidden states, which only a target class implementing `SupportsEagle3` gives
(v1/worker/gpu_model_runner.py `_setup_eagle3_aux_hidden_state_outputs`, called by the CPU runner
v1/worker/cpu_model_runner.py `load_model`, raises "Model does not support EAGLE3 interface"
otherwise). Llama (Mistral and Phi-3 subclass it), Qwen2, Qwen3, Qwen3-MoE and gpt-oss implement
it; Gemma 3 does not (model_executor/models/gemma3.py `Gemma3ForCausalLM(nn.Module, SupportsLoRA,
SupportsPP)`): vLLM refuses its export, and the project's export says so (models/export.py
serving_note). A target with sliding and full layers (gpt-oss) is served only where the drafter's
layers fall in one KV cache group (test_vllm_refuses_a_drafter_split_over_kv_cache_groups).

Sizing (2 cores): vLLM's CPU attention takes head sizes 32, 64, 80, ... only
(v1/attention/backends/cpu_attn.py get_supported_head_sizes), hence 2 heads x 32; weights drawn
with std 0.3 so that a random target's greedy answers vary (at 0.02 they repeat one token, which
any drafter predicts); the output rows of ids 0-4 damped so that no answer holds <pad>, <s>, </s>,
a newline or a space, and no prompt holds whitespace: an answer decoded to text and tokenized
again is then the same ids, so the drafter trains on exactly what it decodes (decoding drops
special ids and cleans up spaces before punctuation, and transformers 5 loads a qwen2 directory's
tokenizer as its byte-level Qwen2Tokenizer, which drops whitespace this character vocabulary has
no byte symbol for and then misplaces the offsets that decide which tokens are supervised). A
drafter of 2 layers, block 8, memorises 6 answers x 32 tokens in 300 steps (the loss reaches 0
by step ~250): tau 7.75, the most 32 tokens allow.

vLLM runs with its engine core in the worker's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the same
scheduler, model runner and kernels, without the two extra processes that each import vLLM again
(measured on a tiny target: a worker of ~22 s becomes ~11 s, most of it importing vLLM; the
engine's own start is 3-5 s). tests/test_vllm_parity.py serves with vLLM's default process layout.
One engine per family (two where it has the negative control); vLLM's plain greedy decoding is
not run: the answers `generate` wrote are the greedy reference.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dflash_trainer.config_io import load_config
from dflash_trainer.data.chat import Rendering
from dflash_trainer.data.generate import generate_responses
from dflash_trainer.data.sources import Conversation
from dflash_trainer.errors import UserError
from dflash_trainer.eval.evaluation import evaluate
from dflash_trainer.eval.parity import PARITY_TOLERANCE, check_parity
from dflash_trainer.eval.served import served_evaluate
from dflash_trainer.models.export import load_drafter
from dflash_trainer.models.target import TargetModel
from dflash_trainer.models.vllm_engine import VLLMEngine
from dflash_trainer.run import train
from families import SERVED_SHAPE, tiny_family_model
from test_vllm_parity import _show, _vllm_python_or_skip
from tiny import base_tokenizer

# vLLM 0.32 serves a DFlash drafter beside these (module docstring)
SERVED = ("llama", "llama3", "qwen2", "qwen3", "mistral", "phi3", "qwen3_moe", "gpt_oss")
# trained with --drafter.rope=target: the drafter rotates with the target's scaled RoPE (Llama 3's,
# YaRN), which the export declares and vLLM must serve
SCALED = {"llama3", "gpt_oss"}
# the negative control, once per RoPE form an export declares (plain, Llama 3's, YaRN): vLLM builds
# every DFlash draft with the same class from the draft's own config.json whatever the target
# (model_executor/models/qwen3_dflash.py: get_rope(..., rope_parameters=config.rope_parameters)),
# so the target family does not change how the export's RoPE is read
CONTROLS = {"llama", "llama3", "gpt_oss"}
NOT_SERVED = {"gemma3": "Gemma3ForCausalLM"}
# decoder layers of a tiny target where 4 would not do: gpt-oss alternates sliding and full layers,
# and vLLM 0.32 serves a DFlash drafter beside such a target only where the drafter's layers fall
# in one KV cache group (test_vllm_refuses_a_drafter_split_over_kv_cache_groups): 5 + 5 layers
# and a 2-layer drafter do, as gpt-oss-20b's 12 + 12 and a drafter of up to 5 layers do
LAYERS = {"gpt_oss": 10}

# no whitespace in the prompts either (module docstring)
PROMPTS = ["Hello!", "The_cat_sat_on", "def_f(x):", "1+2+3+4", "What_is_it?", "Tell_me"]
NEW_TOKENS = 32
BLOCK = 8
STEPS = 300  # one batch of all answers per step (one epoch)
INIT_STD = 0.3
VOCAB = 98  # the base tokenizer's (tests/tiny.py)
MAX_LEN = 512  # the tiny targets' max_position_embeddings: vLLM's max_model_len
TAU_DROP = 0.8  # the negative control's served tau must fall below this share of the true one


@dataclass
class Memorised:
    family: str
    target: TargetModel  # float32, loaded from model_dir as training loaded it
    model_dir: Path  # the target as vLLM loads it
    prompt_ids: list[list[int]]
    greedy: list[list[int]]  # the target's greedy answers (generate), trained on
    export_dir: Path
    steps: int
    t_train: float  # seconds: generate + train (its export included)


def _save_target(family: str, root: Path, layers: int) -> Path:
    """The tiny target of `family` with the base tokenizer, as a model directory."""
    shape = dict(SERVED_SHAPE, num_hidden_layers=layers)
    model = tiny_family_model(family, vocab=VOCAB, init_std=INIT_STD, **shape)
    with torch.no_grad():  # <pad> <s> </s> newline space never win an argmax (module docstring)
        model.get_output_embeddings().weight[:5] *= 0.01
    out = root / "model"
    model.save_pretrained(out)
    base_tokenizer().save_pretrained(out)
    return out


def memorise_family(family: str, root: Path, steps: int = STEPS, layers: int = 0) -> Memorised:
    """A drafter memorised on the tiny `family` target (`layers` decoder layers, 0 = LAYERS'
    or 4) greedy answers to PROMPTS, through `generate_responses` and `train` (real pipeline,
    export included), all float32."""
    t0 = time.monotonic()
    model_dir = _save_target(family, root, layers or LAYERS.get(family, 4))
    flags = [
        f"--target.model={model_dir}",
        "--target.dtype=float32",
        "--target.taps=1,2",
        "--pipeline.precision=float32",
        "--pipeline.cpu_threads=2",
        "--pipeline.feature_cache_gb=0.5",  # epochs after the first read the taps from memory
        "--pipeline.poll_s=0.05",
        f"--run_dir={root / 'run'}",
        f"--data.cache_dir={root / 'tok'}",
        "--data.format=text",
        "--data.eval_fraction=0",
        "--drafter.num_layers=2",
        f"--drafter.block_size={BLOCK}",
        "--drafter.mask_token_id=0",
        f"--drafter.rope={'target' if family in SCALED else 'plain'}",
        "--objective.num_anchors=32",
        "--batching.num_buckets=1",
        f"--optim.epochs={steps}",
        "--optim.lr=3e-3",
        "--optim.warmup_ratio=0",
        "--checkpoint.export_dtype=float32",
        "--eval.at_end=false",
        "--metrics.wandb=off",
        "--metrics.tensorboard=false",
        "--metrics.console=false",
    ]
    cfg = load_config(None, None, flags)
    target = TargetModel.load(cfg.target, "cpu")
    rendering = Rendering.from_config(cfg)
    convs = [
        Conversation(f"p{i}", [{"role": "user", "content": t}], "prompts")
        for i, t in enumerate(PROMPTS)
    ]
    answers = root / "answers.jsonl"
    generate_responses(
        target,
        convs,
        answers,
        max_new_tokens=NEW_TOKENS,
        batch_size=len(convs),
        rendering=rendering,
        progress=False,
    )
    cfg.data.sources = [str(answers)]
    res = train(cfg, target=target)
    ids = [rendering.prompt_ids(target.tokenizer, c.messages) for c in convs]
    written = {r["id"]: r["completion"] for r in map(json.loads, answers.read_text().splitlines())}
    tok = target.tokenizer
    greedy = [tok(written[c.id], add_special_tokens=False)["input_ids"] for c in convs]
    return Memorised(
        family,
        target,
        model_dir,
        ids,
        greedy,
        Path(res.export_dir),
        res.steps,
        time.monotonic() - t0,
    )


def altered_rope(export_dir: Path, out: Path) -> tuple[Path, str]:
    """A copy of the export whose config.json declares another RoPE than trained: a scaled one
    loses its scaling, a plain one gets a base 100x smaller. Returns (the copy, what changed)."""
    shutil.copytree(export_dir, out)
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    theta = float(cfg["rope_theta"])
    kind = (cfg.get("rope_parameters") or {}).get("rope_type", "default")
    if kind != "default":
        what = f"{kind} scaling dropped (plain RoPE at base {theta:g})"
    else:
        what = f"RoPE base {theta:g} -> {theta / 100:g}"
        theta /= 100
    cfg.update(
        rope_theta=theta,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        rope_scaling=None,
    )
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return out, what


def _engine(python, m: Memorised) -> VLLMEngine:
    return VLLMEngine(
        python, str(m.model_dir), dtype="float32", max_model_len=MAX_LEN, kv_cache_gb=1, threads=2
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", SERVED)
def test_vllm_serves_the_family_as_trained(family, tmp_path, monkeypatch, capsys):
    python = _vllm_python_or_skip()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # module docstring
    t0 = time.monotonic()
    m = memorise_family(family, tmp_path)
    exported = json.loads((m.export_dir / "config.json").read_text())
    drafter = load_drafter(m.export_dir, "cpu", torch.float32)
    with torch.inference_mode():  # no AR baseline: the greedy answers written are the baseline
        ours = evaluate(
            m.target,
            drafter,
            m.prompt_ids,
            NEW_TOKENS,
            BLOCK,
            baseline=False,
            warmup=False,
            progress=False,
        )
    engine = _engine(python, m)
    stop = list(m.target.eos_token_ids)
    served = served_evaluate(
        engine, m.export_dir, m.prompt_ids, NEW_TOKENS, BLOCK, stop, baseline=False
    )
    s = served.summary
    control = ""
    if family in CONTROLS:
        wrong_dir, what = altered_rope(m.export_dir, tmp_path / "altered-rope")
        wrong = served_evaluate(
            engine, wrong_dir, m.prompt_ids, NEW_TOKENS, BLOCK, stop, baseline=False
        )
        control = f"; negative control ({what}): served tau {wrong.summary.tau:.3f}"
    rope = exported["rope_parameters"]
    _show(
        capsys,
        f"\n{family} ({m.target.model.config.architectures[0]}, drafter RoPE {rope}): vLLM "
        f"{served.vllm_version} on {len(m.prompt_ids)} memorised prompts x {NEW_TOKENS} tokens, "
        f"block {BLOCK}: served tau {s.tau:.3f} (vLLM mean acceptance length "
        f"{served.mean_acceptance_length:.3f}), project tau {ours.tau:.3f}; per prompt served "
        f"{[round(t, 2) for t in served.taus]} vs project "
        f"{[round(r.tau, 2) for r in ours.spec_results]}; served = plain greedy on "
        f"{sum(r.tokens == g for r, g in zip(s.spec_results, m.greedy))} of {len(m.greedy)}"
        f"{control}; {m.steps} steps, generate + train {m.t_train:.0f} s, engine start "
        f"{served.startup_s:.0f} s, test {time.monotonic() - t0:.0f} s",
    )
    if family in SCALED:  # the export declares the target's scaling, which vLLM served
        assert rope["rope_type"] == m.target.model.config.rope_parameters["rope_type"] != "default"
    assert all(len(g) == NEW_TOKENS for g in m.greedy)  # each answer round-tripped whole
    assert [r.tokens for r in ours.spec_results] == m.greedy  # our loop: lossless
    assert ours.tau > 3.0, ours.tau  # memorised: parity at high acceptance
    assert [r.tokens for r in s.spec_results] == m.greedy  # vLLM: plain greedy decoding's output
    assert abs(s.tau - ours.tau) <= PARITY_TOLERANCE * ours.tau, (s.tau, ours.tau)
    check_parity(ours, served, drafter.config, engine.target)  # the gate agrees: no error
    if family in CONTROLS:  # still lossless (vLLM verifies), but its drafts are rejected
        assert [r.tokens for r in wrong.summary.spec_results] == m.greedy
        assert wrong.summary.tau < TAU_DROP * s.tau, (what, wrong.summary.tau, s.tau)


@pytest.mark.timeout(300)
@pytest.mark.xfail(
    strict=True,
    raises=UserError,
    reason="vLLM 0.32.0 serves a DFlash drafter only where all its layers fall in one KV cache "
    "group: v1/spec_decode/llm_base_proposer.py validate_same_kv_cache_group asserts it at engine "
    "start ('All drafting layers should belong to the same kv cache group'). Beside a target with "
    "sliding and full layers, v1/core/kv_cache_utils.py _get_kv_cache_groups_uniform_page_size "
    "cuts each attention type's layers into groups of the smaller type's count (unless the larger "
    "holds under 1.5x as many) and deals them round-robin (layers[i::n]): the drafter's 2 full "
    "layers beside 2 sliding + 2 full target layers (4 full >= 1.5 x 2 sliding) land in two "
    "groups. Strict: a vLLM that serves it makes this pass, and the marker must go",
)
def test_vllm_refuses_a_drafter_split_over_kv_cache_groups(tmp_path, monkeypatch):
    """gpt-oss's alternating sliding / full layers at 2 + 2 with a 2-layer drafter: refused by
    vLLM at engine start (the reason above). gpt-oss-20b's 12 + 12 serve drafters of up to 5
    layers, as the matrix's 5 + 5 serve 2 (LAYERS)."""
    python = _vllm_python_or_skip()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    m = memorise_family("gpt_oss", tmp_path, steps=2, layers=4)
    served = served_evaluate(
        _engine(python, m), m.export_dir, m.prompt_ids[:2], 8, BLOCK, baseline=False
    )
    assert len(served.summary.spec_results) == 2


# ------------------------------------------------------------- what training reads = what is served


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3", "mistral", "llama"])
def test_the_taps_training_reads_keep_the_targets_windows(family):
    """The training step's target forward (pipeline/steps.py TargetStep: its prepared causal
    mask, or none) gives the taps the target's own forward gives, past its sliding windows too:
    what the decode loop and every engine compute. A prepared causal mask replaced the windows
    of gpt-oss, Gemma 3 and Mistral in training (models/target.py takes_4d_mask)."""
    from dflash_trainer.pipeline.steps import TargetStep

    window = {"mistral": {"sliding_window": 8}}.get(family, {})  # gpt-oss and Gemma 3: 8 already
    model = tiny_family_model(family, vocab=VOCAB, **window)
    target = TargetModel.from_hf(model, base_tokenizer(), [1, 2])
    step = TargetStep(target, torch.device("cpu"), torch.float32)
    ids = torch.randint(5, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        feats = target.features(ids, step._causal_mask(ids.shape[1]))
        hs = model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(feats, torch.cat([hs[2], hs[3]], dim=-1))


# ----------------------------------------------------------------- families vLLM does not serve


@pytest.mark.parametrize("family", sorted(NOT_SERVED))
def test_an_export_vllm_cannot_serve_says_so(family, tmp_path, caplog):
    """The training run's export warns that no engine serves it, and so does `export`."""
    from dflash_trainer.commands.export import export

    arch = NOT_SERVED[family]
    with caplog.at_level(logging.WARNING, logger="dflash_trainer"):
        m = memorise_family(family, tmp_path, steps=2)
    said = [r.getMessage() for r in caplog.records if "no engine serves it" in r.getMessage()]
    assert len(said) == 1 and f"the target ({arch}) is not a class vLLM serves" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash_trainer"):
        export(m.export_dir.parent, tmp_path / "out")  # the run directory: its checkpoint
    assert f"the target ({arch})" in caplog.text and "no engine serves it" in caplog.text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", sorted(NOT_SERVED))
def test_vllm_refuses_what_export_says_it_cannot_serve(family, tmp_path, monkeypatch):
    """vLLM given that export anyway refuses it for the reason the warning gives: the target
    class hands no auxiliary hidden states to a drafter. A vLLM that serves it fails this test,
    and the warning (models/export.py VLLM_DFLASH_TARGETS) must go."""
    python = _vllm_python_or_skip()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    m = memorise_family(family, tmp_path, steps=2)
    with pytest.raises(UserError, match="does not support EAGLE3 interface"):
        served_evaluate(_engine(python, m), m.export_dir, m.prompt_ids[:1], 4, BLOCK)
