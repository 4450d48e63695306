"""Every ``kernels/*.cu`` compiles, without a GPU: with nvcc when it is on the PATH, with NVRTC when
CuPy and its NVRTC library load (compile only: no driver or device is needed). Each check skips
cleanly when its compiler is missing, so a syntax error cannot land unnoticed wherever one exists.

What is compiled is exactly what the CuPy backend hands to NVRTC: ``kernel_source(name)``, the
file with ``apr_common.cuh`` inlined. nvcc also compiles the files as they are (with ``-I``), the
way a developer would.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from apr.kernels.cupy_backend import KERNEL_FILES, KERNEL_NAMES, NVRTC_OPTIONS, kernel_source, kernels_dir

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on the PATH")


def test_every_kernel_file_is_listed_and_sources_inline_their_headers():
    on_disk = sorted(p.stem for p in kernels_dir().glob("*.cu"))
    assert on_disk == sorted(KERNEL_FILES)
    for name in KERNEL_FILES:
        src = kernel_source(name)
        assert "#include" not in src and "#pragma once" not in src
        assert src.count("struct apr_bf16 {") == 1  # the header, inlined once
        for fn in KERNEL_NAMES[name]:
            assert re.search(rf"\b{fn}\b", src), f"{name}.cu does not define {fn}"


def _nvcc(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([NVCC, *args], cwd=cwd, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0 and "Unsupported gpu architecture" in proc.stderr:
        pytest.skip(f"this nvcc cannot target the architecture: {proc.stderr.strip()[:200]}")
    return proc


def _own_warnings(stderr: str, stem: str) -> list[str]:
    return [line for line in stderr.splitlines() if stem in line and "warning" in line.lower()]


@needs_nvcc
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_nvcc_compiles_the_source_the_backend_loads(name, tmp_path):
    src = tmp_path / f"{name}_inlined.cu"
    src.write_text(kernel_source(name))
    # sm_90 (H100/H200) down to machine code, so ptxas checks registers against the launch bounds.
    proc = _nvcc(["-arch=sm_90", "-c", src.name, "-o", f"{name}.o", "-Xptxas", "-v"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not _own_warnings(proc.stderr, src.name), proc.stderr
    assert not re.search(r"[1-9]\d* bytes spill", proc.stderr), proc.stderr


@needs_nvcc
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_nvcc_compiles_the_files_as_they_are_to_ptx(name, tmp_path):
    kdir = kernels_dir()
    proc = _nvcc(["-arch=sm_80", "--ptx", f"-I{kdir}", str(kdir / f"{name}.cu"), "-o",
                  str(tmp_path / f"{name}.ptx")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not _own_warnings(proc.stderr, f"{name}.cu"), proc.stderr
    ptx = (tmp_path / f"{name}.ptx").read_text()
    for fn in KERNEL_NAMES[name]:
        assert f".entry {fn}(" in ptx


def _nvrtc():
    """CuPy's NVRTC bindings when the NVRTC library loads here (no device needed), else skip."""
    cupy = pytest.importorskip("cupy")
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as err:  # CuPy without an NVRTC library (no toolkit, no nvidia-cuda-nvrtc wheel)
        pytest.skip(f"CuPy {cupy.__version__} is installed but NVRTC does not load: {err}")
    return nvrtc


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_nvrtc_compiles_the_source_the_backend_loads(name, arch):
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(kernel_source(name), f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*NVRTC_OPTIONS, f"-arch={arch}"])
        except Exception as err:
            pytest.fail(f"NVRTC rejected {name}.cu: {err}\n{nvrtc.getProgramLog(prog)}")
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    finally:
        nvrtc.destroyProgram(prog)
    for fn in KERNEL_NAMES[name]:
        assert f".entry {fn}(" in ptx


# ------------------------------------------------------------------ the GPU scripts on a CPU machine

REPO = Path(__file__).resolve().parents[2]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")


@no_cuda
@pytest.mark.parametrize("script", ["benchmarks/bench_kernels.py", "benchmarks/vram_calibration.py"])
def test_gpu_benchmarks_skip_cleanly_without_cuda(script):
    import sys

    proc = subprocess.run([sys.executable, str(REPO / script)], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "no CUDA device: skipped"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_check_script_parses():
    proc = subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu-check.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
