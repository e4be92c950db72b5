"""Features captured while the target writes the answers (pipeline/feature_cache.py:
CapturedFeatures, FeatureCache.adopt): equal to a separate prefill, used only by samples whose
ids are exactly the generated ones, and a first epoch that then trains as a prefill would with
no target forward for those samples."""

import json

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from dflash_trainer.config import SamplingConfig
from dflash_trainer.data.chat import Rendering, TokenizedDataset, build_dataset
from dflash_trainer.data.generate import decode_batch, generate_responses
from dflash_trainer.data.sources import load_sources
from dflash_trainer.decode.loop import decode
from dflash_trainer.pipeline.feature_cache import CapturedFeatures, FeatureCache, capture_for
from dflash_trainer.pipeline.steps import TargetStep
from dflash_trainer.run import train
from test_generate import Prompt, char_tokenizer
from tiny import tiny_config, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

# fp32 rounding: a GEMM's result depends on its row count (CPU kernels block the reduction
# differently: decode/loop.py's one-token and block forwards against the KV cache, a padded
# batch), so only a same-shape computation agrees in every bit. Each reordered reduction moves an
# entry by a few ulp of the largest terms summed (K <= 128 here): 1e-5 of the features' largest
# value is ~80 ulp of it, far below what one wrong token changes (O(1) relative).
ROUNDING = 1e-5


def _rounding(ref: torch.Tensor) -> dict:
    return dict(rtol=ROUNDING, atol=ROUNDING * float(ref.abs().max()))


def chat_target():
    """The tiny target with the ChatML character tokenizer; its head never picks the ids that do
    not survive decode -> text -> ids (pad, <|im_start|>, the <fNN> fillers), so every answer
    round-trips unless a test changes it."""
    t = tiny_target(tokenizer=char_tokenizer())
    model = t.model
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[[0, 1]] = -1e4
        head.bias[99:] = -1e4
    model.lm_head = head.requires_grad_(False)
    t.lm_head = head
    return t


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 99, (n,), generator=g).tolist()


def test_captured_taps_equal_a_separate_prefill_bit_for_bit_where_shapes_agree():
    target = chat_target()
    step = TargetStep(target, torch.device("cpu"), torch.float32)  # training's capture path
    p = _prompt(20, 0)
    cap = CapturedFeatures(1 << 30, target.dtype, target.layer_ids)
    (row, stopped), = decode_batch(target, [p], 16, None, [0], 0, capture=cap)  # fmt: skip
    ids = p + row + ([2] if stopped else [])
    got = cap.get(ids)
    assert got is not None and got.shape[0] == len(ids)

    def prefill(x):
        return target.features(torch.tensor([x]), step._causal_mask(len(x)))[0]

    # the prompt's taps are its prefill's: the same computation, bit for bit
    assert_close(got[: len(p)], prefill(p), rtol=0, atol=0)
    # the answer's come from one-token forwards against the KV cache: fp32 rounding
    full = prefill(ids)
    assert_close(got, full, **_rounding(full))
    # rows of a left-padded batch (other shapes again) and their keys: exactly their own ids
    rows = [_prompt(9, 1), _prompt(15, 2), p]
    batch = decode_batch(target, rows, 12, None, [0, 0, 0], 0, capture=cap)
    for r, (new, stopped) in zip(rows, batch):
        ids = r + new + ([2] if stopped else [])
        full = prefill(ids)
        assert_close(cap.get(ids), full, **_rounding(full))
        assert cap.get(ids[:-1]) is None  # a prefix is another key


def _dataset(samples):
    """TokenizedDataset of (ids, first supervised, end of supervised) samples."""
    masks = []
    for ids, start, end in samples:
        m = np.zeros(len(ids), np.uint8)
        m[start:end] = 1
        masks.append(m)
    return TokenizedDataset([s[0] for s in samples], masks, [f"s{i}" for i in range(len(masks))])


def test_adopt_matches_exact_ids_through_the_last_supervised_token():
    target = chat_target()
    p = _prompt(12, 3)
    res = decode(target, [p], 10, keep_features=True)[0]
    gen = p + res.tokens
    cap = CapturedFeatures(1 << 30, target.dtype, target.layer_ids)
    cap.add(gen, res.features)
    other = list(gen)
    other[len(p) + 2] = 4 if other[len(p) + 2] != 4 else 5  # re-tokenised differently
    n = len(gen)
    ds = _dataset(
        [
            (gen + [3], len(p), n),  # the template's "\n" after the turn: unsupervised, uncovered
            (other + [3], len(p), n),
            (gen, len(p), n),
            (gen[:-1] + [7], len(p), n),  # its last supervised token differs
            (gen + [3], len(p), n + 1),  # supervised past the generated ids
        ]
    )
    cache = FeatureCache(ds.lengths, 1 << 30)
    cache.adopt(ds, cap, target, False, torch.float32)
    assert len(cap) == 0  # handed over
    assert sorted(cache._store) == [0, 2] and cache.captured == 2 and cache.capture_misses == 3
    assert cache._store[0][0].shape[0] == n and cache._store[0][1] is None
    assert "2 samples captured while generating, 3 prefilled" in cache.summary()
    # not what training's target computes: nothing adopted, and the reason is logged
    for why, tgt, final in [
        ("final hidden", target, True),
        ("computes in torch.bfloat16", target.cast(torch.bfloat16), False),
    ]:
        cap.add(gen, res.features)
        assert why in cap.unusable(tgt, final)
        other_cache = FeatureCache(ds.lengths, 1 << 30)
        other_cache.adopt(ds, cap, tgt, final, torch.float32)
        assert len(other_cache) == 0 and len(cap) == 0
    # the budget holds, at capture and at adoption
    small = CapturedFeatures(res.features.numel() * 4 - 1, target.dtype, target.layer_ids)
    small.add(gen, res.features)
    assert len(small) == 0 and small.full


class _Recording:
    """A target whose features() calls record the rows they ran."""

    def __init__(self, inner):
        self.inner, self.rows = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def features(self, ids, *args, **kw):
        self.rows += [tuple(r) for r in ids.tolist()]
        return self.inner.features(ids, *args, **kw)


def _ran(target: _Recording, ids) -> bool:
    ids = tuple(int(x) for x in ids)
    return any(r[: len(ids)] == ids for r in target.rows)


def test_generate_with_capture_then_train_one_epoch_without_prefilling_captured_samples(
    tmp_path,
):
    target = chat_target()
    prompts = [
        Prompt(f"p{i}", [{"role": "user", "content": "abcdefgh"[i:] + "xyz" * (i % 3)}])
        for i in range(8)
    ]
    cfg = tiny_config(tmp_path, **{"pipeline.feature_cache_gb": 1.0})
    cap = capture_for(cfg, target)  # on by default where there is a feature cache
    assert (
        capture_for(tiny_config(tmp_path / "none", **{"pipeline.feature_cache_gb": 0}), target)
        is None
    )
    assert cap is not None
    out = tmp_path / "answers.jsonl"
    generate_responses(
        target,
        prompts,
        out,
        max_new_tokens=24,
        batch_size=3,
        sampling=SamplingConfig(temperature=1.0),
        progress=False,
        capture=cap,
    )
    assert len(cap) == len(prompts)
    # (sampled: greedy, the tiny model repeats one token) one answer edited after generation:
    # its ids are not the generated ones any more
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    recs[0]["messages"][-1]["content"] += "!"
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    convs, _ = load_sources([str(out)])
    ds = build_dataset(cfg.data, target.tokenizer, convs, tmp_path / "tok", Rendering(), False)
    assert len(ds) == len(prompts)
    edited = ds.ids.index(recs[0]["id"])
    losses, runs = {}, {}
    for arm in ("prefill", "capture"):
        rec = _Recording(target)
        c = tiny_config(
            tmp_path / arm,
            **{
                "pipeline.feature_cache_gb": 1.0,
                "optim.epochs": 1,
                "batching.max_batch_size": 1,  # one sample per batch: prefills are per sample
                "target.check_taps": False,
            },
        )
        res = train(c, target=rec, train_set=ds, captured=cap if arm == "capture" else None)
        losses[arm] = torch.tensor([m["loss"] for _, m in res.history])
        runs[arm] = (rec, res)
    rec, res = runs["capture"]
    assert "7 samples captured while generating, 1 prefilled" in res.balance
    for i, ids in enumerate(ds.input_ids):
        assert _ran(runs["prefill"][0], ids)
        assert _ran(rec, ids) == (i == edited), i  # captured samples: no target forward
    assert len(losses["capture"]) == len(losses["prefill"]) >= len(prompts)
    assert_close(losses["capture"], losses["prefill"], rtol=ROUNDING, atol=ROUNDING)
