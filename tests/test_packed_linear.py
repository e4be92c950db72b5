"""models/packed_linear.py: oneDNN prepacked linears while decoding, against the default kernel."""

import pytest
import torch
from torch import nn

from decoding import ar_generate
from dflash_trainer.eval.evaluation import evaluate
from dflash_trainer.models import packed_linear as P
from tiny import tiny_target

pytestmark = pytest.mark.skipif(not P.available(), reason="no oneDNN in this torch build")


def _model():
    return tiny_target(arch="qwen3", layers=4).model.eval()


def test_packed_forward_matches_the_default_kernel_and_is_undone():
    model = _model()
    ids = torch.randint(3, 128, (2, 11))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with P.packed_linears(model) as n:
            assert n == sum(isinstance(m, nn.Linear) for m in model.modules())
            got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_training_paths_keep_the_default_kernel_and_their_gradients():
    lin = nn.Linear(8, 4)
    x = torch.randn(5, 8)
    with P.packed_linears(lin):
        lin(x).sum().backward()  # grad mode, weight needs grad: the default kernel
    torch.testing.assert_close(lin.weight.grad, torch.ones(4, 1) * x.sum(0)[None])


def test_nested_bf16_disabled_and_failing_bodies_change_nothing():
    lin, half = nn.Linear(8, 4), nn.Linear(8, 4).to(torch.bfloat16)
    with P.packed_linears(lin) as n:
        assert n == 1
        with P.packed_linears(lin, half) as inner:
            assert inner == 0  # already packed; bf16 is not this path's
        assert "forward" in lin.__dict__
    assert P.packed_linears(lin, enabled=False).__enter__() == 0
    with pytest.raises(RuntimeError, match="boom"):
        with P.packed_linears(lin):
            raise RuntimeError("boom")
    assert "forward" not in lin.__dict__


def test_greedy_decoding_is_unchanged_by_packing():
    """Plain greedy through the decode loop with and without packing, and evaluate's spec runs
    (which pack) against their AR baseline: identical tokens in fp32."""
    target = tiny_target(arch="qwen3", layers=4)
    prompt = torch.randint(3, 128, (1, 9))
    with torch.no_grad():
        plain = ar_generate(target.model, prompt, 24).tokens
        with P.packed_linears(target.model):
            packed = ar_generate(target.model, prompt, 24).tokens
    assert packed == plain
    s = evaluate(target, None, [prompt[0].tolist()], 24, 1, stop_ids=[], progress=False)
    assert s.spec_results[0].tokens == s.ar_results[0].tokens == plain


def test_frozen_matmuls_match_the_default_products_and_follow_an_in_place_change():
    head = P.FrozenMatmuls()
    w = torch.randn(300, 24)
    x, g = torch.randn(7, 24), torch.randn(7, 300)
    torch.testing.assert_close(head.linear(x, w), x @ w.t(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.back(g, w), g @ w, atol=1e-5, rtol=1e-5)
    packed = head._fwd
    head.linear(x, w)
    assert head._fwd is packed  # packed once per weight
    with torch.no_grad():
        w.mul_(2)  # changed in place: packed again
    torch.testing.assert_close(head.linear(x, w), x @ w.t(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.back(g, w), g @ w, atol=1e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the default kernels, as autocast casts
        assert head.linear(x, w).dtype == torch.bfloat16
    assert head.linear(x.double(), w.double()).dtype == torch.float64
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # traced by the memory plan: the default kernels, which have fakes
        fw, fx = torch.empty(300, 24), torch.empty(7, 24)
        assert head.linear(fx, fw).shape == (7, 300)
        assert head.back(torch.empty(7, 300), fw).shape == (7, 24)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not P.available(), reason="oneDNN's packed linear is unavailable")
def test_the_packed_copies_take_what_the_memory_plan_counts():
    """FrozenMatmuls.copies_bytes (what run/memory_plan.py adds beside the frozen head) against
    the process's resident memory when the two copies of a 64 MiB head are packed; none under
    autocast, for other dtypes or past MAX_BYTES."""
    cpu = torch.device("cpu")
    w, x = torch.randn(16384, 1024), torch.randn(4, 1024)
    want = P.FrozenMatmuls.copies_bytes(tuple(w.shape), w.dtype, cpu, autocast=False)
    assert want == 2 * w.numel() * 4
    head = P.FrozenMatmuls()
    before = _rss()
    head.linear(x, w)
    grown = _rss() - before
    assert grown == pytest.approx(want, rel=0.1), (grown, want)
    assert P.FrozenMatmuls.copies_bytes((16384, 1024), torch.float32, cpu, autocast=True) == 0
    assert P.FrozenMatmuls.copies_bytes((16384, 1024), torch.bfloat16, cpu, autocast=False) == 0
    big = (P.FrozenMatmuls.MAX_BYTES // 4 // 1024 + 1, 1024)
    assert P.FrozenMatmuls.copies_bytes(big, torch.float32, cpu, autocast=False) == 0
