"""``--dtype auto`` resolved in one place (``pdserve.core.dtype``) from the machine's CPU flags,
for every command: fake ``/proc/cpuinfo`` of an AVX2-only, an AVX512_BF16 and an AMX CPU,
and ``bench compare``'s engine settings built on each."""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

import pytest

from pdserve.bench.compare import main as compare
from pdserve.cli.bench import build_parser
from pdserve.cli.bench_flags import compare_config
from pdserve.core import hardware
from pdserve.core.dtype import resolve_dtype
from pdserve.core.hardware import Hardware

# The first processor's lines as each CPU's /proc/cpuinfo has them (flags abridged).
BASE_FLAGS = "fpu vme de pse tsc msr pae sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2"
AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"
CPUS = {
    "avx2": ("Intel(R) Xeon(R) CPU E5-2680 v4 @ 2.40GHz", BASE_FLAGS),
    "avx512_bf16": ("AMD EPYC 9B14 96-Core Processor", f"{BASE_FLAGS} {AVX512} avx512_bf16"),
    "amx": ("Intel(R) Xeon(R) Platinum 8480+",
            f"{BASE_FLAGS} {AVX512} avx512_bf16 amx_bf16 amx_tile amx_int8"),
}
WANT = {"avx2": "float32", "avx512_bf16": "bfloat16", "amx": "bfloat16"}


def cpuinfo(kind: str) -> str:
    model, flags = CPUS[kind]
    return (f"processor\t: 0\nvendor_id\t: x\nmodel name\t: {model}\nflags\t\t: {flags}\n\n"
            f"processor\t: 1\nmodel name\t: {model}\nflags\t\t: {flags}\n")


@pytest.fixture(params=sorted(CPUS))
def fake_cpu(request: pytest.FixtureRequest, tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> str:
    """This machine seen as ``request.param``'s CPU, without CUDA."""
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo(request.param))
    monkeypatch.setattr(hardware, "CPUINFO", path)
    monkeypatch.setattr(hardware, "_cuda", lambda: False)
    return str(request.param)


def test_auto_is_bf16_only_where_the_cpu_has_it_natively(fake_cpu: str) -> None:
    choice = resolve_dtype("auto")
    assert choice.dtype == WANT[fake_cpu]
    assert choice.requested == "auto"
    assert CPUS[fake_cpu][0] in choice.describe()
    if fake_cpu == "avx2":
        assert "no native bf16" in choice.reason
        assert "-avx512_bf16" in choice.describe() and "-amx_bf16" in choice.describe()
    else:
        assert "+avx512_bf16" in choice.describe()
        assert ("amx_bf16" in choice.reason) == (fake_cpu == "amx")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_kept(fake_cpu: str, dtype: str) -> None:
    assert resolve_dtype(dtype).dtype == dtype


def test_bench_compare_settings_run_the_resolved_dtype(fake_cpu: str) -> None:
    parser = build_parser()
    cfg = compare_config(parser.parse_args(["compare"]))
    assert cfg.settings.dtype == WANT[fake_cpu]  # every system's engines
    assert cfg.dtype.requested == "auto" and cfg.dtype.dtype == WANT[fake_cpu]
    assert compare.settings_json(cfg)["dtype"] == WANT[fake_cpu]
    forced = compare_config(parser.parse_args(["compare", "--dtype", "float32"]))
    assert forced.settings.dtype == "float32"


def test_aarch64_bf16_is_native() -> None:
    hw = Hardware.from_cpuinfo("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert resolve_dtype("auto", hw).dtype == "bfloat16"


@pytest.mark.parametrize(("config_dtype", "bf16_device", "want"), [
    ("bfloat16", True, "bfloat16"), ("float32", True, "bfloat16"),
    ("float32", False, "float16"), ("bfloat16", False, "float16"),
    ("float16", True, "float16"), (None, True, "bfloat16"),
])
def test_cuda_auto_follows_vllms_rule(tmp_path: Path, config_dtype: str | None,
                                      bf16_device: bool, want: str) -> None:
    """vLLM's ``_resolve_auto_dtype`` on CUDA: the model's dtype, float32 downcast."""
    if config_dtype:
        (tmp_path / "config.json").write_text(f'{{"torch_dtype": "{config_dtype}"}}')
    hw = Hardware("NVIDIA host", frozenset(), (0,), cuda=True)
    assert resolve_dtype("auto", hw, tmp_path, cuda_bf16=bf16_device).dtype == want


def test_an_unknown_dtype_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: auto, float32, bfloat16, float16"):
        resolve_dtype("fp8")


def test_pdserve_machine_prints_the_cpu_and_the_dtype_auto_runs(
        fake_cpu: str, capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.cli.main import main

    assert main(["machine"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"dtype {WANT[fake_cpu]} (requested auto") and CPUS[fake_cpu][0] in out


class _FakeTorch:
    """``torch`` as ``hardware._cuda`` asks it; ``asked`` counts the calls."""

    def __init__(self, available: bool) -> None:
        self.__spec__ = importlib.machinery.ModuleSpec("torch", None)  # installed
        self.asked = 0
        self.cuda = self
        self._available = available

    def is_available(self) -> bool:
        self.asked += 1
        return self._available


@pytest.mark.parametrize("nodes", [[], ["nvme0", "null"], ["nvidia0", "nvidiactl"], ["kfd"],
                                   ["dxg"], ["nvhost-ctrl", "nvmap"]])
def test_cuda_asks_torch_only_where_a_gpu_device_node_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nodes: list[str]) -> None:
    for name in nodes:
        (tmp_path / name).touch()
    fake = _FakeTorch(available=True)
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(hardware, "DEV", tmp_path)
    gpu = any(n not in ("nvme0", "null") for n in nodes)
    assert hardware._cuda() is gpu
    assert fake.asked == (1 if gpu else 0)


def test_an_unreadable_dev_asks_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeTorch(available=False)
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(hardware, "DEV", tmp_path / "missing")
    assert hardware._cuda() is False and fake.asked == 1


def test_cuda_here_is_what_torch_says() -> None:
    import torch

    assert hardware._cuda() is bool(torch.cuda.is_available())
