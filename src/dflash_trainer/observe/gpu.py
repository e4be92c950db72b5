"""Device telemetry read by the monitor thread only: NVML (driver counters) and the CUDA allocator.

Both collectors are best-effort and never raise from `collect()`: no NVML library, no driver, no
GPU, or a metric the board does not support is a normal state (CI has none of them). Neither
collector touches the CUDA stream or synchronises: NVML queries are host-side driver calls and
`torch.cuda.memory_stats` copies a struct under the allocator mutex (observability.md §2, §3.1).

Key names follow observability.md §7.2 and §7.6 (`gpu/{i}/...`, `mem/{i}/...`, i = CUDA ordinal).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

log = logging.getLogger(__name__)

GIB = float(1 << 30)

# Clock-event (throttle) reason bits, nvmlClocksEventReasons (docs/design/observability.md §2
# table).
_THROTTLE_POWER = 0x4 | 0x80  # SW power cap | HW power brake
_THROTTLE_THERMAL = 0x20 | 0x40  # SW thermal | HW thermal
_THROTTLE_HW_SLOWDOWN = 0x8


def _cuda_ordinals(devices) -> list[int]:
    out = []
    for d in devices:
        d = torch.device(d)
        if d.type == "cuda":
            out.append(d.index if d.index is not None else 0)
    return sorted(set(out))


def _torch_uuid(ordinal: int) -> str:
    # torch prints the bare UUID; NVML's ByUUID wants the "GPU-" prefix.
    u = str(torch.cuda.get_device_properties(ordinal).uuid)
    return u if u.startswith(("GPU-", "MIG-")) else "GPU-" + u


class NvmlCollector:
    """Per-GPU driver counters through nvidia-ml-py (`import pynvml`), with handles cached by UUID.

    `nvml` and `uuid_of` are injection points for tests (a fake module, a fake ordinal -> UUID map).
    Metrics that raise NotSupported are remembered and not queried again. The 20 ms
    `nvmlDeviceGetPcieThroughput` is deliberately not used.
    """

    def __init__(self, devices, nvml: Any = None, uuid_of: Callable[[int], str] | None = None):
        self.available = False
        self.errors = 0
        self._handles: dict[int, Any] = {}
        self._unsupported: set[tuple[int, str]] = set()
        self._prev_energy: dict[int, tuple[float, int]] = {}  # ordinal -> (t, mJ)
        ordinals = _cuda_ordinals(devices)
        if not ordinals:
            return
        try:
            if nvml is None:
                import pynvml  # nvidia-ml-py

                nvml = pynvml
            nvml.nvmlInit()
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded
            log.info("NVML unavailable (%s): GPU telemetry limited to the allocator", e)
            return
        self._nvml = nvml
        uuid_of = uuid_of or _torch_uuid
        for i in ordinals:
            try:
                self._handles[i] = nvml.nvmlDeviceGetHandleByUUID(uuid_of(i))
            except Exception as e:
                log.warning("NVML: no handle for cuda:%d (%s); its telemetry is omitted", i, e)
        self.available = bool(self._handles)

    def _query(self, i: int, name: str, fn: Callable[[], Any]):
        """One metric, best-effort: None when unsupported or failing (failures are counted)."""
        if (i, name) in self._unsupported:
            return None
        try:
            return fn()
        except Exception as e:
            not_supported = getattr(self._nvml, "NVMLError_NotSupported", None)
            if not_supported is not None and isinstance(e, not_supported):
                self._unsupported.add((i, name))
            else:
                self.errors += 1
                if self.errors == 1:
                    log.warning("NVML query %s on cuda:%d failed: %s (reported once)", name, i, e)
            return None

    def collect(self, now: float | None = None) -> dict[str, float]:
        if not self.available:
            return {}
        now = time.monotonic() if now is None else now
        nv = self._nvml
        out: dict[str, float] = {}
        for i, h in self._handles.items():
            p = f"gpu/{i}/"
            q = self._query
            util = q(i, "util", partial(nv.nvmlDeviceGetUtilizationRates, h))
            if util is not None:
                out[p + "util"] = float(util.gpu)
                out[p + "mem_rw_util"] = float(util.memory)
            mem = q(i, "mem", partial(nv.nvmlDeviceGetMemoryInfo, h))
            if mem is not None:
                out[p + "mem_used_gib"] = mem.used / GIB
                out[p + "mem_total_gib"] = mem.total / GIB
            v = q(i, "power", partial(nv.nvmlDeviceGetPowerUsage, h))
            if v is not None:
                out[p + "power_w"] = v / 1000.0
            v = q(i, "power_limit", partial(nv.nvmlDeviceGetEnforcedPowerLimit, h))
            if v is not None:
                out[p + "power_limit_w"] = v / 1000.0
            v = q(i, "energy", partial(nv.nvmlDeviceGetTotalEnergyConsumption, h))
            if v is not None:
                prev = self._prev_energy.get(i)
                self._prev_energy[i] = (now, v)
                if prev is not None:  # mJ counter since driver load: exact window energy
                    de = (v - prev[1]) / 1000.0
                    out[p + "energy_j"] = de
                    if now > prev[0]:
                        out[p + "power_avg_w"] = de / (now - prev[0])
            v = q(i, "temp", partial(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU))
            if v is not None:
                out[p + "temp_c"] = float(v)
            v = q(i, "sm_clock", partial(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM))
            if v is not None:
                out[p + "sm_clock_mhz"] = float(v)
            v = q(i, "mem_clock", partial(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM))
            if v is not None:
                out[p + "mem_clock_mhz"] = float(v)
            v = q(i, "throttle", partial(self._throttle_bits, h))
            if v is not None:
                v = int(v)
                out[p + "throttle_bits"] = float(v)
                out[p + "throttle/power"] = float(bool(v & _THROTTLE_POWER))
                out[p + "throttle/thermal"] = float(bool(v & _THROTTLE_THERMAL))
                out[p + "throttle/hw_slowdown"] = float(bool(v & _THROTTLE_HW_SLOWDOWN))
            v = q(i, "pcie_replay", partial(nv.nvmlDeviceGetPcieReplayCounter, h))
            if v is not None:
                out[p + "pcie_replays"] = float(v)
        return out

    def _throttle_bits(self, h) -> int:
        nv = self._nvml
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if fn is None:  # older nvidia-ml-py name
            fn = nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return fn(h)

    def close(self) -> None:
        if self.available:
            try:
                self._nvml.nvmlShutdown()  # reference counted: other users keep their init
            except Exception:
                pass
            self.available = False


class AllocatorCollector:
    """`torch.cuda.memory_stats` keys of docs/design/observability.md §7.6 for each CUDA device.

    `memory_stats(ordinal) -> dict` is injectable for tests. Returns {} for devices whose CUDA
    context does not exist yet (memory_stats is then {} and never creates one, §8.7).
    """

    def __init__(self, devices, memory_stats: Callable[[int], dict] | None = None):
        self._ordinals = _cuda_ordinals(devices)
        if memory_stats is None and not torch.cuda.is_available():
            self._ordinals = []
        self._stats = memory_stats or torch.cuda.memory_stats
        self.available = bool(self._ordinals)
        self._prev_allocs: dict[int, tuple[float, int]] = {}

    def collect(
        self, now: float | None = None, nvml_metrics: dict | None = None
    ) -> dict[str, float]:
        now = time.monotonic() if now is None else now
        out: dict[str, float] = {}
        for i in self._ordinals:
            s = self._stats(i)
            if not s:
                continue
            p = f"mem/{i}/"
            alloc = s.get("allocated_bytes.all.current", 0)
            reserved = s.get("reserved_bytes.all.current", 0)
            out[p + "allocated_gib"] = alloc / GIB
            out[p + "allocated_peak_gib"] = s.get("allocated_bytes.all.peak", 0) / GIB
            out[p + "reserved_gib"] = reserved / GIB
            out[p + "reserved_peak_gib"] = s.get("reserved_bytes.all.peak", 0) / GIB
            out[p + "active_peak_gib"] = s.get("active_bytes.all.peak", 0) / GIB
            out[p + "frag_frac"] = (1.0 - alloc / reserved) if reserved > 0 else 0.0
            out[p + "inactive_split_gib"] = s.get("inactive_split_bytes.all.current", 0) / GIB
            out[p + "alloc_retries_total"] = float(s.get("num_alloc_retries", 0))
            out[p + "ooms_total"] = float(s.get("num_ooms", 0))
            n_alloc = int(s.get("num_device_alloc", 0))
            prev = self._prev_allocs.get(i)
            self._prev_allocs[i] = (now, n_alloc)
            if prev is not None and now > prev[0]:
                out[p + "device_allocs_per_s"] = (n_alloc - prev[1]) / (now - prev[0])
            used = (nvml_metrics or {}).get(f"gpu/{i}/mem_used_gib")
            if used is not None:  # context, cuBLAS workspaces, NCCL, other processes
                out[p + "non_torch_gib"] = used - reserved / GIB
        return out
