import os

import pytest

from lmcockpit.core.hardware import cpu_precision as cp

from .helpers import NO_GPU, cli, cpu_verdict

pytestmark = pytest.mark.slow


def lines(proc) -> dict[str, str]:
    """"status what: detail" lines by what."""
    out = {}
    for line in proc.stdout.splitlines():
        status, _, rest = line.partition(" ")
        what, _, detail = rest.strip().partition(": ")
        out[what] = f"{status} {detail}"
    return out


def test_doctor_on_a_machine_without_a_gpu_says_so_and_exits_0():
    """With CUDA_VISIBLE_DEVICES="" torch sees no GPU on any machine; NVML, which that variable
    does not govern, still sees a GPU machine's cards, and the doctor says they are hidden. The
    CPU's precision verdict measured before is read back with what was measured."""
    import torch

    from lmcockpit.core.hardware import gpu_env

    with cpu_verdict(cp.decide(0.921, 0.582, "1 block, 16×256 tokens, d_model 256, vocab 8192, 2 threads")):
        proc = cli("doctor", env=NO_GPU)
    found = lines(proc)
    build = (f"CUDA {torch.version.cuda} build" if torch.version.cuda
             else f"ROCm {torch.version.hip} build" if torch.version.hip else "CPU-only build")
    assert found["torch"].startswith("ok ") and build in found["torch"], found["torch"]
    assert found["CUDA_VISIBLE_DEVICES"].startswith("info '': torch numbers only these GPUs")
    cards = gpu_env.read_nvml().gpus
    if cards and not torch.version.cuda:  # GPUs this torch could never use: a diagnosis, hidden or not
        assert proc.returncode == 1 and found["GPU"].startswith("FAIL the driver sees"), proc.stdout
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if cards:  # a GPU machine, its GPUs hidden from torch
        assert found["GPU"].startswith(f"warn CUDA_VISIBLE_DEVICES='' hides all {len(cards)} GPU(s) from torch")
    else:
        assert found["GPU"].startswith("info none found: runs train on the CPU")
    assert found["torch.compile"].startswith("ok smoke test compiled and ran on cpu in")
    assert "expandable_segments:True" in found["allocator"]
    assert found["disk (runs)"].startswith(("ok ", "warn ")) and "GiB free at" in found["disk (cache)"]
    assert {"NVML", "Triton", "flash attention", "lmcockpit"} <= set(found)
    assert found["CPU precision"] == (
        'ok precision "auto" trains in bf16: a block\'s forward and backward took 921 ms in fp32, 582 ms in bf16 '
        "(1.58×; bf16 from 1.15×), measured before (1 block, 16×256 tokens, d_model 256, vocab 8192, 2 threads); "
        f"kept in {cp.cache_path()}")
    assert proc.stdout.rstrip().endswith("ready: runs can start on the CPU (no GPU here)")


def test_doctor_usage_errors_are_one_error_line_and_exit_2():
    proc = cli("doctor", "--frobnicate")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == "error: unrecognized arguments: --frobnicate (see `lmcockpit doctor --help`)\n"
    assert proc.stdout == ""


def test_doctor_diagnoses_a_torch_that_does_not_import(tmp_path, monkeypatch):
    # A `torch` package that fails on import, first on the path: the doctor's child process
    # meets it, the doctor itself (torch-free) does not.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('libcudart.so.12: cannot open shared object')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    proc = cli("doctor")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL  torch: cannot be imported or used here: ImportError: libcudart.so.12" in proc.stdout
    assert "a run cannot start: fix the 1 FAIL line(s) above" in proc.stdout
