import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lmcockpit.core import protocol as P
from lmcockpit.core.config import ConfigError
from lmcockpit.core.hardware import gpu_env
from lmcockpit.core.hardware.device import choose_precision, peak_flops, peak_tflops

from .helpers import NO_GPU, TINY, as_flags, cli, drive_engine, tiny_config


@pytest.mark.parametrize("readings, chosen", [
    ([(0, 10), (1, 30), (2, 20)], 1),
    ([(0, 30), (1, 30)], 0),  # equals: the lowest index, so an idle machine always starts on GPU 0
    ([(3, 5)], 3),
    ([], None),
])
def test_auto_picks_the_gpu_with_the_most_free_memory(readings, chosen):
    assert gpu_env.most_free(readings) == chosen


def test_nvml_and_torch_uuids_compare_equal():
    assert gpu_env.normalise_uuid("GPU-8F0C1D2E-aaaa") == gpu_env.normalise_uuid("8f0c1d2e-AAAA") == "8f0c1d2e-aaaa"
    # a MIG instance: CUDA lists it, and torch's UUID is the instance's own
    assert gpu_env.normalise_uuid("MIG-8F0C1D2E-aaaa") == "8f0c1d2e-aaaa"


def test_the_engine_sends_each_device_s_uuid(monkeypatch):
    """RunStarted's UUIDs, by which the front-end finds each device's NVML readings: torch's device
    properties', one per device, "" for the CPU and where torch cannot say."""
    from types import SimpleNamespace

    from lmcockpit.core.hardware.device import device_uuids

    def properties(device):
        if torch.device(device).index == 1:
            raise RuntimeError("no uuid in this build")
        return SimpleNamespace(uuid="8F0C1D2E-1111-2222-3333-444444444444")

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    assert device_uuids(("cuda:0", "cuda:1", "cpu")) == ("8f0c1d2e-1111-2222-3333-444444444444", "", "")


@pytest.mark.slow
def test_without_cuda_auto_is_the_cpu_and_a_named_gpu_is_a_config_error():
    """In a process whose GPUs are hidden (CUDA_VISIBLE_DEVICES=""): a machine without a GPU, on
    any machine. This process may have met CUDA already, and torch counts the GPUs only once."""
    code = textwrap.dedent("""
        import torch
        from lmcockpit.core.config import ConfigError
        from lmcockpit.core.hardware.device import resolve_device

        print("cuda available:", torch.cuda.is_available())
        print("auto:", resolve_device("auto"), "cpu:", resolve_device("cpu"))
        try:
            resolve_device("cuda:1")
        except ConfigError as e:
            print("cuda:1:", e)
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **NO_GPU})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["cuda available: False", "auto: cpu cpu: cpu"], lines
    assert lines[2].startswith("cuda:1: hardware.device = 'cuda:1', but this machine has no usable CUDA GPU"), lines


@pytest.mark.slow
def test_gpu_flag_reaches_the_engine(tmp_path):
    """`--gpu 0` on a machine without a GPU (hidden, on a machine with one): the engine is asked
    for cuda:0 and refuses it as the input error it is."""
    proc = cli("--run", "debug", *as_flags(TINY), "--gpu", "0", "--out", str(tmp_path / "run"), env=NO_GPU)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "hardware.device = 'cuda:0', but this machine has no usable CUDA GPU" in proc.stderr
    assert "run failed" not in proc.stdout + proc.stderr  # said once, as the error it is
    # the refused run leaves no folder behind to block the same --out (or list a failed run)
    assert not (tmp_path / "run").exists()
    again = cli("--run", "debug", *as_flags(TINY), "--set", "training.max_steps=2", "--out", str(tmp_path / "run"),
                env=NO_GPU)
    assert again.returncode == 0, again.stdout + again.stderr


@pytest.mark.parametrize("requested, device, native_bf16, chosen", [
    ("auto", "cuda", True, "bf16"),
    ("auto", "cuda", False, "fp16"),  # Volta/Turing: fp16 with a grad scaler
    ("fp32", "cuda", True, "fp32"),
    ("fp16", "cuda", True, "fp16"),
    ("auto", "cpu", False, "fp32"),
    ("bf16", "cpu", False, "bf16"),
])
def test_precision_choice(requested, device, native_bf16, chosen):
    assert choose_precision(requested, device, native_bf16) == chosen


@pytest.mark.parametrize("requested, device, message", [
    ("fp16", "cpu", "needs a CUDA GPU"),
    ("bf16", "cuda", "needs a GPU with bf16 in hardware"),
])
def test_precision_a_device_cannot_do_is_a_config_error(requested, device, message):
    with pytest.raises(ConfigError, match=message):
        choose_precision(requested, device, False)


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA GeForce RTX 3090", 71.0), ("NVIDIA GeForce RTX 4090", 165.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100-SXM4-40GB", 312.0), ("NVIDIA A100-PCIE-40GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA H800", 989.0),
    ("NVIDIA GeForce RTX 4070 Ti", 80.0), ("NVIDIA GeForce RTX 4070 Ti SUPER", 88.2), ("NVIDIA GeForce RTX 3060", 25.6),
    ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0), ("NVIDIA RTX 6000 Ada Generation", 364.0),
    ("NVIDIA RTX A6000", 155.0), ("NVIDIA A10G", 70.0), ("NVIDIA A10", 125.0),
    ("Tesla V100-SXM2-16GB", 125.0), ("Tesla V100-SXM2-32GB", 125.0), ("Tesla V100-PCIE-16GB", 112.0),
    ("Tesla T4", 65.0),
    # near misses: a cut-down, laptop or other-variant part named like a listed one has a peak of its own
    ("NVIDIA GeForce RTX 4090 D", None), ("NVIDIA GeForce RTX 4090 Laptop GPU", None), ("NVIDIA H800 PCIe", None),
    ("NVIDIA H200 NVL", None), ("NVIDIA GeForce RTX 4070 Ti SUPER Laptop GPU", None), ("Quadro RTX 6000", None),
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None), ("NVIDIA H20", None), ("AMD Instinct MI300X", None),
    ("Some Future GPU", None),
])
def test_mfu_peaks(name, tflops):
    assert peak_tflops(name) == tflops


@pytest.mark.parametrize("name, peak, said", [
    ("NVIDIA H100 80GB HBM3", 989e12, []),
    ("NVIDIA GeForce RTX 4090 D", None,
     ["MFU: no peak FLOP/s known for 'NVIDIA GeForce RTX 4090 D'; MFU is not shown"]),
])
def test_a_gpu_without_a_known_peak_is_said_in_the_log(monkeypatch, name, peak, said):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    lines: list[str] = []
    assert peak_flops(torch.device("cuda", 0), lines.append) == peak
    assert lines == said
    assert peak_flops(torch.device("cpu"), lines.append) is None and lines == said  # no MFU on a CPU: nothing to say


@pytest.mark.parametrize("version, name", [
    ((2, 6), "PYTORCH_CUDA_ALLOC_CONF"), ((2, 9), "PYTORCH_CUDA_ALLOC_CONF"),  # 2.9 ignored the new name
    ((2, 11), "PYTORCH_ALLOC_CONF"), ((3, 0), "PYTORCH_ALLOC_CONF"), (None, "PYTORCH_CUDA_ALLOC_CONF"),
])
def test_allocator_variable_follows_the_torch_version(version, name):
    setting = gpu_env.allocator_setting({}, version, platform="linux")
    assert (setting.name, setting.value, setting.by_user) == (name, "expandable_segments:True", False)


@pytest.mark.parametrize("user_var", gpu_env.ALLOC_VARS)
def test_allocator_never_overrides_the_users_setting(user_var):
    env = {user_var: "max_split_size_mb:128"}
    setting = gpu_env.configure_allocator(env)
    assert setting.by_user and env == {user_var: "max_split_size_mb:128"}


def test_allocator_is_set_for_the_installed_torch():
    env: dict[str, str] = {}
    setting = gpu_env.configure_allocator(env)
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    assert env == {gpu_env.alloc_var_name((major, minor)): "expandable_segments:True"}
    assert not setting.by_user
    assert gpu_env.allocator_setting({}, (2, 13), platform="win32").name == ""  # Linux only


BOTH = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "expandable_segments:False"}


@pytest.mark.parametrize("version, taken", [
    ((2, 13), "PYTORCH_CUDA_ALLOC_CONF"), ((2, 12), "PYTORCH_CUDA_ALLOC_CONF"), (None, "PYTORCH_CUDA_ALLOC_CONF"),
    ((2, 11), "PYTORCH_ALLOC_CONF"), ((2, 8), "PYTORCH_ALLOC_CONF"),  # the releases that warned about the old name
    ((2, 7), "PYTORCH_CUDA_ALLOC_CONF"),  # before the new name existed
])
def test_with_both_allocator_variables_set_the_one_torch_reads_first_is_named(version, taken):
    other = next(name for name in BOTH if name != taken)
    setting = gpu_env.allocator_setting(dict(BOTH), version, platform="linux")
    assert (setting.name, setting.value, setting.by_user, setting.ignored) == (taken, BOTH[taken], True, (other,))
    assert setting.describe() == (f"{taken}={BOTH[taken]} (yours: lmcockpit leaves it as it is; {other} also set, "
                                  f"but torch reads {taken} first: ignored)")


def test_an_allocator_variable_torch_does_not_read_is_named_as_ignored():
    setting = gpu_env.allocator_setting({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, (2, 7), "linux")
    assert (setting.name, setting.by_user) == ("", True)
    assert setting.describe() == "torch's default (this torch does not read your PYTORCH_ALLOC_CONF)"


def test_an_empty_allocator_variable_still_comes_first():
    """torch takes a variable that is present even when it is empty (its defaults, then): an empty
    one before the user's is what takes effect, and one lmcockpit would be ignored behind is removed."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    setting = gpu_env.allocator_setting(env, (2, 13), "linux")
    assert (setting.name, setting.value, setting.ignored) == ("PYTORCH_CUDA_ALLOC_CONF", "", ("PYTORCH_ALLOC_CONF",))
    env = {"PYTORCH_CUDA_ALLOC_CONF": ""}
    setting = gpu_env.configure_allocator(env)
    assert not setting.by_user and env == {setting.name: "expandable_segments:True"}


@pytest.mark.slow
def test_installed_torch_reads_the_allocator_variable_gpu_env_names():
    """The installed torch itself, with all three variables set to different values: the settings
    its allocator config parsed (the same config on a CPU-only build) are the ones gpu_env names."""
    env = {**{k: v for k, v in os.environ.items() if k not in gpu_env.ALLOC_VARS},
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
           "PYTORCH_HIP_ALLOC_CONF": "garbage_collection_threshold:0.7",
           "PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    code = "import torch; print(torch._C._accelerator_getAllocatorSettings())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    if "has no attribute '_accelerator_getAllocatorSettings'" in proc.stderr:
        pytest.skip(f"torch {torch.__version__} cannot say which settings it parsed")
    assert proc.returncode == 0, proc.stderr
    expected = gpu_env.allocator_setting(env, gpu_env.torch_version(), "linux")
    assert proc.stdout.strip() == expected.value, expected.name


@pytest.mark.slow
@pytest.mark.parametrize("users", [None, "garbage_collection_threshold:0.6"])
def test_engine_process_runs_with_the_allocator_setting(tmp_path, monkeypatch, users):
    for name in gpu_env.ALLOC_VARS:
        monkeypatch.delenv(name, raising=False)
    if users:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", users)
    engine, _ = drive_engine(tiny_config("training.max_steps=1", "eval.every=0"), tmp_path / "run")
    assert engine.final_state == P.FINISHED, engine.failure
    log = (tmp_path / "run" / "train.log").read_text()
    if users:
        assert f"allocator: PYTORCH_CUDA_ALLOC_CONF={users} (yours" in log
    else:
        name = gpu_env.alloc_var_name(gpu_env.torch_version())
        assert f"allocator: {name}=expandable_segments:True (set by lmcockpit" in log
