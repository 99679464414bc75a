"""The real engine process, spawned, driven through the protocol."""

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest

from lmcockpit.core import protocol as P
from lmcockpit.core.config import load_config
from lmcockpit.core.run.folder import read_metrics

from .helpers import drive_engine, losses, tiny_config


@pytest.mark.slow
def test_engine_runs_in_its_own_process_and_fills_the_run_folder(tmp_path):
    cfg = tiny_config()
    last_event_at = []

    def note_the_end(engine, event):
        if isinstance(event, P.StateChanged) and event.state in P.TERMINAL_STATES:
            last_event_at.append(time.monotonic())

    engine, events = drive_engine(cfg, tmp_path / "run", on_event=note_the_end)
    # gone at once after its last event (exit_now): with the interpreter's teardown it took 0.9 s
    # here, and lmcockpit --run, the cockpit's next launch and every test waited that long
    assert time.monotonic() - last_event_at[0] < 0.5
    assert engine.pid != os.getpid()
    assert engine.final_state == P.FINISHED and engine.process.exitcode == 0
    run = tmp_path / "run"
    # the engine wrote its own pid into train.log: the run really happened over there
    assert f"pid {engine.pid}" in (run / "train.log").read_text()
    for name in ["config.toml", "metrics.jsonl", "train.log", "tokenizer/tokenizer.json", "checkpoints/latest"]:
        assert (run / name).exists(), name
    started = next(e for e in events if isinstance(e, P.RunStarted))
    assert started.n_params > 0 and started.device == "cpu" and started.max_steps == 12
    steps = [e.step for e in events if isinstance(e, P.StepMetrics)]
    assert steps == list(range(1, 13))
    evals = [e.step for e in events if isinstance(e, P.EvalMetrics)]
    assert evals == [6, 12]
    states = [e.state for e in events if isinstance(e, P.StateChanged)]
    assert states[0] == P.PREPARING and states[-1] == P.FINISHED
    assert any(isinstance(e, P.LogLine) and "parameters" in e.text for e in events)
    assert any(isinstance(e, P.LogLine) and e.text == "attention: flash (CPU), GQA native" for e in events)


EXIT_NOW = """
import atexit, os, sys, threading
from concurrent.futures import ThreadPoolExecutor
from lmcockpit.core.process.child import exit_now

fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)

class FreedAtTeardown:
    def __del__(self, write=os.write):
        write(fd, b"teardown\\n")

kept = FreedAtTeardown()
atexit.register(lambda: os.write(fd, b"atexit\\n"))
def busy():  # still looping when exit_now is called (a loop of bytecodes lets the main thread run)
    for _ in range(3_000_000):
        pass
    os.write(fd, b"thread\\n")

threading.Thread(target=busy).start()
# a pool never shut down, as inductor leaves its own: its idle worker waits for work until told to go
pool = ThreadPoolExecutor(1)
pool.submit(int).result()
print("buffered in sys.stdout", end="")
exit_now(3)
"""


@pytest.mark.slow
def test_exit_now_skips_the_interpreters_teardown_but_not_what_matters(tmp_path):
    """The engine's and the chat engine's last call. Teardown freed torch's modules one by one, 0.9 s
    after every engine's last event; what of it matters still happens: the threads it would wait for
    finish (an idle pool's worker let go first, or the exit never ends), exit handlers run, and
    sys.stdout is flushed. The exit code is the one given."""
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe's stdout: block-buffered
    proc = subprocess.run([sys.executable, "-c", EXIT_NOW, str(log)], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered in sys.stdout"
    assert log.read_text().splitlines() == ["thread", "atexit"]


@pytest.mark.slow
def test_the_resolved_config_repeats_the_run_and_another_seed_does_not(tmp_path):
    """The run folder's config.toml is the config, and the same config trains the same losses."""
    cfg = tiny_config("training.max_steps=6", "optimizer.muon_lr=0.05", "training.grad_accum_steps=2")
    first = losses(drive_engine(cfg, tmp_path / "first")[1])
    written = tmp_path / "first" / "config.toml"
    text = written.read_text()
    assert "muon_lr = 0.05" in text and "grad_accum_steps = 2" in text and "max_steps = 6" in text
    again, _ = load_config(str(written))
    assert again == cfg
    assert len(first) == 6 and losses(drive_engine(again, tmp_path / "again")[1]) == first
    other = tiny_config("training.max_steps=6", "optimizer.muon_lr=0.05", "training.grad_accum_steps=2",
                        "training.seed=7")
    assert losses(drive_engine(other, tmp_path / "other")[1]) != first


@pytest.mark.slow
def test_bf16_trains_end_to_end_on_the_cpu(tmp_path):
    """precision bf16 on a CPU: the steps run under bf16 autocast (their losses close to fp32's,
    not equal), the weights stay fp32, and the run finishes with a checkpoint and an evaluation."""
    import math

    from safetensors.numpy import load_file

    short = ("training.max_steps=4", "eval.every=0")
    fp32 = losses(drive_engine(tiny_config(*short), tmp_path / "fp32")[1])
    engine, events = drive_engine(tiny_config(*short, "training.precision=\"bf16\""), tmp_path / "bf16")
    assert engine.final_state == P.FINISHED and engine.process.exitcode == 0, engine.failure
    started = next(e for e in events if isinstance(e, P.RunStarted))
    assert started.device == "cpu" and started.precision == "bf16"
    assert any(isinstance(e, P.LogLine) and "device cpu, precision bf16" in e.text for e in events)
    bf16 = losses(events)
    assert len(bf16) == len(fp32) == 4 and all(math.isfinite(x) for x in bf16)
    assert bf16 != fp32 and all(abs(a - b) < 0.05 * b for a, b in zip(bf16, fp32))
    [ev] = [e for e in events if isinstance(e, P.EvalMetrics)]
    assert math.isfinite(ev.val_loss) and ev.val_loss < bf16[0]
    weights = load_file(str(tmp_path / "bf16" / "checkpoints" / "step_000004" / "model.safetensors"))
    assert {str(w.dtype) for w in weights.values()} == {"float32"}


@pytest.mark.slow
def test_loss_falls_through_the_engine(tmp_path):
    _, events = drive_engine(tiny_config("training.max_steps=30", "eval.every=0"), tmp_path / "run")
    ls = losses(events)
    val = [e.val_loss for e in events if isinstance(e, P.EvalMetrics)]
    assert sum(ls[-5:]) / 5 < 0.85 * ls[0]
    assert val[-1] < 0.85 * ls[0]


def test_metrics_jsonl_schema(trained_run):
    run, proc = trained_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_metrics(run)
    assert all(isinstance(r["time"], float) for r in rows)
    kinds = {r["kind"] for r in rows}
    assert {"step", "eval", "checkpoint", "sample"} <= kinds
    step = read_metrics(run, "step")[0]
    # every field of the event, in its order (core/run/rows.py)
    assert list(step) == ["kind", "time", *(f.name for f in dataclasses.fields(P.StepMetrics))]
    steps = read_metrics(run, "step")
    assert [s["tokens_seen"] for s in steps] == [s["step"] * steps[0]["tokens_seen"] for s in steps]
    assert step["step"] == 1 and step["mfu"] is None and step["tokens_per_s"] > 0
    assert [r["step"] for r in read_metrics(run, "step")] == list(range(1, 13))
    ev = read_metrics(run, "eval")[-1]
    assert list(ev) == ["kind", "time", *(f.name for f in dataclasses.fields(P.EvalMetrics))] and ev["step"] == 12
    assert ev["core"] is None  # CORE only when every CORE task was scored
    assert set(ev["tasks"]) == {"python-functions"}  # trained_run scores the cpu preset's task
    assert set(ev["tasks"]["python-functions"]) == {"accuracy", "centered", "items"}
    val_loss, val_bpb = held_out_loss_and_bits_per_byte(run / "checkpoints" / "step_000012")
    assert ev["val_loss"] == pytest.approx(val_loss, rel=1e-4)
    assert ev["val_bpb"] == pytest.approx(val_bpb, rel=1e-4)
    ck = read_metrics(run, "checkpoint")
    assert [c["step"] for c in ck] == [6, 12] and all(os.path.isdir(c["path"]) for c in ck)
    sample = read_metrics(run, "sample")[-1]
    assert set(sample) == {"kind", "time", "step", "prompt", "text"} and sample["prompt"] == "def "


def held_out_loss_and_bits_per_byte(ckpt) -> tuple[float, float]:
    """The evaluation worked by hand from a checkpoint: the mean loss in nats per token over the
    eval windows, and the same targets' information in bits (nats / ln 2) per UTF-8 byte of
    text they stand for (end-of-text, which stands for no byte, is left out of the bits)."""
    import math

    import numpy as np
    import torch

    from lmcockpit.core.data import batches
    from lmcockpit.core.data.prepare import prepare
    from lmcockpit.core.infer.load import load

    loaded = load(ckpt, "cpu")
    cfg, t = loaded.cfg, loaded.cfg.training
    data = prepare(cfg, lambda line: None, lambda *a: None)
    nats, n_tokens, bits, n_bytes = 0.0, 0, 0.0, 0
    for starts in batches.eval_windows(len(data.val), cfg.eval.batches, t.micro_batch_size, t.seq_len):
        x, y = batches.rows_at(data.val, starts, t.seq_len)
        with torch.no_grad():
            token_nats = loaded.model.token_losses(torch.from_numpy(x), torch.from_numpy(y)).double().numpy()
        token_bytes = data.token_bytes[y]
        nats += token_nats.sum()
        n_tokens += token_nats.size
        bits += (token_nats[token_bytes > 0] / math.log(2)).sum()
        n_bytes += int(np.sum(token_bytes))
    return nats / n_tokens, bits / n_bytes


@pytest.mark.slow
def test_pause_holds_the_step_counter_resume_releases_it_and_abort_saves(tmp_path):
    seen = {"paused_at": None, "steps_while_paused": 0}

    def steer(engine, ev):
        if isinstance(ev, P.StepMetrics) and ev.step == 3:
            engine.send(P.Pause())
        elif isinstance(ev, P.StateChanged) and ev.state == P.PAUSED and seen["paused_at"] is None:
            seen["paused_at"] = "paused"
            engine.send(P.CheckpointNow())
        elif isinstance(ev, P.CheckpointWritten) and seen["paused_at"] == "paused":
            seen["paused_at"] = ev.step
            engine.send(P.Resume())
        elif isinstance(ev, P.StepMetrics) and seen["paused_at"] == "paused":
            seen["steps_while_paused"] += 1
        elif isinstance(ev, P.StepMetrics) and ev.step == 8:
            engine.send(P.Abort(save=True))

    engine, events = drive_engine(tiny_config("training.max_steps=50", "eval.every=0"), tmp_path / "run", steer)
    assert seen["steps_while_paused"] == 0
    assert seen["paused_at"] in (3, 4)  # paused within a step of asking, checkpointed while paused
    assert len(losses(events)) >= 8  # resumed: the steps went on
    assert engine.final_state == P.ABORTED and engine.process.exitcode == 0
    ck = [e.step for e in events if isinstance(e, P.CheckpointWritten)]
    assert ck[0] == seen["paused_at"] and len(ck) == 2 and 8 <= ck[1] < 50  # the abort's own checkpoint
    assert (tmp_path / "run" / "checkpoints" / f"step_{ck[1]:06d}" / "model.safetensors").is_file()


@pytest.mark.slow
def test_an_engine_killed_from_outside_is_reported_as_failed(tmp_path):
    def kill(engine, ev):
        if isinstance(ev, P.StepMetrics) and ev.step == 2:
            os.kill(engine.pid, signal.SIGKILL)

    engine, events = drive_engine(tiny_config("training.max_steps=500", "eval.every=0"), tmp_path / "run", kill)
    assert engine.final_state == P.FAILED
    assert "SIGKILL" in engine.failure.message
    # the engine could not record its own death; the front-end did, in the run folder
    assert "killed by SIGKILL" in (tmp_path / "run" / "train.log").read_text()
    assert "SIGKILL" in read_metrics(tmp_path / "run", "failure")[-1]["message"]


@pytest.mark.slow
def test_ctrl_c_while_the_engine_starts_up_is_left_to_the_front_end(tmp_path):
    # Ctrl-C reaches the whole foreground process group, the engine too, maybe while it is still
    # importing: it must not die of it (the front-end turns Ctrl-C into a command).
    engine, events = drive_engine(tiny_config(), tmp_path / "run", queued=[P.Abort(save=False)],
                                  on_start=lambda engine: os.kill(engine.pid, signal.SIGINT))
    assert engine.final_state == P.ABORTED and engine.process.exitcode == 0, engine.failure


@pytest.mark.slow
def test_an_exception_in_the_engine_arrives_with_its_traceback(tmp_path):
    # A token cache whose tokenizer file is damaged: nothing the engine expects, raised inside it.
    from lmcockpit.core.data.prepare import prepare

    cfg = tiny_config(f"data.cache_dir=\"{tmp_path / 'cache'}\"")
    data = prepare(cfg, lambda line: None, lambda *a: None)
    (data.tokenizer_dir / "tokenizer.json").write_text("{ not json")
    engine, events = drive_engine(cfg, tmp_path / "run")
    assert engine.final_state == P.FAILED and engine.process.exitcode == 1
    assert "Traceback" in engine.failure.traceback and not engine.failure.user_error
    assert read_metrics(tmp_path / "run", "failure")


def train_in_process(cfg, run_dir):
    """The trainer in this process, so its gradients can be looked at after every step:
    (losses, every step's gradient storage addresses, the trainer)."""
    import torch

    from lmcockpit.core.run.folder import create_run_dir
    from lmcockpit.core.train.trainer import Trainer

    steps, addresses = [], []
    trainer = None

    def emit(ev):
        if isinstance(ev, P.StepMetrics):
            steps.append(ev.loss)
            addresses.append([None if p.grad is None else p.grad.data_ptr() for p in trainer.model.parameters()])

    trainer = Trainer(cfg, create_run_dir(cfg, "test", str(run_dir)), emit, lambda line: None, lambda block: None)
    try:
        assert trainer.run() == P.FINISHED
    finally:
        trainer.close()
        torch._dynamo.reset()
        torch.use_deterministic_algorithms(False)  # the trainer set it for this whole process
    return steps, addresses, trainer


@pytest.mark.slow
def test_cuda_graph_modes_keep_gradients_and_train_the_same(tmp_path):
    """Under CUDA graphs ("reduce-overhead", "max-autotune") a gradient that backward creates lives
    in the graphs' pool, and the next replay overwrites it: accumulation would add a micro-batch's
    gradient to itself (memory_estimate.keeps_grads). So those modes allocate every gradient once and zero it in
    place. On a CPU they compile as the default mode does: the same losses, with and without
    evaluation and sampling between steps, while every gradient keeps its storage."""
    common = ("training.compile=true", "training.max_steps=4", "training.grad_accum_steps=2",
              "eval.every=2", "sample.every=2", "sample.prompts=[\"def \"]", "sample.max_new_tokens=4")
    default, default_grads, _ = train_in_process(tiny_config(*common), tmp_path / "default")
    graphs, graph_grads, trainer = train_in_process(
        tiny_config(*common, "training.compile_mode=\"reduce-overhead\""), tmp_path / "graphs")
    assert len(graphs) == 4 and graphs == default
    assert all(a is None for a in default_grads[0])  # the default mode frees them after each step
    assert None not in graph_grads[0] and all(step == graph_grads[0] for step in graph_grads)
    assert all(not p.grad.any() for p in trainer.model.parameters())  # zeroed, ready for the next step
