"""NVML and allocator collectors: fakes for the values; absent library/driver/CUDA never fails."""

from __future__ import annotations

import types

import pytest
import torch

from dflash_trainer.observe.gpu import GIB, AllocatorCollector, NvmlCollector


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


def make_fake_nvml(init_error: Exception | None = None):
    """A pynvml-shaped module: two boards by UUID with distinct readings."""
    calls = {"replay": 0, "init": 0, "shutdown": 0}
    boards = {
        "GPU-aaa": dict(
            util=10,
            mem_rw=5,
            used=2 * GIB,
            total=80 * GIB,
            power=100_000,
            energy=1_000_000,
            temp=40,
            sm=1500,
            mem=2600,
            throttle=0x0,
        ),
        "GPU-bbb": dict(
            util=90,
            mem_rw=55,
            used=60 * GIB,
            total=141 * GIB,
            power=650_000,
            energy=5_000_000,
            temp=71,
            sm=1980,
            mem=3200,
            throttle=0x4 | 0x40,
        ),
    }

    def init():
        calls["init"] += 1
        if init_error is not None:
            raise init_error

    def replay(h):
        calls["replay"] += 1
        raise NVMLError_NotSupported("Not Supported")

    def power_limit(h):
        raise NVMLError("Unknown Error")  # a real failure: counted, metric omitted

    nv = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVMLError_NotSupported=NVMLError_NotSupported,
        NVML_TEMPERATURE_GPU=0,
        NVML_CLOCK_SM=1,
        NVML_CLOCK_MEM=2,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetHandleByUUID=lambda u: boards[u],
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(
            gpu=h["util"], memory=h["mem_rw"]
        ),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(
            used=h["used"], total=h["total"], free=h["total"] - h["used"]
        ),
        nvmlDeviceGetPowerUsage=lambda h: h["power"],
        nvmlDeviceGetEnforcedPowerLimit=power_limit,
        nvmlDeviceGetTotalEnergyConsumption=lambda h: h["energy"],
        nvmlDeviceGetTemperature=lambda h, kind: h["temp"],
        nvmlDeviceGetClockInfo=lambda h, kind: h["sm"] if kind == 1 else h["mem"],
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: h["throttle"],
        nvmlDeviceGetPcieReplayCounter=replay,
    )
    return nv, boards, calls


DEVICES = [torch.device("cuda", 0), torch.device("cuda", 1)]
# CUDA ordinals are not NVML indices: ordinal 0 is board "bbb" here.
UUID_OF = {0: "GPU-bbb", 1: "GPU-aaa"}.__getitem__


def test_nvml_fake_values_mapping_and_deltas():
    nv, boards, calls = make_fake_nvml()
    c = NvmlCollector(DEVICES, nvml=nv, uuid_of=UUID_OF)
    assert c.available
    m = c.collect(now=10.0)
    assert m["gpu/0/util"] == 90.0 and m["gpu/1/util"] == 10.0  # mapped by UUID
    assert m["gpu/0/mem_rw_util"] == 55.0
    assert m["gpu/0/mem_used_gib"] == pytest.approx(60.0)
    assert m["gpu/0/mem_total_gib"] == pytest.approx(141.0)
    assert m["gpu/0/power_w"] == 650.0 and m["gpu/0/temp_c"] == 71.0
    assert m["gpu/0/sm_clock_mhz"] == 1980.0 and m["gpu/0/mem_clock_mhz"] == 3200.0
    assert m["gpu/0/throttle_bits"] == float(0x44)
    assert (
        m["gpu/0/throttle/power"],
        m["gpu/0/throttle/thermal"],
        m["gpu/0/throttle/hw_slowdown"],
    ) == (1.0, 1.0, 0.0)
    assert m["gpu/1/throttle/power"] == 0.0
    assert "gpu/0/energy_j" not in m  # first sample: no window yet
    assert "gpu/0/pcie_replays" not in m and "gpu/0/power_limit_w" not in m
    assert c.errors == 2  # power limit failed on both boards
    assert all(isinstance(v, float) for v in m.values())

    boards["GPU-bbb"]["energy"] += 3_250_000  # +3250 J over 5 s
    m2 = c.collect(now=15.0)
    assert m2["gpu/0/energy_j"] == pytest.approx(3250.0)
    assert m2["gpu/0/power_avg_w"] == pytest.approx(650.0)
    assert m2["gpu/1/energy_j"] == 0.0
    assert calls["replay"] == 2  # NotSupported is not asked again
    c.close()
    assert calls["shutdown"] == 1 and c.collect() == {}


def test_nvml_library_missing_returns_empty():
    nv, _, _ = make_fake_nvml(init_error=NVMLError_LibraryNotFound("NVML Shared Library Not Found"))
    c = NvmlCollector(DEVICES, nvml=nv, uuid_of=UUID_OF)
    assert not c.available and c.collect() == {}
    c.close()


def test_nvml_real_module_without_driver_or_gpu():
    # The real nvidia-ml-py on a machine without the driver: LibraryNotFound -> unavailable.
    c = NvmlCollector(DEVICES)
    if not torch.cuda.is_available():
        assert not c.available
        assert c.collect() == {}
    c.close()
    c = NvmlCollector([torch.device("cpu")])  # no CUDA device at all
    assert not c.available and c.collect() == {}


def test_nvml_unknown_uuid_omits_device():
    nv, _, _ = make_fake_nvml()
    c = NvmlCollector(DEVICES, nvml=nv, uuid_of={0: "GPU-zzz", 1: "GPU-aaa"}.__getitem__)
    m = c.collect()
    assert c.available and "gpu/1/util" in m and not any(k.startswith("gpu/0/") for k in m)


def _fake_stats(table):
    return lambda i: table[i]


def test_allocator_fake_stats():
    stats = {
        0: {
            "allocated_bytes.all.current": 3 * GIB,
            "allocated_bytes.all.peak": 5 * GIB,
            "reserved_bytes.all.current": 4 * GIB,
            "reserved_bytes.all.peak": 6 * GIB,
            "active_bytes.all.peak": 5.5 * GIB,
            "inactive_split_bytes.all.current": GIB / 2,
            "num_alloc_retries": 2,
            "num_ooms": 1,
            "num_device_alloc": 100,
        },
        1: {},
    }  # CUDA context not created yet
    c = AllocatorCollector(DEVICES, memory_stats=_fake_stats(stats))
    assert c.available
    m = c.collect(now=0.0, nvml_metrics={"gpu/0/mem_used_gib": 4.75})
    assert m["mem/0/allocated_gib"] == 3.0 and m["mem/0/allocated_peak_gib"] == 5.0
    assert m["mem/0/reserved_gib"] == 4.0 and m["mem/0/reserved_peak_gib"] == 6.0
    assert m["mem/0/active_peak_gib"] == 5.5 and m["mem/0/inactive_split_gib"] == 0.5
    assert m["mem/0/frag_frac"] == pytest.approx(0.25)
    assert m["mem/0/alloc_retries_total"] == 2.0 and m["mem/0/ooms_total"] == 1.0
    assert m["mem/0/non_torch_gib"] == pytest.approx(0.75)
    assert "mem/0/device_allocs_per_s" not in m and not any(k.startswith("mem/1/") for k in m)
    stats[0]["num_device_alloc"] = 130
    m = c.collect(now=10.0)
    assert m["mem/0/device_allocs_per_s"] == pytest.approx(3.0)
    assert "mem/0/non_torch_gib" not in m  # no NVML reading this time


def test_allocator_without_cuda():
    c = AllocatorCollector(DEVICES)
    if not torch.cuda.is_available():
        assert not c.available and c.collect() == {}
    assert AllocatorCollector([torch.device("cpu")]).collect() == {}
