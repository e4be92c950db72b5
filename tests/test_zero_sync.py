"""The hot paths never read a device value on the host (ARCHITECTURE.md, observability.md §3).

Every worker thread runs under a TorchDispatchMode that records ops which force a host read;
with every metric enabled (monitor, JSONL sink, metrics ring, composition) the count per
steady-state step must be zero.
"""

import contextlib
import threading
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_trainer.pipeline.stage import Stage
from dflash_trainer.run import train
from tiny import tiny_config, tiny_dataset, tiny_target

SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::is_nonzero",
    "aten::equal",
    "aten::item",
    "aten::masked_select",
    "aten::unique",
    "aten::_unique2",
}


class CountHostReads(TorchDispatchMode):
    def __init__(self, worker, sink):
        super().__init__()
        self.worker, self.sink = worker, sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        hit = name in SYNC_OPS
        if name in ("aten::copy_", "aten::_to_copy", "aten::to"):
            # device -> host copies (only possible with a GPU present)
            src = args[1] if name == "aten::copy_" else args[0]
            dst_dev = (
                args[0].device if name == "aten::copy_" else (kwargs or {}).get("device", None)
            )
            hit = (
                isinstance(src, torch.Tensor)
                and src.device.type == "cuda"
                and dst_dev is not None
                and torch.device(dst_dev).type == "cpu"
            )
        if hit:
            self.sink.append((self.worker.name, self.worker.counters.steps, name))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "objective",
    [
        {},
        {"objective.weighting": "dpace", "objective.feature_noise": 0.05},
        {"objective.kd_weight": 0.5, "objective.kd_temperature": 2.0},
        {"objective.hidden_weight": 1.0, "objective.loss_slots": 2},
        {"pipeline.feature_cache_gb": 1.0, "objective.kd_weight": 0.5},
    ],
    ids=["decay", "dpace+noise", "kd", "hidden+slots", "cache"],
)
def test_no_host_reads_in_worker_threads(tmp_path, monkeypatch, objective):
    hits: list = []
    lock = threading.Lock()

    @contextlib.contextmanager
    def ctx(worker):
        local: list = []
        with CountHostReads(worker, local):
            yield
        with lock:
            hits.extend(local)

    monkeypatch.setattr(Stage, "thread_context", staticmethod(ctx))
    cfg = tiny_config(
        tmp_path,
        **{
            "metrics.log_every_s": 0.05,
            "optim.epochs": 3,
            "checkpoint.every_steps": 0,
            **objective,
        },
    )
    res = train(cfg, target=tiny_target(), train_set=tiny_dataset())
    assert res.steps > 10
    # every metric family was produced while we counted
    m = res.metrics
    assert any(k.startswith("drafter/") for k in m) and any(k.startswith("queue/") for k in m)
    assert "batch/padding_eff" in m and any(k.startswith("worker/target0/") for k in m)
    if objective.get("objective.kd_weight"):  # the KD path really ran: its terms were logged
        assert m.get("drafter/kd", 0) > 0 and m.get("drafter/ce", 0) > 0
    if objective.get("objective.hidden_weight"):  # the regression ran, on the target's states
        assert m.get("drafter/hidden", 0) > 0 and "drafter/acc_3" not in m
    steady = [h for h in hits if h[1] >= 1]
    assert steady == [], Counter((w, op) for w, _, op in steady)


def test_target_step_causal_mask_gives_the_same_features_on_real_tokens():
    from dflash_trainer.pipeline.messages import WorkItem
    from dflash_trainer.pipeline.prefetcher import build_batch
    from dflash_trainer.pipeline.steps import TargetStep

    target, ds = tiny_target(), tiny_dataset()
    batch = build_batch(ds, [0, 1, 2, 3], 8, 0)
    hb = TargetStep(target, torch.device("cpu"), torch.float32)(WorkItem(0, 0, batch))
    # reference: HF's own 2-D padding mask (1 = real token) from the rows' lengths
    lens = torch.as_tensor(ds.lengths[batch.sample_ids.numpy()])
    real = torch.arange(batch.input_ids.shape[1])[None] < lens[:, None]
    ref = target.features(batch.input_ids, real.long())
    torch.testing.assert_close(hb.features[real], ref[real])
