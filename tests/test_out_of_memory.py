"""A CUDA out-of-memory error, explained: in a training step, in validation or in task scoring it
ends the run with one message (the place, what was asked and free, what holds the memory, the key
to change) and a checkpoint that resumes; in sampling the sample is dropped and training goes on.

No GPU here to fill: the real engine, started by the real CLI, raises what the CUDA allocator
raises where LMCOCKPIT_TEST_OOM says (memory_probe.injected_oom). A real OOM on a GPU is
bench/gpu_check.py's part "oom"."""

from __future__ import annotations

import shlex

import pytest
import torch

from lmcockpit.core.config import load_config
from lmcockpit.core.hardware import memory_estimate
from lmcockpit.core.run.folder import list_checkpoints
from lmcockpit.core.train import memory_probe

from .helpers import NO_GPU, TINY, as_flags, cli, tiny_config

GiB = memory_estimate.GiB


def message(place: str, *overrides: str, snapshot: str | None = None) -> str:
    return memory_estimate.out_of_memory_message(tiny_config(*overrides), 6, memory_probe.TEST_OOM_TEXT, "NVIDIA H100",
                                                 80 * GiB, 30 * GiB, 4, place, snapshot=snapshot)


def test_the_message_says_what_was_asked_and_free_and_what_holds_the_memory():
    msg = message(memory_estimate.STEP, "training.micro_batch_size=8", "training.grad_accum_steps=2")
    assert msg.startswith("out of GPU memory in training step 6 (tried to allocate 2.00 GiB with 1.10 GiB free of "
                          "23.64 GiB): micro-batch 8 × ")
    est = memory_estimate.estimate(tiny_config("training.micro_batch_size=8", "training.grad_accum_steps=2"), "cuda")
    # Accumulating, so every gradient is there when the activations peak; the allocator's cache
    # is what torch's message says is reserved but unallocated.
    assert (f"holding (as estimated at micro-batch 8) parameters {est.weights / 1024:.2f} KiB, gradients "
            f"{est.grads / 1024:.2f} KiB, optimizer state {est.optimizer / 1024:.2f} KiB, activations "
            f"{est.activations / 2**20:.2f} MiB, the loss {est.loss / 2**20:.2f} MiB; the allocator's cache 300.00 MiB. "
            "Change: --set training.micro_batch_size=4 --set training.grad_accum_steps=4 (the same tokens per step), "
            "or training.auto_micro_batch=true, or training.activation_checkpointing=true; "
            "the checkpoint of step 4 is kept.") in msg
    assert "\n" not in msg


@pytest.mark.parametrize("place", [memory_estimate.VALIDATION, memory_estimate.TASKS])
def test_evaluation_is_told_its_own_batch_which_no_step_depends_on(place):
    msg = message(place, "training.micro_batch_size=8")
    assert msg.startswith(f"out of GPU memory in {place} after step 6 (tried to allocate 2.00 GiB")
    # Gradients are freed after each step: evaluation holds the weights, the optimizer state and its working set.
    assert "holding (as estimated at eval batch 8) parameters " in msg and "gradients" not in msg
    assert ", the working set between steps " in msg
    assert msg.split("Change: ")[1] == ("--set eval.batch_size=4 (validation and task scoring only; training's "
                                        "micro-batch stays); the checkpoint of step 4 is kept.")
    own = message(place, "eval.batch_size=5")
    assert "(as estimated at eval batch 5) " in own and "Change: --set eval.batch_size=2 (" in own
    assert message(place, "eval.batch_size=1").split("Change: ")[1].startswith(
        "in a new run: a shorter training.seq_len or a smaller model;")


def test_evaluation_in_its_own_batches_gives_the_same_loss_and_the_estimate_follows(tmp_path):
    """eval.batch_size splits the same windows otherwise: the same validation loss."""
    from lmcockpit.core.run.folder import create_run_dir
    from lmcockpit.core.train.trainer import Trainer

    losses = []
    for size in (0, 3):
        cfg = tiny_config("training.micro_batch_size=4", f"eval.batch_size={size}")
        trainer = Trainer(cfg, create_run_dir(cfg, "test", str(tmp_path / f"run{size}")), lambda e: None,
                          lambda line: None, lambda block: None)
        try:
            trainer.setup()
            losses.append(trainer.evaluation.validation_loss()["val_loss"])
        finally:
            trainer.close()
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    small, large = (memory_estimate.estimate(tiny_config("tokenizer.vocab_size=32768", f"eval.batch_size={n}"), "cpu")
                    for n in (1, 64))
    assert small.inference < large.inference and small.activations == large.activations


def test_a_sample_names_what_sizes_it_and_the_snapshot_where_it_went(tmp_path):
    path = memory_probe.snapshot_path(tmp_path / "run", 6)
    assert path == tmp_path / "run" / "profiles" / "oom_step_6" / "memory.pickle"
    assert memory_probe.snapshot_path(tmp_path / "run", 6, 1, 2).name == "memory_rank1.pickle"  # one a process
    msg = message(memory_estimate.SAMPLING, snapshot=str(path))
    assert msg.startswith("out of GPU memory in sampling after step 6 (")
    assert msg.endswith("Change: fewer samples or new tokens a request (sample.max_new_tokens for the periodic ones), "
                        f"or sample.every=0; the checkpoint of step 4 is kept; memory snapshot: {path} "
                        "(open it at pytorch.org/memory_viz).")


def test_the_hook_raises_what_cuda_raises_at_its_place_only(monkeypatch):
    monkeypatch.setenv("LMCOCKPIT_TEST_OOM", "validation@6")
    memory_probe.injected_oom("validation", 5)
    memory_probe.injected_oom("step", 6)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        memory_probe.injected_oom("validation", 6)
    assert memory_probe.oom_in(raised.value) is raised.value


# ---------------------------------------------------------------- the real engine, through the CLI
RUN = [*TINY, "checkpoint.every=4"]
TASKS = ['eval.tasks=["python-functions"]', "eval.max_per_task=8"]


def run(out, place: str, *overrides: str):
    return cli("--run", "debug", *as_flags([*RUN, *overrides]), "--out", str(out),
               env={**NO_GPU, "LMCOCKPIT_TEST_OOM": place})


@pytest.mark.slow
@pytest.mark.parametrize("place, where, kept, key, resume", [
    ("step@6", "in training step 6", 4, "Change: --set training.micro_batch_size=4 --set training.grad_accum_steps=2 (",
     True),
    ("validation@6", "in validation after step 6", 6, "Change: --set eval.batch_size=4 (", False),
    ("tasks@6", "in task scoring after step 6", 6, "Change: --set eval.batch_size=4 (", True),
])
def test_out_of_memory_ends_the_run_with_one_message_and_a_checkpoint_that_resumes(tmp_path, place, where, kept, key,
                                                                                   resume):
    out = tmp_path / "run"
    proc = run(out, place, *TASKS)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if "out of memory" in line]
    assert len(lines) == 1, output[-3000:]
    assert lines[0].startswith(f"run failed: out of memory {where} (tried to allocate 2.00 GiB with 1.10 GiB free of "
                               "23.64 GiB): micro-batch 8 × ")
    assert key in lines[0]
    assert lines[0].endswith(f"the checkpoint of step {kept} is kept.")
    assert list_checkpoints(out / "checkpoints")[-1].name == f"step_{kept:06d}"
    if resume:  # the kept checkpoint is whole: the run goes on from it to the end, with the change the message says
        change = shlex.split(lines[0].split("Change: ")[1].split(" (")[0])
        again = cli("--run", "--resume", str(out), *change, env=NO_GPU)
        assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
        assert "finished 12 steps" in again.stdout
        last = list_checkpoints(out / "checkpoints")[-1]
        assert last.name == "step_000012"
        changed = load_config(last / "config.toml")[0]
        assert (changed.training.micro_batch_size, changed.eval.batch_size) == ((4, 0) if place == "step@6" else (8, 4))


@pytest.mark.slow
def test_a_sample_that_runs_out_of_memory_is_dropped_and_the_run_finishes(tmp_path):
    """A sample (periodic, or asked from the chat pane) never ends a run of one process."""
    proc = run(tmp_path / "run", "sampling@6", 'sample.prompts=["def "]', "sample.every=6")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    assert ("warning: sample request 'periodic-6-0' ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB. "
            in output) and "1 row(s) × " in output and "was dropped; training goes on" in output
    assert "finished 12 steps" in output
    assert "sample at step 12: " in output  # the next one, at the end, is answered
