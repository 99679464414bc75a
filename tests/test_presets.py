import subprocess
import sys

import pytest

from lmcockpit.core.config import ConfigError, load_config, shipped_presets
from lmcockpit.core.hardware import memory_estimate

from .helpers import NO_GPU, cli

GPU_PRESETS = {"3060": 12, "4070ti": 12, "3090": 24, "4090": 24, "a100-40gb": 40, "a100-80gb": 80, "h100": 80}
# Reference runs sized to a known result, not to fill a card (tests/test_gpt2_preset.py).
REFERENCE_PRESETS = {"gpt2-fineweb", "gpt2-speedrun"}
# Fine-tuning runs from a base model (--from: tests/test_finetune.py).
CHAT_PRESETS = {"chat-cpu"}


def test_every_gpu_class_has_a_preset():
    assert set(GPU_PRESETS) | {"cpu", "debug"} | REFERENCE_PRESETS | CHAT_PRESETS == set(shipped_presets())


@pytest.mark.parametrize("name", sorted(GPU_PRESETS))
def test_gpu_preset_fits_its_class_with_headroom_and_uses_it(name):
    cfg, _ = load_config(name)
    hw, t = cfg.hardware, cfg.training
    assert hw.vram_gb == GPU_PRESETS[name] and hw.gpu_class not in ("", "cpu")
    assert hw.device == "auto" and t.precision == "auto" and t.compile
    card = int(hw.vram_gb * memory_estimate.GiB)
    needed = memory_estimate.estimate(cfg, "cuda").total
    assert needed <= 0.9 * card, f"{name}: {needed / memory_estimate.GiB:.1f} GiB of {hw.vram_gb} GB leaves under 10% free"
    assert memory_estimate.verdict(needed, card) == "fits"
    assert needed >= 0.6 * card, f"{name}: {needed / memory_estimate.GiB:.1f} GiB leaves most of a {hw.vram_gb} GB card idle"


def test_bigger_cards_get_bigger_models():
    params = {name: memory_estimate.param_counts(load_config(name)[0]).total for name in GPU_PRESETS}
    assert params["3060"] < params["4070ti"] < params["3090"] < params["4090"] < params["a100-40gb"]
    assert params["a100-40gb"] < params["a100-80gb"] < params["h100"]


@pytest.mark.slow
def test_presets_command_lists_every_preset_against_this_machines_gpu_or_its_class():
    """Without a GPU each preset is judged against the class it was sized for; with one (NVML's,
    which CUDA_VISIBLE_DEVICES does not hide), against the largest card here. The test reads the
    machine as the command does, so it holds on both."""
    from lmcockpit.core.hardware.telemetry import Telemetry

    cards = Telemetry().read().gpus
    proc = cli("presets")
    assert proc.returncode == 0, proc.stderr
    card = max(cards, key=lambda g: g.mem_total) if cards else None
    title = " ".join(proc.stdout.split())  # as read, whatever the table's width wrapped
    if card is None:
        assert "no GPU found" in title and "judged against the GPU class it was sized for" in title
    else:
        assert f"verdicts for GPU {card.index}: {card.name}, {card.mem_total / memory_estimate.GiB:.1f} GiB" in title
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.split() and line.split()[0] in
            shipped_presets()}
    assert set(rows) == set(shipped_presets())
    for name in GPU_PRESETS:
        cfg, _ = load_config(name)
        assert f"{memory_estimate.param_counts(cfg).total / 1e6:.1f}M" in rows[name]
        assert f"{cfg.tokens_per_step:,}" in rows[name]
        assert f"{memory_estimate.estimate(cfg, 'cuda').total / memory_estimate.GiB:.1f} GiB" in rows[name]
        if card is None:
            assert rows[name].rstrip().endswith("fits")  # each fits the class it was sized for
    for name in shipped_presets():
        verdict = memory_estimate.judge(load_config(name)[0], card.mem_total if card else None)[1]
        assert rows[name].rstrip().endswith(verdict), (name, verdict, rows[name])
    if card is None:
        assert rows["cpu"].rstrip().endswith("–")  # no GPU and no class to judge against


@pytest.mark.slow
def test_presets_command_judges_against_a_given_card():
    proc = cli("presets", "--memory", "16")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.rstrip() for line in proc.stdout.splitlines() if line.split()}
    assert rows["3060"].endswith("fits") and rows["h100"].endswith("does not fit")
    assert cli("presets", "--memory", "0").returncode == 2


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--memory", "nan"], "--memory nan: expected a positive, finite number of GiB"),
    (["--memory", "inf"], "--memory inf: expected a positive, finite number of GiB"),
    (["--memory=-inf"], "--memory -inf: expected a positive, finite number of GiB"),
    (["--memory", "1e999"], "--memory inf: expected a positive, finite number of GiB"),
    (["--memory", "lots"], "argument --memory: invalid float value: 'lots' (see `lmcockpit presets --help`)"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate (see `lmcockpit presets --help`)"),
])
def test_presets_command_refuses_bad_arguments_in_one_line(args, message):
    proc = cli("presets", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == f"error: {message}\n" and proc.stdout == ""


@pytest.mark.slow
def test_presets_command_imports_no_torch():
    code = ("import sys; from lmcockpit.tui.commands.presets import main; rc = main([]); "
            "print('torch imported' if 'torch' in sys.modules else 'torch-free', rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().endswith("torch-free 0"), proc.stdout + proc.stderr


@pytest.mark.parametrize("override, message", [
    ("training.compile_mode=\"fast\"", "training.compile_mode = 'fast' is not one of 'default' | "
                                       "'max-autotune-no-cudagraphs' | 'reduce-overhead' | 'max-autotune'"),
    ("training.auto_micro_batch=1", "training.auto_micro_batch must be true or false, got an integer 1"),
    ("training.activation_checkpointing=\"yes\"", "training.activation_checkpointing must be true or false"),
    ("training.compile_mode=\"max-autotune\"", "training.compile_mode = 'max-autotune' needs training.compile = true"),
    ("hardware.vram_gb=-24", "hardware.vram_gb = -24.0 must be 0 or more"),
])
def test_bad_values_of_the_gpu_keys_are_named(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("debug", [override])  # debug does not compile
    assert message in str(e.value)


@pytest.mark.slow
def test_bad_gpu_key_on_the_command_line_exits_2(tmp_path):
    proc = cli("--run", "h100", "--set", "training.compile_mode=turbo", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert "--set: training.compile_mode = 'turbo' is not one of" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_the_flops_a_token_costs_are_counted_without_torch_as_the_model_counts_them():
    from lmcockpit.core.hardware.compute_estimate import flops_per_token
    from lmcockpit.core.model.gpt import GPT, shape_from_config

    for name, overrides in (("debug", []), ("cpu", []), ("debug", ["model.n_kv_head=1", "model.head_dim=32"])):
        cfg = load_config(name, overrides)[0]
        model = GPT(shape_from_config(cfg))
        assert flops_per_token(cfg) == model.flops_per_token(cfg.training.seq_len), (name, overrides)


def test_training_time_is_the_run_s_flops_over_the_card_s_peak_at_the_stated_mfu():
    from lmcockpit.core.hardware.compute_estimate import (ASSUMED_MFU, MEASURED_MFU, PEAK_BF16_TFLOPS, card_model,
                                                          flops_per_token, training_time)

    for name in shipped_presets():
        cfg = load_config(name)[0]
        took = training_time(cfg, cfg.hardware.gpu_class)
        if cfg.hardware.gpu_class == "cpu":
            assert took is None  # no peak: no figure rather than a wrong one
            continue
        assert took is not None, name  # every GPU class a preset is sized for has a peak
        flops = cfg.training.max_steps * cfg.tokens_per_step * flops_per_token(cfg)
        mfu = MEASURED_MFU.get(took.card)  # a card a GPU run has measured (bench/RESULTS.md) uses its own
        assert took.seconds == pytest.approx(flops / (PEAK_BF16_TFLOPS[took.card] * 1e12 * (mfu or ASSUMED_MFU)))
        if mfu is None:
            assert not took.measured and took.short().endswith("*") and "assumed" in took.note()
        else:
            assert took.measured and not took.short().endswith("*") and f"{mfu:.0%} MFU (measured" in took.note()
    assert training_time(load_config("h100")[0], "H100").measured  # the lent H100 of 2026-11-27
    assert card_model("NVIDIA A100-SXM4-80GB") == card_model("A100 80GB") == "nvidia a100 sxm4"
    assert card_model("NVIDIA GeForce RTX 4090") == card_model("RTX 4090") == "nvidia geforce rtx 4090"
    assert card_model("NVIDIA GeForce RTX 4090 Laptop GPU") is None and card_model("cpu") is None
    # Two processes: twice the tokens a step, on twice the cards.
    one, two = load_config("h100")[0], load_config("h100", ["distributed.nproc=2"])[0]
    assert two.tokens_per_step == 2 * one.tokens_per_step
    assert training_time(two, "H100").seconds == pytest.approx(training_time(one, "H100").seconds)


@pytest.mark.slow
def test_presets_command_says_how_long_each_preset_should_train():
    from lmcockpit.core.hardware.compute_estimate import training_time

    r = cli("presets", env=NO_GPU)
    assert r.returncode == 0, r.stderr
    [line] = [line for line in r.stdout.splitlines() if line.startswith("Training time")]
    # H100's MFU measured on the lent card (bench/RESULTS.md), the others assumed
    assert line.startswith("Training time on the card each was sized for") and "49% on h100 (measured), else 40% MFU" in line
    h100 = load_config("h100")[0]
    assert f"h100 {training_time(h100, 'H100').short()}" in line and "cpu –" in line


@pytest.mark.slow
def test_the_cpu_preset_trains_with_every_option_it_ships(tmp_path):
    """The speedrun's options the cpu preset has (#55), at a narrow width, through the real engine:
    the 128-token context for the first half of the steps, then 256; its value embedding, skip
    weights and ReLU² MLP in the checkpoint."""
    from safetensors.numpy import load_file

    from lmcockpit.core import protocol as P
    from lmcockpit.core.run.folder import latest_checkpoint

    from .helpers import drive_engine

    cfg, _ = load_config("cpu", [
        "model.d_model=64", "tokenizer.vocab_size=512", "tokenizer.train_bytes=300_000", "data.max_bytes=1_000_000",
        "training.max_steps=4", "training.micro_batch_size=2", "training.compile=false", "eval.every=0",
        "eval.tasks=[]", "checkpoint.every=4", "sample.prompts=[]", 'hardware.device="cpu"'])
    m = cfg.model
    assert (m.mlp, m.zero_init_proj, m.value_embeds, m.unet_skips, cfg.optimizer.normuon) == ("relu2", True, 1, True, True)
    engine, events = drive_engine(cfg, tmp_path / "run")
    assert engine.final_state == P.FINISHED
    said = [e.text for e in events if isinstance(e, P.LogLine)]
    assert any("from step 1, 1 micro-batch(es) a process (1 of the step's sequences), sequence length 128" in s
               for s in said), said
    assert any("from step 3, 1 micro-batch(es) a process (1 of the step's sequences), sequence length 256" in s
               for s in said), said
    steps = [e for e in events if isinstance(e, P.StepMetrics)]
    assert [e.tokens_seen for e in steps] == [256, 512, 1024, 1536]  # 2 rows of 128, then of 256
    weights = load_file(str(latest_checkpoint(tmp_path / "run") / "model.safetensors"))
    assert "value_embeds.0.weight" in weights and "skip_weights" in weights
    assert not any("gate_proj" in k for k in weights) and weights["layers.0.mlp.up_proj.weight"].shape == (1024, 64)


def test_chat_cpu_fine_tunes_the_cpu_presets_model_as_shipped():
    """chat-cpu repeats the cpu preset's [model] (a fine-tune keeps its base's shape, --from checks
    it): a change to one that misses the other would refuse every `--run chat-cpu --from` a cpu run."""
    from lmcockpit.core.data.base_model import shape

    assert shape(load_config("chat-cpu")[0]) == shape(load_config("cpu")[0])
