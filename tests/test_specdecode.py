"""Speculative decoding loop: lossless vs AR and HF generate, acceptance bookkeeping, sampling,
metrics, and parity with the reference `dflash_generate` (CPU, fp32, tiny random models)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from decoding import ar_generate, draw_seed, spec_generate
from dflash_trainer.config import SamplingConfig
from dflash_trainer.data.chat import Rendering
from dflash_trainer.decode import sampler as smp
from dflash_trainer.decode.draft import AdaptiveVerify
from dflash_trainer.decode.loop import GenResult
from dflash_trainer.eval import prompts as pr
from dflash_trainer.eval.evaluation import evaluate
from dflash_trainer.eval.metrics import position_acceptance, summarize
from dflash_trainer.models.target import TargetModel

V, H = 128, 64
LAYER_IDS = [0, 2]


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_target(kind: str = "llama", seed: int = 0, layers: int = 4) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.3,  # peaked logits: no near-ties between batched/AR argmax
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    if kind == "llama":
        m = LlamaForCausalLM(LlamaConfig(**common))
    else:
        m = Qwen3ForCausalLM(Qwen3Config(**common))
    return m.eval()


def side(model: nn.Module, layer_ids=LAYER_IDS) -> TargetModel:
    return TargetModel.from_hf(model, None, layer_ids)


def choose_tokens(logits, positions, temperature, top_p, seed):
    """The sampler's tokens at `positions` (one seed for all)."""
    sampling = SamplingConfig(temperature=temperature, top_p=top_p)
    return smp.choose(sampling, logits, torch.tensor(list(positions)), seed)


def full_taps(model: nn.Module, ids: torch.Tensor, layer_ids=LAYER_IDS) -> torch.Tensor:
    """Reference features: HF hidden_states[id+1] of one full causal forward."""
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)


class TokenHead(nn.Module):
    """A test 'lm_head' that decodes round(hidden[..., 0]) as the token id."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return -((torch.arange(V, dtype=h.dtype) - h[..., :1]) ** 2)


class StubCache:
    def __init__(self):
        self.length = 0


class OracleDrafter:
    """Drafts the known continuation (tokens at positions P, P+1, ...), each slot wrong with
    probability `p_wrong` (then it drafts true+1 mod V). Also checks that the loop hands it exactly
    the target features of the committed positions, in order, once each."""

    def __init__(
        self,
        continuation,
        prompt_len,
        block_size,
        mask_id=V - 1,
        p_wrong=0.0,
        ref_feats=None,
        seed=0,
    ):
        self.cont, self.P = list(continuation), prompt_len
        self.p_wrong, self.ref = p_wrong, ref_feats
        self.config = SimpleNamespace(
            block_size=block_size, mask_token_id=mask_id, target_layer_ids=list(LAYER_IDS)
        )
        self.rng = random.Random(seed)
        self.calls = []

    def new_cache(self):
        return StubCache()

    def forward_infer(self, block_embeds, new_features, cache, start):
        c = new_features.shape[1]
        if self.ref is not None:
            torch.testing.assert_close(
                new_features, self.ref[:, cache.length : cache.length + c], atol=1e-3, rtol=1e-3
            )  # values ~50
        cache.length += c
        assert cache.length == start
        q = block_embeds.shape[1]
        self.calls.append((start, q))
        out = torch.zeros(1, q, H)
        for k in range(q):
            i = start + k - self.P
            tok = self.cont[i] if i < len(self.cont) else 0
            if k > 0 and self.rng.random() < self.p_wrong:
                tok = (tok + 1) % V
            out[0, k, 0] = tok
        return out

    def propose(self, hidden, lm_head, anchor_ids):
        return lm_head(hidden).argmax(-1)


def run_spec(model, drafter, ids, n, bs, lm_head=None, **kw) -> GenResult:
    t = side(model)
    return spec_generate(
        model, t.layer_ids, t.embed_weight, lm_head or TokenHead(), drafter, ids, n, bs, **kw
    )


def random_prompt(g: torch.Generator, lo=3, hi=20) -> torch.Tensor:
    p = int(torch.randint(lo, hi, (1,), generator=g))
    return torch.randint(1, V - 1, (1, p), generator=g)


# ---------------------------------------------------------------------------------------- sampler


def test_position_noise_is_keyed_and_samples_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    probs = torch.softmax(logits / 0.7, -1)[0]
    # same (seed, position) -> same token; the empirical law over positions matches softmax(l/T)
    a = choose_tokens(logits.expand(4000, 5), range(4000), 0.7, 1.0, seed=5).tolist()
    assert a[:50] == [int(choose_tokens(logits, [t], 0.7, 1.0, seed=5)) for t in range(50)]
    freq = torch.bincount(torch.tensor(a), minlength=5).float() / len(a)
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
    c = choose_tokens(logits.expand(200, 5), range(200), 0.7, 1.0, seed=6).tolist()
    assert c != a[:200]
    # a batch of positions equals the per-position calls
    many = choose_tokens(logits.expand(6, 5), range(10, 16), 0.7, 1.0, seed=5).tolist()
    assert many == a[10:16]


def test_top_p_support_and_greedy():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    toks = {int(choose_tokens(logits, [t], 1.0, 0.6, seed=1)) for t in range(300)}
    assert toks == {0, 1}  # mass of the top two > 0.6, the rest never sampled
    assert int(choose_tokens(logits, [0], 1.0, 0.01, seed=1)) == 0  # top token always kept
    assert int(choose_tokens(logits, [0], 0.0, 1.0, seed=1)) == 0


def test_top_k_samples_the_renormalised_k_most_likely():
    """top_k against a dense reference: only the k most likely tokens, at their softmax shares
    among themselves; top_k then top_p (vLLM's and transformers' order)."""
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0, 1.5]])
    n = 4000
    toks = smp.choose(
        SamplingConfig(temperature=1.0, top_k=3), logits.expand(n, 5), torch.arange(n), 3
    )
    freq = torch.bincount(toks, minlength=5).float() / n
    want = torch.zeros(5)
    want[[1, 2, 4]] = torch.softmax(logits[0, [1, 2, 4]], -1)
    torch.testing.assert_close(freq, want, atol=0.03, rtol=0)
    # k = 3 leaves {1: 0.51, 4: 0.31, 2: 0.19}; top_p 0.6 then keeps the first two
    k3_p06 = SamplingConfig(temperature=1.0, top_p=0.6, top_k=3)
    both = smp.choose(k3_p06, logits.expand(n, 5), torch.arange(n), 3)
    assert set(both.tolist()) == {1, 4}
    assert torch.equal(smp.top_k_logits(logits, 0), logits)  # 0 = off
    with pytest.raises(ValueError, match=r"top_k: -1 is outside the valid range"):
        SamplingConfig(temperature=1.0, top_k=-1)


def test_hash_never_overflows_int64():
    x = torch.tensor([0, 1, 2**32 - 1, 2**31, 12345], dtype=torch.int64)
    y = smp.hash32(x)
    assert bool((y >= 0).all()) and bool((y < 2**32).all())
    assert smp._mul32(torch.tensor([2**32 - 1]), 0xFFFFFFFF).item() == ((2**32 - 1) ** 2) % 2**32
    assert y.tolist() == [smp.hash32_int(int(v)) for v in x]  # tensor and Python forms agree


# ---------------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_spec_equals_ar_and_hf_generate(kind):
    model = tiny_target(kind)
    g = torch.Generator().manual_seed(1)
    n = 20
    for trial in range(4):
        ids = random_prompt(g)
        ar = ar_generate(model, ids, n)
        with torch.no_grad():
            hf = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
        assert ar.tokens == hf[0, ids.shape[1] :].tolist()
        assert ar.acceptance_lengths == [1] * (n - 1)
        ref = full_taps(model, torch.cat([ids, torch.tensor([ar.tokens])], 1))
        for bs in (2, 4, 8, 16):
            for p_wrong in (0.0, 0.3, 1.0):
                dr = OracleDrafter(
                    ar.tokens,
                    ids.shape[1],
                    16,
                    p_wrong=p_wrong,
                    ref_feats=ref,
                    seed=trial * 100 + bs,
                )
                res = run_spec(model, dr, ids, n, bs)
                assert res.tokens == ar.tokens, (kind, trial, bs, p_wrong)
                assert sum(res.acceptance_lengths) == n - 1
                assert all(q <= bs for _, q in dr.calls)
                # the drafter saw every committed position once, in order (checked in the stub);
                # the bonus of the last cycle never reaches it
                assert dr.calls[0][0] == ids.shape[1]


def test_random_stub_drafter_lossless_with_real_lm_head():
    """A drafter with random outputs decoded by the target's real lm_head (mostly rejected)."""

    class RandomDrafter(OracleDrafter):
        def forward_infer(self, block_embeds, new_features, cache, start):
            super().forward_infer(block_embeds, new_features, cache, start)
            return torch.randn(1, block_embeds.shape[1], H)

    model = tiny_target("qwen3", seed=3)
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        ids = random_prompt(g)
        ar = ar_generate(model, ids, 20)
        for bs in (2, 4, 8, 16):
            res = run_spec(
                model,
                RandomDrafter([], ids.shape[1], 16),
                ids,
                20,
                bs,
                lm_head=model.get_output_embeddings(),
            )
            assert res.tokens == ar.tokens


# ------------------------------------------------------------------- acceptance bookkeeping


@pytest.mark.parametrize("bs,n", [(4, 24), (8, 24), (16, 40), (16, 17), (2, 2)])
def test_always_agree_gives_tau_block_size(bs, n):
    model = tiny_target("llama")
    ids = torch.tensor([[5, 17, 42, 9]])
    ar = ar_generate(model, ids, n)
    res = run_spec(model, OracleDrafter(ar.tokens, 4, 16), ids, n, bs)
    full, rest = divmod(n - 1, bs)
    assert res.acceptance_lengths == [bs] * full + ([rest] if rest else [])
    assert res.tokens == ar.tokens
    if full:
        assert res.tau >= bs * full / (full + 1)
    s = summarize([res], None, bs)
    assert s.position_acceptance == [1.0] * (bs - 1)


def test_never_agree_gives_tau_one():
    model = tiny_target("llama")
    ids = torch.tensor([[5, 17, 42, 9]])
    ar = ar_generate(model, ids, 20)
    res = run_spec(model, OracleDrafter(ar.tokens, 4, 16, p_wrong=1.0), ids, 20, 8)
    assert res.acceptance_lengths == [1] * 19
    assert res.tau == 1.0 and res.tokens == ar.tokens
    s = summarize([res], [ar], 8)
    assert s.position_acceptance == [0.0] * 7 and s.histogram[0] == 1.0 and s.outputs_match == 1.0


def test_stop_id_truncates_by_position_and_mask_id_tokens_survive():
    model = tiny_target("llama")
    ids = torch.tensor([[5, 17, 42, 9]])
    ar = ar_generate(model, ids, 30)
    stop = ar.tokens[12]
    cut = ar.tokens.index(stop) + 1
    # the MASK id equals a token the target really emits: it must stay in the output (pitfall 14)
    mask = ar.tokens[3]
    res = run_spec(
        model, OracleDrafter(ar.tokens, 4, 16, mask_id=mask), ids, 30, 8, stop_ids=[stop]
    )
    assert res.stopped and res.tokens == ar.tokens[:cut]
    assert sum(res.acceptance_lengths) == cut - 1
    ar_stop = ar_generate(model, ids, 30, stop_ids=[stop])
    assert ar_stop.tokens == res.tokens


def test_edge_limits():
    model = tiny_target("llama")
    ids = torch.tensor([[5, 17]])
    dr = OracleDrafter([], 2, 16)
    assert run_spec(model, dr, ids, 0, 8).tokens == []
    one = run_spec(model, dr, ids, 1, 8)
    assert len(one.tokens) == 1 and one.acceptance_lengths == []
    with pytest.raises(ValueError, match="block size"):
        run_spec(model, OracleDrafter([], 2, 4), ids, 5, 8)
    bad = OracleDrafter([], 2, 16)
    bad.config.target_layer_ids = [1, 3]
    with pytest.raises(ValueError, match="target layers"):
        run_spec(model, bad, ids, 5, 8)


# ------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_sampling_every_token_is_the_targets_sample(kind):
    model = tiny_target(kind, seed=2)
    g = torch.Generator().manual_seed(3)
    for trial in range(4):
        ids = random_prompt(g)
        ar = ar_generate(
            model,
            ids,
            24,
            temperature=0.9,
            top_p=0.95,
            generator=torch.Generator().manual_seed(trial),
        )
        greedy = ar_generate(model, ids, 24)
        assert ar.tokens != greedy.tokens  # really sampling
        for bs, p_wrong in ((4, 0.0), (8, 0.3), (16, 1.0)):
            dr = OracleDrafter(ar.tokens, ids.shape[1], 16, p_wrong=p_wrong)
            res = run_spec(
                model,
                dr,
                ids,
                24,
                bs,
                temperature=0.9,
                top_p=0.95,
                generator=torch.Generator().manual_seed(trial),
            )
            assert res.tokens == ar.tokens
            assert res.tau >= 1.0
            if p_wrong == 0.0:
                assert res.acceptance_lengths[0] == bs
        # a different seed gives a different sample
        other = ar_generate(
            model,
            ids,
            24,
            temperature=0.9,
            top_p=0.95,
            generator=torch.Generator().manual_seed(trial + 50),
        )
        assert other.tokens != ar.tokens


def test_sampling_matches_naive_no_cache_loop():
    """Reference: recompute the whole sequence each step (no KV cache) and sample the token at
    absolute position t with the key t. Pins the position keys, not just spec/AR agreement."""
    model = tiny_target("qwen3", seed=9)
    ids = torch.tensor([[7, 8, 9, 10, 11]])
    seed = draw_seed(torch.Generator().manual_seed(4))
    seq = ids
    for _ in range(12):
        with torch.no_grad():
            logits = model(seq).logits[0, -1:]
        tok = choose_tokens(logits, [seq.shape[1]], 0.8, 0.9, seed)
        seq = torch.cat([seq, tok.view(1, 1)], 1)
    want = seq[0, ids.shape[1] :].tolist()
    ar = ar_generate(model, ids, 12, 0.8, 0.9, generator=torch.Generator().manual_seed(4))
    assert ar.tokens == want
    dr = OracleDrafter(want, ids.shape[1], 16, p_wrong=0.3)
    res = run_spec(
        model,
        dr,
        ids,
        12,
        4,
        temperature=0.8,
        top_p=0.9,
        generator=torch.Generator().manual_seed(4),
    )
    assert res.tokens == want


def test_sampled_tokens_lie_in_top_p_support():
    model = tiny_target("llama", seed=4)
    ids = torch.tensor([[3, 4, 5, 6]])
    res = ar_generate(
        model, ids, 16, temperature=1.5, top_p=0.5, generator=torch.Generator().manual_seed(0)
    )
    seq = torch.cat([ids, torch.tensor([res.tokens])], 1)
    with torch.no_grad():
        logits = model(seq).logits[0, ids.shape[1] - 1 : -1] / 1.5
    probs = torch.softmax(logits, -1)
    for row, tok in zip(probs, res.tokens):
        sp, order = row.sort(descending=True)
        support = order[(sp.cumsum(0) - sp) < 0.5].tolist()
        assert tok in support


# -------------------------------------------------------------------------------- metrics


def test_summarize_conventions():
    def r(lengths, accepted, sizes, toks, t):
        return GenResult(
            tokens=toks,
            acceptance_lengths=lengths,
            accepted_drafts=accepted,
            block_sizes=sizes,
            decode_time=t,
        )

    a = r([4, 1, 2], [3, 0, 1], [4, 4, 4], [1] * 8, 0.8)
    b = r([3], [3], [4], [1] * 4, 0.2)  # last cycle clipped: a=3 but 3 committed
    empty = r([], [], [], [1], 0.01)  # stopped at the prefill token
    s = summarize(
        [a, b, empty],
        [
            r([1] * 7, [0] * 7, [1] * 7, [1] * 8, 1.6),
            r([1] * 3, [0] * 3, [1] * 3, [2] * 4, 0.8),
            r([], [], [], [1], 0.02),
        ],
        4,
    )
    assert s.tau == pytest.approx((7 / 3 + 3) / 2)  # per response, then mean
    assert s.tau_token_weighted == pytest.approx(10 / 4)
    assert s.histogram == [0.25, 0.25, 0.25, 0.25]
    assert s.position_acceptance == pytest.approx([3 / 4, 2 / 4, 2 / 4])
    assert s.speedup == pytest.approx(((1.6 / 8 + 0.8 / 4 + 0.02) / 3) / ((0.1 + 0.05 + 0.01) / 3))
    assert s.outputs_match == pytest.approx(2 / 3) and s.lossless is False
    json.dumps(s.to_dict())
    assert position_acceptance([1, 0], [2, 3], 4) == [0.5, 0.0, 0.0]


def test_evaluate_with_and_without_baseline():
    model = tiny_target("llama")
    t = side(model)
    prompts = [[5, 17, 42, 9], [3, 3, 8]]
    conts = {len(p): ar_generate(model, torch.tensor([p]), 12).tokens for p in prompts}

    class Multi(OracleDrafter):  # picks the continuation of whichever prompt is running
        def forward_infer(self, block_embeds, new_features, cache, start):
            if cache.length == 0:
                self.P = new_features.shape[1]
                self.cont = conts[self.P]
            return super().forward_infer(block_embeds, new_features, cache, start)

    t.lm_head = TokenHead()
    s = evaluate(t, Multi([], 0, 16), prompts, 12, 4)
    assert s.num_responses == 2 and s.lossless is True
    assert s.tau == pytest.approx(11 / 3)  # [4, 4, 3] per prompt
    assert s.speedup is not None and s.speedup > 0 and s.ar_tpot > 0
    q = evaluate(t, Multi([], 0, 16), prompts, 12, 4, baseline=False, warmup=False)
    assert q.tau == pytest.approx(11 / 3) and q.num_responses == 2 and q.speedup is None


# ------------------------------------------------------------------------ the real drafter


def _real_drafter(model, block_size=8, mask_id=V - 1, seed=0):
    drafter_mod = pytest.importorskip("dflash_trainer.models.drafter")
    cfg = drafter_mod.DFlashConfig(
        hidden_size=H,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        block_size=block_size,
        target_layer_ids=list(LAYER_IDS),
        num_target_layers=model.config.num_hidden_layers,
        mask_token_id=mask_id,
        vocab_size=V,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        init_std=0.2,
    )
    torch.manual_seed(seed)
    return drafter_mod.DFlashDrafter(cfg).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_real_drafter_random_init_lossless(kind):
    model = tiny_target(kind, seed=5)
    drafter = _real_drafter(model, block_size=16)
    t = side(model)
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        ids = random_prompt(g)
        ar = ar_generate(model, ids, 24)
        for bs in (2, 4, 8, 16):
            res = spec_generate(model, t.layer_ids, t.embed_weight, t.lm_head, drafter, ids, 24, bs)
            assert res.tokens == ar.tokens
            assert 1.0 <= res.tau <= bs


def _trained_drafter(model, prompts, block_size=8, steps=400):
    """Overfit a real drafter on the target's own greedy continuations of `prompts` (a few
    seconds), so the reference comparison sees a mix of accepted and rejected drafts."""
    import torch.nn.functional as F

    drafter = _real_drafter(model, block_size=block_size, seed=1).train()
    seqs = []
    for ids in prompts:
        s = torch.cat([ids, torch.tensor([ar_generate(model, ids, 24).tokens])], 1)
        seqs.append((s, full_taps(model, s), ids.shape[1]))
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        s, f, p_len = seqs[step % len(seqs)]
        p = int(torch.randint(p_len - 1, s.shape[1] - block_size, (1,), generator=g))
        blk = torch.full((1, block_size), V - 1)
        blk[0, 0] = s[0, p]
        h = drafter.forward_infer(F.embedding(blk, emb), f[:, :p], drafter.new_cache(), p)
        loss = F.cross_entropy(head(h[0, 1:]), s[0, p + 1 : p + block_size])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def greedy_continuations(model, g: torch.Generator, n: int = 3, new: int = 32) -> list:
    """(prompt ids, prompt + the target's greedy continuation, its loss mask, the tapped
    features) for `n` random prompts: data a drafter can memorise through the objective."""
    data = []
    for _ in range(n):
        ids = random_prompt(g, 6, 12)
        s = torch.cat([ids, torch.tensor([ar_generate(model, ids, new).tokens])], 1)
        mask = torch.zeros_like(s, dtype=torch.bool)
        mask[:, ids.shape[1] :] = True  # the continuation is supervised
        data.append((ids, s, mask, full_taps(model, s)))
    return data


@pytest.mark.parametrize("attention", ["split", "dense"])
def test_training_objective_and_inference_agree(attention):
    """End to end: a drafter trained ONLY through the training objective (random anchors, the
    block mask, same-position labels, chunked LM head) is accepted by the inference loop, which
    uses none of that code (KV cache, no mask). A mismatch between the two lowers tau however
    well the training loss falls; next-token labels, context visible at the anchor and a wrong
    mask token were each injected by hand and each fails this test. The on-device simulated
    acceptance must agree with the measured tau too."""
    from dflash_trainer.train.objective import DFlashObjective

    model = tiny_target("llama", seed=3)
    bs = 8
    g = torch.Generator().manual_seed(5)
    data = greedy_continuations(model, g)
    drafter = _real_drafter(model, block_size=bs, seed=2).train()
    obj = DFlashObjective(bs, num_anchors=12, mask_token_id=V - 1, attention=attention)
    emb = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().requires_grad_(False)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    untrained = [run_spec(model, drafter.eval(), ids, 24, bs, lm_head=head).tau for ids, *_ in data]
    drafter.train()
    for step in range(300):
        _, s, mask, feats = data[step % len(data)]
        out = obj(drafter, emb, head, feats, s, mask, g)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    sim = out.metrics[out.metric_names.index("accept_len")].item()
    drafter.eval()
    taus = [run_spec(model, drafter, ids, 24, bs, lm_head=head).tau for ids, *_ in data]
    assert max(untrained) < 1.5
    # Consistent training memorises these three continuations almost whole (tau ~7.7 of 8 here);
    # context visible at the anchor in training drops two of them to ~5.8, next-token labels to 1.
    assert min(taus) > 6.5, taus
    assert abs(sim - sum(taus) / len(taus)) < 0.1 * sim, (sim, taus)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_matches_reference_dflash_generate(kind, tmp_path, monkeypatch):
    """The same drafter, exported and loaded by the reference package, on the same target:
    identical tokens and per-cycle acceptance lengths (so tau agrees), greedy, fp32."""
    export = pytest.importorskip("dflash_trainer.models.export")
    ref = pytest.importorskip("dflash.model")
    import time

    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # return_stats syncs CUDA otherwise
    model = tiny_target(kind, seed=6)
    g = torch.Generator().manual_seed(12)
    prompts = [random_prompt(g) for _ in range(4)]
    drafter = _trained_drafter(model, prompts)
    ref_model = ref.DFlashDraftModel.from_pretrained(
        str(export.export_drafter(drafter, tmp_path / "export")), dtype=torch.float32
    ).eval()
    t = side(model)
    ours_all, ref_all = [], []
    for i, ids in enumerate(prompts):
        for bs in (4, 8):
            stop = [int(torch.randint(1, V, (1,), generator=g))] if i % 2 else None
            r = ref.dflash_generate(
                ref_model, model, ids, 20, stop, block_size=bs, return_stats=True
            )
            ours = spec_generate(
                model,
                t.layer_ids,
                t.embed_weight,
                t.lm_head,
                drafter,
                ids,
                20,
                bs,
                stop_ids=stop or (),
            )
            assert ours.tokens == r.output_ids[0, ids.shape[1] :].tolist()
            assert ours.acceptance_lengths == [int(x) for x in r.acceptance_lengths]
            ours_all.append(ours)
            ref_all.append(
                GenResult(
                    tokens=[],
                    accepted_drafts=[],
                    block_sizes=[],
                    acceptance_lengths=[int(x) for x in r.acceptance_lengths],
                )
            )
    ours_tau, ref_tau = summarize(ours_all, None, 8).tau, summarize(ref_all, None, 8).tau
    assert ours_tau == pytest.approx(ref_tau, rel=0.02)
    assert ours_tau > 1.2  # the comparison covered real acceptances, not only rejections


# ------------------------------------------------------------------------------ eval command


class FakeTokenizer:
    """Chat template + char-level ids; enough for the eval command's plumbing."""

    eos_token_id = None
    chat_template = "<role initial>content ... <a>"  # what apply_chat_template renders

    def __len__(self):
        return V

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, enable_thinking):
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role'][0]}>{m['content']}" for m in messages) + "<a>"

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [1 + ord(c) % (V - 2) for c in text][-48:]}

    def decode(self, ids, skip_special_tokens):
        return "".join(chr(97 + i % 26) for i in ids)


def test_load_prompt_file_errors(tmp_path):
    from dflash_trainer.errors import UserError

    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n'
        '{"conversations": [{"from": "human", "value": "yo"}]}\n'
        '\n{"id": "c", "messages": [{"role": "robot", "content": "hi"}]}\n'
    )
    with pytest.raises(UserError, match=r"p\.jsonl:4: expected"):
        pr.load_prompt_file(f)
    f.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n{bad\n')
    with pytest.raises(UserError, match=r"p\.jsonl:2: invalid JSON"):
        pr.load_prompt_file(f)
    f.write_text(
        '{"conversations": [{"from": "human", "value": "yo"}, {"from": "gpt", "value": "x"}]}\n'
    )
    assert pr.load_prompt_file(f) == [
        ("p.jsonl:1", [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "x"}])
    ]
    with pytest.raises(UserError, match="does not exist"):
        pr.load_prompt_file(tmp_path / "missing.jsonl")


def test_eval_command_end_to_end(tmp_path, monkeypatch, capsys):
    export = pytest.importorskip("dflash_trainer.models.export")
    target_mod = pytest.importorskip("dflash_trainer.models.target")
    from dflash_trainer.config_io import load_config

    model = tiny_target("qwen3", seed=8)
    drafter = _real_drafter(model, block_size=8)
    export.export_drafter(drafter, tmp_path / "run" / "export")
    tm = target_mod.TargetModel.from_hf(model, FakeTokenizer(), list(LAYER_IDS))
    monkeypatch.setattr(target_mod.TargetModel, "load", classmethod(lambda cls, c, d, *_: tm))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps(
            {
                "id": "x",
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hello"},
                    {"role": "assistant", "content": "old answer"},
                    {"role": "user", "content": "more"},
                ],
            }
        )
        + "\n"
        + json.dumps({"id": "y", "messages": [{"role": "user", "content": "write code"}]})
        + "\n"
    )
    cfg = load_config(
        None,
        None,
        [
            f"--run_dir={tmp_path / 'run'}",
            "--eval.max_new_tokens=12",
            "--eval.block_size=4",
            f"--eval.heldout_path={prompts}",
        ],
    )
    cfg.eval.datasets = ["heldout", str(prompts)]
    args = SimpleNamespace(drafter_path=None, output=None)
    from dflash_trainer.commands import eval as eval_command

    assert eval_command.run(cfg, args) == 0
    out = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert set(out["datasets"]) == {"heldout", str(prompts)}
    d = out["datasets"]["heldout"]
    assert d["num_responses"] == 3  # two user turns + one
    assert d["block_size"] == 4 and d["lossless"] is True and d["speedup"] > 0
    assert 1.0 <= d["tau"] <= 4.0 and len(d["position_acceptance"]) == 3
    cycles = sum(v for k, v in out["events"].items() if k.startswith("eval/cycles_ctx/"))
    assert cycles == sum(out["datasets"][k]["num_cycles"] for k in out["datasets"])  # per bucket
    assert "heldout" in capsys.readouterr().out
    # a drafter for other taps is refused with a fix
    from dflash_trainer.errors import UserError

    tm.close()  # the same model, loaded with other taps
    other = target_mod.TargetModel.from_hf(model, FakeTokenizer(), [1, 3])
    monkeypatch.setattr(target_mod.TargetModel, "load", classmethod(lambda cls, c, d, *_: other))
    with pytest.raises(UserError, match="target layers"):
        eval_command.run(cfg, args)


@pytest.mark.slow
def test_smollm2_fp32_random_drafter_lossless():
    """The real embedded target (SmolLM2-135M, fp32) with a random-init drafter through evaluate."""
    target_mod = pytest.importorskip("dflash_trainer.models.target")
    drafter_mod = pytest.importorskip("dflash_trainer.models.drafter")
    from dflash_trainer.config_io import load_config
    from dflash_trainer.errors import UserError

    cfg = load_config("smollm2-cpu", None, ["--target.dtype=float32"])
    try:
        t = target_mod.TargetModel.load(cfg.target, "cpu")
    except UserError as e:
        pytest.skip(f"embedded target unavailable: {e}")
    torch.manual_seed(0)
    drafter = drafter_mod.DFlashDrafter(drafter_mod.DFlashConfig.from_configs(cfg.drafter, t))
    prompts = [
        Rendering().prompt_ids(t.tokenizer, [{"role": "user", "content": q}])
        for q in ("Name three colours.", "Write a haiku about rain.")
    ]
    s = evaluate(t, drafter, prompts, 16, 8, warmup=False)
    assert s.lossless is True and s.num_responses == 2 and 1.0 <= s.tau <= 8.0


# ------------------------------------------------------------------- adaptive verify


def test_adaptive_verify_window():
    w = AdaptiveVerify(15, window=4, margin=2)
    assert w.k == 15  # starts at the whole block
    w.update(1, 15)
    assert w.k == 3  # most accepted lately + margin
    w.update(3, 3)
    assert w.k == 6  # every verified draft accepted: the drafter may reach further
    w.update(6, 6)
    w.update(6, 12)
    assert w.k == 8
    for _ in range(4):
        w.update(0, w.k)
    assert w.k == 2  # the window forgot the long accepts
    for _ in range(5):
        w.update(w.k, w.k)
    assert w.k == 15  # capped at the block


@pytest.mark.parametrize("p_wrong", [0.0, 0.3, 0.7, 1.0])
def test_adaptive_verify_is_lossless_and_verifies_less(p_wrong):
    """Same tokens as plain greedy; cycles verify at most the whole block, and fewer when the
    drafter is often wrong."""
    model = tiny_target("llama")
    ids = torch.tensor([[5, 17, 42, 9]])
    ar = ar_generate(model, ids, 60)
    full = run_spec(model, OracleDrafter(ar.tokens, 4, 16, p_wrong=p_wrong, seed=1), ids, 60, 16)
    ad = run_spec(
        model,
        OracleDrafter(ar.tokens, 4, 16, p_wrong=p_wrong, seed=1),
        ids,
        60,
        16,
        verify="adaptive",
    )
    assert ad.tokens == ar.tokens == full.tokens
    # a cycle verifies at most the whole block; q = 1 is a plain step (the gate, timed)
    assert all(1 <= q <= 16 for q in ad.block_sizes[:-1])
    if p_wrong == 0.0:
        assert ad.acceptance_lengths == full.acceptance_lengths  # never capped
    if p_wrong >= 0.7:
        assert sum(ad.block_sizes) < 0.6 * sum(full.block_sizes)


def test_adaptive_verify_gate_holds_drafting_off_while_plain_steps_are_faster():
    """Seconds per cycle as a 2-core CPU measures them (plain step 17 ms, a drafting cycle
    27 ms): a drafter making 1.37 tokens a cycle is held off, one making 3 is not."""
    w = AdaptiveVerify(15, window=4, backoff=3, max_backoff=8)
    for _ in range(4):  # a drafter that clearly pays: never interrupted, nothing measured
        w.update(3, 4, 0.030)
    assert w.drafts() == 5 and w.step_s is None  # the window's own cap: 3 + margin 2
    w = AdaptiveVerify(15, window=4, backoff=3, max_backoff=8)
    for a in (0, 1, 0, 0):  # fewer than probe_below tokens a cycle: measure a plain step
        assert w.drafts() > 0
        w.update(a, w.drafts(), 0.027)
    for _ in range(3):
        assert w.drafts() == 0
        w.update(0, 0, 0.017)
    assert w.step_s == pytest.approx(0.017) and w.drafts() == 3  # drafting is tried again
    for a in (1, 0, 0, 1):  # 1.5 tokens a cycle in 27 ms against 1 in 17 ms: too close to call
        w.update(a, w.drafts(), 0.027)
    assert w.drafts() == 3
    for a in (1, 0, 0, 0):  # 1.25 tokens a cycle in 27 ms: plain steps win clearly, held off
        w.update(a, w.drafts(), 0.027)
    held = 0
    while w.drafts() == 0:
        w.update(0, 0, 0.017)
        held += 1
    assert held == 3  # the close window above counted as paying: the stretch starts short
    for _ in range(4):  # now it pays (3 tokens in 30 ms): the next hold-off starts short again
        w.update(2, w.drafts(), 0.030)
    assert w.drafts() > 0 and w.backoff == 3


@pytest.mark.parametrize("p_wrong", [0.0, 1.0])
def test_adaptive_verify_plain_stretches_are_lossless_and_feed_the_drafter(monkeypatch, p_wrong):
    """On a clock where the drafter's pass costs more than a plain step (each clock read 1 s,
    the drafter 3 s), a drafter that is always wrong decodes mostly in plain steps, tries
    drafting again after each stretch, and still sees every committed position's features
    once, in order (OracleDrafter checks them against one full forward); one that is always
    right is never held off. Tokens are plain greedy's either way."""
    from dflash_trainer.decode import loop as loop_mod

    now = [0.0]

    def tick(self):
        now[0] += 1.0
        return now[0]

    class CostlyDrafter(OracleDrafter):
        def forward_infer(self, *a, **kw):
            now[0] += 3.0
            return super().forward_infer(*a, **kw)

    monkeypatch.setattr(loop_mod._Clock, "__call__", tick)
    model = tiny_target("llama")
    ids = torch.tensor([[5, 17, 42, 9]])
    ar = ar_generate(model, ids, 120)
    ref = full_taps(model, torch.cat([ids, torch.tensor([ar.tokens])], 1))
    drafter = CostlyDrafter(ar.tokens, 4, 16, p_wrong=p_wrong, ref_feats=ref, seed=1)
    ad = run_spec(model, drafter, ids, 120, 16, verify="adaptive")
    assert ad.tokens == ar.tokens
    qs = ad.block_sizes
    if p_wrong == 0.0:
        full = run_spec(model, OracleDrafter(ar.tokens, 4, 16), ids, 120, 16)
        assert ad.acceptance_lengths == full.acceptance_lengths and 1 not in qs[:-1]
        return
    plain = sum(q == 1 for q in qs)
    assert plain > 2 * (len(qs) - plain), qs  # mostly plain steps
    resumed = [i for i in range(1, len(qs)) if qs[i - 1] == 1 and qs[i] > 1]
    assert len(resumed) >= 2, qs  # drafting was tried again after a stretch, more than once


def test_adaptive_verify_lossless_with_a_real_drafter():
    """A trained drafter through the real LM head: identical tokens to greedy either way."""
    model = tiny_target("qwen3", seed=3)
    g = torch.Generator().manual_seed(11)
    prompts = [random_prompt(g) for _ in range(3)]
    drafter = _trained_drafter(model, prompts, steps=150)
    head = model.get_output_embeddings()
    for ids in prompts:
        ar = ar_generate(model, ids, 24)
        t = side(model)
        ad = spec_generate(
            model, t.layer_ids, t.embed_weight, head, drafter, ids, 24, 8, verify="adaptive"
        )
        assert ad.tokens == ar.tokens


def test_verify_policy_is_checked():
    model = tiny_target("llama")
    with pytest.raises(ValueError, match="verify"):
        run_spec(model, None, torch.tensor([[5, 6]]), 4, 1, verify="some")
