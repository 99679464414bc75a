import os

from .conftest import cli


def lines(proc) -> dict[str, str]:
    """"status what: detail" lines by what."""
    out = {}
    for line in proc.stdout.splitlines():
        status, _, rest = line.partition(" ")
        what, _, detail = rest.strip().partition(": ")
        out[what] = f"{status} {detail}"
    return out


def test_doctor_on_a_machine_without_a_gpu_says_so_and_exits_0():
    proc = cli("doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = lines(proc)
    assert found["torch"].startswith("ok ") and "CPU-only build" in found["torch"]
    assert found["GPU"].startswith("info none found: runs train on the CPU")
    assert found["torch.compile"].startswith("ok smoke test compiled and ran on cpu in")
    assert "expandable_segments:True" in found["allocator"]
    assert found["disk (runs)"].startswith(("ok ", "warn ")) and "GiB free at" in found["disk (cache)"]
    assert {"NVML", "Triton", "flash attention", "lmcockpit"} <= set(found)
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
