"""What `auto` means on each kind of CPU (precision.py), and the seam tests set it by."""

from __future__ import annotations

import pytest
import torch

from dflash_trainer import precision as P


@pytest.mark.parametrize(
    "onednn, flags, native",
    [
        (True, {"avx2", "avx512f", "avx512bw", "avx512vl"}, False),  # Skylake: oneDNN emulates
        (True, {"avx2", "avx512f", "avx512_bf16"}, True),  # Zen 4, Cooper Lake
        (True, {"avx2", "avx512f", "amx_bf16", "amx_tile"}, True),  # Sapphire Rapids
        (False, {"avx2"}, False),  # AVX2-only EPYC
        (False, {"amx_bf16"}, False),  # torch without oneDNN bf16 kernels
        (True, set(), True),  # flags unknown (not Linux): oneDNN's answer stands
    ],
)
def test_native_bf16_needs_the_instructions_not_only_onednn(onednn, flags, native):
    assert P.native_bf16_from(onednn, flags) is native


def test_the_probe_agrees_with_this_cpus_flags():
    """Whatever this machine is, the real probe says what its flags say (oneDNN present)."""
    _, flags = P._cpuinfo()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this system")
    onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert P._probe_cpu_bf16() == (onednn and any(f in flags for f in P.BF16_FLAGS))


def test_auto_follows_the_answer(cpu_native_bf16):
    assert P.cpu_has_native_bf16() is cpu_native_bf16
    want = "bfloat16" if cpu_native_bf16 else "float32"
    assert P.dtype_name("auto", "cpu") == want
    assert P.resolve_dtype("auto", "cpu") == P.DTYPES[want]
    assert P.use_autocast("auto", "cpu") is cpu_native_bf16
    assert P.dtype_name("float32", "cpu") == "float32"  # explicit names are never resolved
    assert P.use_autocast("float32", "cpu") is False and P.use_autocast("bfloat16", "cpu") is True
    assert P.dtype_name("auto", "cuda") == "bfloat16"  # every CUDA GPU this runs on has bf16
    assert f"auto = {want}" in P.cpu_kind()


def test_the_seam_refuses_a_value_it_cannot_read(monkeypatch):
    monkeypatch.setenv(P.NATIVE_BF16_ENV, "yes")
    with pytest.raises(ValueError, match=f"{P.NATIVE_BF16_ENV}='yes': set it to 0 or 1"):
        P.cpu_has_native_bf16()
    monkeypatch.delenv(P.NATIVE_BF16_ENV)
    assert P.cpu_has_native_bf16() is P._probe_cpu_bf16()


def test_the_avx2_switch_names_the_simulated_kind(monkeypatch):
    monkeypatch.setattr(P, "_cpuinfo", lambda: ("AMD EPYC", {"avx2", "avx512f", "avx512_bf16"}))
    for k, v in P.SIMULATED_AVX2_ENV.items():
        monkeypatch.setenv(k, v)
    assert P.simulated_avx2() and P.simulated_on() == "AVX512-BF16"
    assert P.cpu_kind() == "AMD EPYC (AVX2, simulated on AVX512-BF16; auto = float32)"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")  # a partial switch is no simulation: said as forced
    assert not P.simulated_avx2() and P.simulated_on() == ""
    forced = "AMD EPYC (AVX512-BF16; auto = float32, forced by DFLASH_TRAINER_CPU_NATIVE_BF16)"
    assert P.cpu_kind() == forced


def test_the_avx2_switch_caps_what_torch_dispatches():
    """The switch is what torch reads at start-up: a process under it dispatches AVX2 kernels
    (on a machine with AVX2; an older CPU dispatches what it has) and picks fp32."""
    import os
    import subprocess
    import sys

    _, flags = P._cpuinfo()
    if "avx2" not in flags:
        pytest.skip("no AVX2 on this machine")
    code = (
        "import torch; from dflash_trainer import precision as P; "
        "print(torch.backends.cpu.get_cpu_capability(), P.dtype_name('auto', 'cpu'))"
    )
    env = {**os.environ, **P.SIMULATED_AVX2_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["AVX2", "float32"]


def test_the_switch_on_an_avx2_cpu_simulates_nothing(monkeypatch):
    monkeypatch.setattr(P, "_cpuinfo", lambda: ("AMD EPYC", {"avx2", "fma"}))
    for k, v in P.SIMULATED_AVX2_ENV.items():
        monkeypatch.setenv(k, v)
    assert P.simulated_on() == ""
    assert P.cpu_kind().startswith("AMD EPYC (AVX2; auto = float32")


def test_the_makefile_switch_sets_what_the_code_calls_the_switch():
    """CPU_KIND=avx2 in the Makefile exports exactly SIMULATED_AVX2_ENV (the two must not drift:
    cpu_kind names a run simulated only when all four are set)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    block = text.split("ifeq ($(CPU_KIND),avx2)", 1)[1].split("else", 1)[0]
    exported = dict(re.findall(r"^export (\w+) := (\S+)$", block, re.M))
    assert exported == P.SIMULATED_AVX2_ENV
