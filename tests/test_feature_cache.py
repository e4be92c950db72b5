"""pipeline/feature_cache.py: later epochs served from host memory, the same features and the
same training as recomputing them, the target run once per sample, a budget that holds."""

import pytest
import torch

from dflash_trainer.errors import UserError
from dflash_trainer.pipeline.feature_cache import FeatureCache
from dflash_trainer.pipeline.messages import WorkItem
from dflash_trainer.pipeline.prefetcher import build_batch
from dflash_trainer.pipeline.steps import TargetStep
from dflash_trainer.run import train
from tiny import tiny_config, tiny_dataset, tiny_target


class _Counting:
    """A target whose features() calls are counted."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def features(self, *args, **kw):
        self.calls += 1
        return self.inner.features(*args, **kw)


def _real(hb, ds, row):
    n = int(ds.lengths[int(hb.sample_ids[row])])
    return hb.features[row, :n], (
        hb.target_hidden[row, :n] if hb.target_hidden is not None else None
    )


@pytest.mark.parametrize("final", [False, True])
def test_a_cached_batch_equals_a_recomputed_one_without_running_the_target(final):
    ds, target = tiny_dataset(), _Counting(tiny_target())
    cache = FeatureCache(ds.lengths, 1 << 30)
    step = TargetStep(target, torch.device("cpu"), torch.float32, final, cache)
    plain = TargetStep(tiny_target(), torch.device("cpu"), torch.float32, final)
    first = step(WorkItem(0, 0, build_batch(ds, [0, 1, 2, 3], 8, 0)))
    assert not first.from_cache and target.calls == 1 and len(cache) == 4
    # another epoch: other rows, another order, another padded length
    batch = build_batch(ds, [3, 0, 2], 8, 0)
    hb = step(WorkItem(1, 1, batch))
    assert hb.from_cache and target.calls == 1
    ref = plain(WorkItem(1, 1, batch))
    assert hb.features.shape == ref.features.shape
    for row in range(3):
        (f, t), (rf, rt) = _real(hb, ds, row), _real(ref, ds, row)
        torch.testing.assert_close(f, rf, rtol=1e-5, atol=1e-5)
        if final:
            torch.testing.assert_close(t, rt, rtol=1e-5, atol=1e-5)
        n = f.shape[0]
        assert (hb.features[row, n:] == 0).all()  # padding: never anchors nor visible context
    torch.testing.assert_close(hb.input_ids, batch.input_ids, rtol=0, atol=0)
    # a batch with one sample never seen runs the target, and caches it
    assert not step(WorkItem(2, 1, build_batch(ds, [0, 5], 8, 0))).from_cache
    assert target.calls == 2 and len(cache) == 5
    assert cache.hits == 1 and cache.misses == 2


def test_the_budget_holds_and_what_does_not_fit_is_recomputed():
    ds, target = tiny_dataset(), _Counting(tiny_target())
    per_token = 2 * 64 * 4  # two taps of the 64-wide tiny target, fp32
    budget = int(ds.lengths[0] + ds.lengths[1]) * per_token
    cache = FeatureCache(ds.lengths, budget)
    step = TargetStep(target, torch.device("cpu"), torch.float32, False, cache)
    step(WorkItem(0, 0, build_batch(ds, [0, 1, 2], 8, 0)))
    assert len(cache) == 2 and cache.full and cache.used_bytes <= budget
    assert step(WorkItem(1, 1, build_batch(ds, [1, 0], 8, 0))).from_cache
    assert not step(WorkItem(2, 1, build_batch(ds, [2], 8, 0))).from_cache
    assert "budget reached" in cache.summary()


def test_training_with_the_cache_matches_recomputing_and_runs_the_target_once_per_sample(
    tmp_path,
):
    ds = tiny_dataset()
    runs = {}
    for gb in (0.0, 1.0):
        target = _Counting(tiny_target())
        cfg = tiny_config(
            tmp_path / str(gb), **{"optim.epochs": 3, "pipeline.feature_cache_gb": gb}
        )
        res = train(cfg, target=target, train_set=ds)
        runs[gb] = (res, target.calls)
    (plain, plain_calls), (cached, cached_calls) = runs[0.0], runs[1.0]
    la = {s: m["loss"] for s, m in plain.history}
    lb = {s: m["loss"] for s, m in cached.history}
    assert la.keys() == lb.keys() and len(la) > 10
    for k in la:  # the same features, batch padding aside (float rounding)
        assert lb[k] == pytest.approx(la[k], rel=1e-4, abs=1e-5)
    # startup tap checks aside, the target ran one epoch's batches instead of three
    assert cached_calls < plain_calls / 2, (cached_calls, plain_calls)
    assert "feature cache: 24 samples" in cached.balance


def test_the_cache_is_refused_off_cpu(tmp_path):
    from dflash_trainer.run.build import feature_cache

    cfg = tiny_config(tmp_path, **{"pipeline.feature_cache_gb": 1.0})
    cfg.pipeline.target_devices = ["cuda:0"]

    class _Parts:
        drafter_device = torch.device("cpu")
        train_set = tiny_dataset()

    with pytest.raises(UserError, match="feature_cache_gb=1.0: the feature cache is for CPU"):
        feature_cache(cfg, _Parts())
