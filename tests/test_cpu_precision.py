"""precision = "auto" on a CPU: a probe's verdict, cached per CPU model, torch version and shape."""

import dataclasses
import json
import math

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.config import load_config
from lmcockpit.core.hardware import cpu_precision as cp
from lmcockpit.core.hardware import memory_estimate
from lmcockpit.core.hardware.device import choose_precision
from lmcockpit.core.run.folder import read_metrics

from .helpers import cli, cpu_verdict, drive_engine, losses, tiny_config


@pytest.mark.parametrize("fp32_ms, bf16_ms, chosen", [
    (921, 582, "bf16"),  # AMD EPYC, AVX512-BF16: 1.58×
    (1150, 720, "bf16"),
    (720, 1150, "fp32"),  # Xeon with AVX512-BF16, no AMX: bf16 slower
    (110, 100, "fp32"),  # 1.10×: within noise, not worth bf16's rounding
    (115, 100, "bf16"),  # the margin itself takes bf16
])
def test_bf16_only_when_it_is_clearly_faster(fp32_ms, bf16_ms, chosen):
    v = cp.decide(fp32_ms / 1e3, bf16_ms / 1e3)
    assert v.precision == chosen
    assert v.speedup == pytest.approx(fp32_ms / bf16_ms, abs=1e-3)
    assert (v.fp32_ms, v.bf16_ms) == (pytest.approx(fp32_ms), pytest.approx(bf16_ms))
    assert choose_precision("auto", "cpu", False, v.precision == "bf16") == chosen
    assert choose_precision("fp32", "cpu", False, True) == "fp32"  # an explicit precision stays


def test_the_verdict_says_what_was_measured():
    assert cp.decide(0.921, 0.582).note() == "auto: 1.58× fp32 on this CPU"
    assert cp.decide(0.720, 1.150).note() == "auto: bf16 measured 0.63× fp32 on this CPU, under 1.15×"
    assert cp.Verdict("fp32", why="no bf16 instructions in this CPU").note() == "auto: no bf16 instructions in this CPU"


def test_a_verdict_probed_at_one_shape_does_not_decide_another(tmp_path, monkeypatch):
    """A first run of the debug preset (bf16 0.64x fp32 on a Xeon with AMX) must not keep the cpu
    preset (2.0x there) in fp32: each shape is probed once, its verdict kept under it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    debug, cpu = tiny_config(), load_config("cpu")[0]
    assert cp.probe_shape(debug) == "8×64 tokens, d_model 64, 4/2 heads, swiglu 192, vocab 512"
    assert cp.probe_shape(cpu) == "16×256 tokens, d_model 256, 4/2 heads, relu2 1024, vocab 8192"
    cp.store(cp.decide(0.00589, 0.00918), cp.cache_key(shape=cp.probe_shape(debug)))
    assert cp.known(debug).precision == "fp32"
    assert cp.known(cpu) is None or cp.has_bf16() is False  # to be probed at its own shape
    cp.store(cp.decide(0.120, 0.060), cp.cache_key(shape=cp.probe_shape(cpu)))
    assert (cp.known(debug).precision, cp.known(cpu).precision) == ("fp32", "bf16")
    # An older lmcockpit's entry, one per CPU and torch whatever shape probed it, is not read.
    (tmp_path / "lmcockpit" / "cpu-precision.json").write_text(json.dumps(
        {f"{cp.cpu_model()} | torch {cp.torch_version()}": dataclasses.asdict(cp.decide(0.1, 0.2))}))
    assert cp.known(cpu) is None or cp.has_bf16() is False
    cp.store(cp.Verdict("fp32", why="pinned"))  # for any shape (the suite's pin): every shape's
    assert cp.known(debug) == cp.known(cpu) == cp.Verdict("fp32", why="pinned")


def test_the_cache_is_kept_per_cpu_model_and_torch_version(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cp.cached() is None
    epyc = cp.cache_key("AMD EPYC", "2.13.0+cpu")
    verdict = cp.decide(0.921, 0.582, "1 block")
    cp.store(verdict, epyc)
    assert cp.cache_path() == tmp_path / "lmcockpit" / "cpu-precision.json"
    assert cp.cached(epyc) == verdict
    assert cp.cached(cp.cache_key("Intel(R) Xeon(R) Processor", "2.13.0+cpu")) is None  # another CPU
    assert cp.cached(cp.cache_key("AMD EPYC", "2.14.0+cpu")) is None  # another torch
    xeon = cp.cache_key("Intel(R) Xeon(R) Processor", "2.13.0+cpu")
    cp.store(cp.decide(0.72, 1.15), xeon)
    assert cp.cached(epyc) == verdict and cp.cached(xeon).precision == "fp32"  # both kept
    assert set(json.loads(cp.cache_path().read_text())) == {epyc, xeon}
    cp.cache_path().write_text("{half a file")  # damaged: measured again, and written whole
    assert cp.cached(epyc) is None
    cp.store(verdict, epyc)
    assert cp.cached(epyc) == verdict


def test_a_first_run_probes_once_and_later_ones_read_the_verdict(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = tiny_config()
    log = []
    first = cp.choose(cfg, log.append)
    if cp.has_bf16() is False:  # nothing to measure on this CPU
        assert first == cp.Verdict("fp32", why="no bf16 instructions in this CPU") and not log
        return
    assert len(log) == 1 and "timing fp32 against bf16 on this CPU" in log[0]
    assert first.speedup == pytest.approx(first.fp32_ms / first.bf16_ms, rel=1e-2)
    assert first.precision == ("bf16" if first.speedup >= cp.MARGIN else "fp32")
    assert "1 block, 8×64 tokens, d_model 64, 4/2 heads, swiglu 192, vocab 512" in first.probe
    again = []
    assert cp.choose(cfg, again.append) == first and not again  # read, not measured
    assert cp.cached(cp.cache_key(shape=cp.probe_shape(cfg))) == first and cp.cached() is None  # its shape's only


def test_the_memory_estimate_follows_the_cached_verdict():
    cfg = tiny_config()
    with cpu_verdict(cp.decide(0.921, 0.582)):
        assert memory_estimate.amp_bytes(cfg, "cpu") == 2
        bf16 = memory_estimate.estimate(cfg, "cpu")
    with cpu_verdict(cp.decide(0.72, 1.15)):
        assert memory_estimate.amp_bytes(cfg, "cpu") == 4
        assert memory_estimate.estimate(cfg, "cpu") != bf16
    assert memory_estimate.amp_bytes(tiny_config('training.precision="bf16"'), "cpu") == 2


def header_of(events) -> str:
    return next(e.text for e in events if isinstance(e, P.LogLine) and e.text.startswith("model:"))


@pytest.mark.slow
def test_auto_trains_in_bf16_where_measured_faster_and_a_resume_keeps_it(tmp_path):
    from lmcockpit.core.run.resume import plan_resume

    run = tmp_path / "run"
    with cpu_verdict(cp.decide(0.921, 0.582, "1 block, 16×256 tokens")):
        engine, events = drive_engine(tiny_config("training.max_steps=30", "eval.every=10", "checkpoint.every=30"), run)
    assert engine.final_state == P.FINISHED
    assert next(e for e in events if isinstance(e, P.RunStarted)).precision == "bf16"
    assert "device cpu, precision bf16 (auto: 1.58× fp32 on this CPU)," in header_of(events)
    curve = losses(events)
    assert all(math.isfinite(v) for v in curve) and sum(curve[-5:]) / 5 < curve[0] - 1.0, curve
    vals = [r["val_loss"] for r in read_metrics(run, "eval")]
    assert len(vals) == 3 and all(math.isfinite(v) for v in vals) and vals[-1] < vals[0]
    # Measured again, now fp32 (another CPU, a deleted cache): the run goes on in what it trained in.
    with cpu_verdict(cp.decide(0.72, 1.15)):
        engine, events = drive_engine(None, None, resume=plan_resume(str(run), ["training.max_steps=34"], None))
    assert engine.final_state == P.FINISHED
    assert next(e for e in events if isinstance(e, P.RunStarted)).precision == "bf16"
    assert "precision bf16 (auto: kept from the checkpoint)," in header_of(events)


@pytest.mark.slow
def test_a_run_with_nothing_cached_probes_and_says_what_it_chose(tmp_path):
    with cpu_verdict(None):
        proc = cli("--run", "debug", "--out", str(tmp_path / "run"), "--set", "training.max_steps=2",
                   "--set", "eval.every=0", "--set", "sample.prompts=[]", "--set", 'hardware.device="cpu"')
        verdict = cp.known(load_config("debug")[0])
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if "model:" in line)
    assert f"precision {verdict.precision} ({verdict.note()})," in header
    if verdict.speedup is not None:
        assert "timing fp32 against bf16 on this CPU" in proc.stdout


def test_doctor_with_nothing_cached_measures_and_says_what_it_chose():
    """The doctor's own probe, as its torch-side child runs it (the whole doctor command, with a
    verdict measured before: tests/test_doctor.py)."""
    from lmcockpit.core.hardware.doctor import cpu_precision_facts
    from lmcockpit.tui.commands.doctor import cpu_precision_check

    with cpu_verdict(None):  # nothing cached: the doctor probes at the cpu preset's shape, as a first run would
        facts = cpu_precision_facts()
        verdict = cp.known(load_config("cpu")[0])
    check = cpu_precision_check(facts)
    if verdict.speedup is None:
        assert (check.status, check.detail) == ("info", f"fp32 ({verdict.why})")
    else:
        assert check.status == "ok" and "measured now" in check.detail
        assert check.detail.startswith(f'precision "auto" trains in {verdict.precision}:')
        assert "16×256 tokens, d_model 256, 4/2 heads, relu2 1024, vocab 8192" in check.detail
