"""models/kv_cache.py: the growing KV cache equals transformers' DynamicCache, op by op and
through a real model's decode (prefill, steps, rows leaving, crops, regrowth)."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from dflash_trainer.models.kv_cache import GrowingLayer, cache_kwarg, new_kv_cache
from tiny import tiny_target


def _kv(g, b, n):
    return torch.randn(b, 2, n, 8, generator=g), torch.randn(b, 2, n, 8, generator=g)


def _same(ours, ref):
    assert ours.get_seq_length() == ref.get_seq_length()
    torch.testing.assert_close(ours.keys, ref.keys, rtol=0, atol=0)
    torch.testing.assert_close(ours.values, ref.values, rtol=0, atol=0)


def test_growing_layer_matches_dynamic_layer_op_by_op():
    """Appends past several capacity doublings, crops (rejected drafts), rows leaving in order
    (compacted in place) and in a new order, regrowth after a crop, and beam reordering: the
    same tensors as DynamicLayer's."""
    g = torch.Generator().manual_seed(0)
    ours, ref = GrowingLayer(), DynamicLayer()
    assert ours.get_seq_length() == 0
    for op in [
        "add 37",
        "add 1",
        "add 16",
        "crop -9",
        "add 1",
        "rows 0 1 3 4",
        "add 2",
        "rows 3 0 2",
        "add 40",
        "crop -1",
        "add 70",
        "beam 1 1 0",
        "add 5",
        "crop 0",
        "repeat 2",
        "add 2",
    ]:
        kind, *args = op.split()
        if kind == "add":
            b = ref.keys.shape[0] if ref.is_initialized else 5
            k, v = _kv(g, b, int(args[0]))
            got, want = ours.update(k, v), ref.update(k, v)
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        elif kind == "crop":
            ours.crop(int(args[0]))
            ref.crop(int(args[0]))
        elif kind == "rows":
            idx = torch.tensor([int(a) for a in args])
            ours.batch_select_indices(idx)
            ref.batch_select_indices(idx)
        elif kind == "beam":
            idx = torch.tensor([int(a) for a in args])
            ours.reorder_cache(idx)
            ref.reorder_cache(idx)
        else:
            ours.batch_repeat_interleave(int(args[0]))
            ref.batch_repeat_interleave(int(args[0]))
        _same(ours, ref)
    assert ours._k.shape[-2] >= 2 * 64  # it did grow past its first allocation
    with pytest.raises(ValueError, match="negative"):
        ours.crop(3)
    ours.reset()
    assert ours.get_seq_length() == 0


def test_a_step_writes_in_place_and_does_not_copy_the_cache():
    layer = GrowingLayer()
    g = torch.Generator().manual_seed(1)
    layer.update(*_kv(g, 2, 10))
    buf = layer._k.data_ptr()
    for _ in range(20):
        k, v = layer.update(*_kv(g, 2, 1))
        assert k.data_ptr() == buf  # a view of the same buffer: nothing re-concatenated
    assert layer.get_seq_length() == 30


def test_rows_leaving_in_order_move_in_place_and_keep_the_capacity():
    layer, ref = GrowingLayer(), DynamicLayer()
    g = torch.Generator().manual_seed(2)
    for la in (layer, ref):
        la.lazy_initialization(*_kv(g, 4, 1))
    k, v = _kv(g, 4, 10)
    layer.update(k, v), ref.update(k, v)
    buf, cap = layer._k.data_ptr(), layer._k.shape[-2]
    for la in (layer, ref):
        la.batch_select_indices(torch.tensor([1, 3]))
    assert layer._k.data_ptr() == buf and layer._k.shape[-2] == cap  # no copy to a new buffer
    k, v = _kv(g, 2, 1)
    got, want = layer.update(k, v), ref.update(k, v)
    assert layer._k.data_ptr() == buf  # and none at the next step
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_decode_with_growing_cache_equals_dynamic_cache(arch):
    """A tiny target's prefill, greedy steps, a crop of 3 rejected tokens, a row leaving: the
    logits with our cache equal those with transformers' DynamicCache."""
    model = tiny_target(arch, seed=3).model.eval()
    cache = new_kv_cache(model)
    assert all(isinstance(la, GrowingLayer) for la in cache.layers)
    ref = DynamicCache(config=model.config)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (3, 21), generator=g)
    outs, kw = [], cache_kwarg(model)
    with torch.no_grad():
        for c in (cache, ref):
            logits = [model(input_ids=ids, use_cache=True, **{kw: c}).logits]
            x = logits[-1][:, -1:].argmax(-1)
            for step in range(12):
                if step == 6:  # speculative decoding rejects the last 3 tokens
                    c.crop(-3)
                    x = ids[:, :1]
                if step == 8:  # a finished row leaves the batch
                    c.batch_select_indices(torch.tensor([2, 0]))
                    x = x[[2, 0]]
                pos = torch.full((x.shape[0], 1), c.get_seq_length())
                logits.append(
                    model(input_ids=x, position_ids=pos, use_cache=True, **{kw: c}).logits
                )
                x = logits[-1][:, -1:].argmax(-1)
            outs.append(logits)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
