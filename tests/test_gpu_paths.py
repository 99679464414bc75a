"""Issue 20's GPU defects, where their logic runs on a CPU: evaluation's and sampling's memory
against the estimate, out-of-memory errors outside the training step, device random states on
fewer GPUs, DDP's gradients kept as bucket views, the peak reset after the micro-batch search.
What only a GPU can show is in bench/gpu_check.py's runbook."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from lmcockpit.core import protocol as P
from lmcockpit.core.hardware import memory_estimate
from lmcockpit.core.model.gpt import GPT, shape_from_config
from lmcockpit.core.model.sampling import generate
from lmcockpit.core.run.folder import create_run_dir, list_checkpoints
from lmcockpit.core.train import checkpoint_io, memory_probe
from lmcockpit.core.train.trainer import Trainer, run_in_process

from .helpers import cpu_bytes_held, tiny_config

GPU_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 7.63 GiB of which 1.2 GiB is free."


def model_with_vocabulary(vocab: int, *overrides: str) -> tuple[object, GPT]:
    cfg = tiny_config(f"tokenizer.vocab_size={vocab}", *overrides)
    torch.manual_seed(0)
    return cfg, GPT(shape_from_config(cfg)).eval()


# ------------------------------------------------------------------------------- memory
@pytest.mark.slow
@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_evaluation_with_a_large_vocabulary_peaks_where_fit_says(amp):
    """A 32k vocabulary against a 64-wide model: the whole (tokens × vocabulary) float32 logits
    and their log-probabilities took 8× the blockwise loss here."""
    cfg, model = model_with_vocabulary(32768, "training.micro_batch_size=16")
    tokens = 16 * cfg.training.seq_len
    x, y = (torch.randint(0, 32768, (16, cfg.training.seq_len)) for _ in range(2))

    def evaluate():
        with torch.no_grad(), torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
            model.token_losses(x, y)

    a = 2 if amp else 4
    n = memory_estimate.param_counts(cfg)
    casts = 2 * (n.matrices + n.embedding) if amp else 0  # autocast's copies, held until it exits
    expected = memory_estimate.inference_bytes(cfg, a, tokens, "cpu") + casts
    assert cpu_bytes_held(evaluate) == pytest.approx(expected, rel=0.01)
    assert expected < tokens * 32768 * 4 / 3  # a third of one float32 copy of the logits


def test_evaluation_losses_are_the_losses_of_the_whole_logits(monkeypatch):
    from lmcockpit.core.model.gpt import LinearCrossEntropy

    cfg, model = model_with_vocabulary(512)
    x, y = (torch.randint(0, 512, (3, 40)) for _ in range(2))
    with torch.no_grad():
        whole = torch.nn.functional.cross_entropy(model(x).transpose(1, 2), y, reduction="none")
        monkeypatch.setattr(LinearCrossEntropy, "BLOCK_ELEMENTS", 512 * 7)  # 7 rows a block, 120 rows
        assert torch.allclose(model.token_losses(x, y), whole, atol=1e-5)


def test_sampling_at_a_full_context_peaks_where_fit_says():
    """A prompt of the whole context, prefilled beside the KV cache of every layer."""
    cfg, model = model_with_vocabulary(4096, "model.d_model=128")
    ctx = cfg.max_seq_len
    prompt = torch.randint(0, 4096, (ctx,)).tolist()
    held = cpu_bytes_held(lambda: list(generate(model, prompt, 4, seed=1)))
    m = cfg.model
    sampling = 2 * m.n_layer * ctx * m.n_kv_head * cfg.head_dim * 4 + ctx * memory_estimate.inference_layer_bytes(cfg, 4)
    assert held == pytest.approx(sampling, rel=0.01)
    assert memory_estimate.inference_bytes(cfg, 4, cfg.training.seq_len, "cpu") >= sampling


def test_the_estimate_counts_evaluation_beside_what_stays_held():
    cfg = tiny_config("tokenizer.vocab_size=32768", "training.micro_batch_size=4")
    e = memory_estimate.estimate(cfg, "cpu")
    n = memory_estimate.param_counts(cfg)
    between = 4 * n.total + 8 * n.adamw + 4 * n.muon  # fp32 weights and moments; gradients freed after the step
    assert e.inference == between + memory_estimate.inference_bytes(cfg, 4, 4 * cfg.training.seq_len, "cpu")
    assert e.allocated >= e.inference


# ----------------------------------------------------------------------- out of memory
class OutOfMemoryIn(Trainer):
    """A real trainer on the CPU whose evaluation or sampling raises what the CUDA allocator
    raises when the card is full: no GPU here to fill."""

    def __init__(self, where: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.where = where

    def setup(self) -> None:
        super().setup()

        def full(*args, **kwargs):
            raise torch.OutOfMemoryError(GPU_OOM)

        setattr(self.model, self.where, full)


def trainer_with_oom(where: str, tmp_path, *overrides: str, commands=()) -> tuple[Trainer, list, list[str]]:
    cfg = tiny_config("training.max_steps=6", "eval.every=3", "checkpoint.every=0", *overrides)
    events, lines, queue = [], [], list(commands)
    trainer = OutOfMemoryIn(where, cfg, create_run_dir(cfg, "test", str(tmp_path / "run")), events.append,
                            lines.append, lambda block: queue.pop(0) if queue else None)
    return trainer, events, lines


@pytest.mark.slow
def test_running_out_of_memory_in_evaluation_saves_the_step_and_says_so(tmp_path):
    trainer, events, _ = trainer_with_oom("token_losses", tmp_path)
    try:
        with pytest.raises(memory_probe.OutOfMemory) as failure:
            trainer.run()
    finally:
        trainer.close()
    message = str(failure.value)
    assert message.startswith("out of memory in validation after step 3 (tried to allocate 2.00 GiB with 1.2 GiB free "
                              "of 7.63 GiB): micro-batch ")
    assert message.endswith("; the checkpoint of step 3 is kept.")
    # The weights of step 3 were whole: they are on disk, a run that resumes from them loses nothing.
    assert [c.name for c in list_checkpoints(trainer.run_dir / "checkpoints")] == ["step_000003"]
    assert isinstance(memory_probe.OutOfMemory(message), P.RunFailure)  # reported as a message, no traceback
    assert not any(isinstance(e, P.EvalMetrics) for e in events)


@pytest.mark.slow
def test_a_sample_that_runs_out_of_memory_is_dropped_and_training_goes_on(tmp_path):
    request = P.Sample("chat-1", "def ", 16, 1.0, 0, seed=1, num_samples=64)
    trainer, events, lines = trainer_with_oom("decode", tmp_path, commands=[request])
    try:
        assert trainer.run() == P.FINISHED
    finally:
        trainer.close()
    assert trainer.step == 6
    warning = next(line for line in lines if "chat-1" in line)
    assert warning.startswith("warning: sample request 'chat-1' ran out of memory (CUDA out of memory. Tried to "
                              "allocate 2.00 GiB.") and "64 row(s) × 16 new tokens was dropped; training goes on" in warning
    # The chat pane is told the request is over, so it does not wait for it.
    assert any(isinstance(e, P.SampleText) and e.request_id == "chat-1" and e.done for e in events)


# ------------------------------------------------------------------- device random state
def test_two_saved_gpu_random_states_resume_on_one_gpu():
    states = {"python": None, "cuda_by_rank": ["rank0", "rank1"]}
    cuda0 = torch.device("cuda", 0)
    assert checkpoint_io.device_rng_plan(states, 0, 1, cuda0) == (
        "rank0", "the GPU random states of 1 rank(s) beyond the 1 now running are not used")
    assert checkpoint_io.device_rng_plan(states, 1, 2, torch.device("cuda", 1)) == ("rank1", "")
    assert checkpoint_io.device_rng_plan(states, 2, 4, cuda0)[0] is None  # a rank the checkpoint never had
    # Checkpoints written before per-rank states: every GPU the saving process saw, by CUDA index.
    legacy = {"cuda": ["gpu0", "gpu1"]}
    assert checkpoint_io.device_rng_plan(legacy, 0, 1, cuda0) == ("gpu0", "")
    assert checkpoint_io.device_rng_plan({"cuda": ["gpu0"]}, 0, 1, torch.device("cuda", 1)) == (
        None, "no GPU random state for cuda:1 in the checkpoint (it has 1): it starts from the seed")
    assert checkpoint_io.device_rng_plan(legacy, 0, 1, torch.device("cpu"))[1] == (
        "the checkpoint's 2 GPU random state(s) are not used on the CPU")


@pytest.mark.slow
def test_a_checkpoint_from_two_gpus_resumes_on_the_cpu_and_says_what_is_not_exact(tmp_path):
    cfg = tiny_config("training.max_steps=2", "eval.every=0")
    first = run_in_process(cfg, create_run_dir(cfg, "test", str(tmp_path / "run")), log=lambda line: None)
    ckpt = list_checkpoints(first.run_dir / "checkpoints")[-1]
    state = json.loads((ckpt / "state.json").read_text())
    assert "cuda_by_rank" not in state["rng"]  # a CPU run saves no GPU state
    gpu_state = checkpoint_io._b64(torch.get_rng_state()[:16])
    state["rng"]["cuda_by_rank"] = [gpu_state, gpu_state]
    (ckpt / "state.json").write_text(json.dumps(state))
    lines: list[str] = []
    more = tiny_config("training.max_steps=3", "eval.every=0")
    resumed = run_in_process(more, create_run_dir(more, "test", str(tmp_path / "again")), log=lines.append,
                             resume_from=ckpt)
    assert resumed.step == 3
    assert "resume: the checkpoint's 2 GPU random state(s) are not used on the CPU" in lines


# --------------------------------------------------------------------------------- DDP
DDP_PROBE = textwrap.dedent("""
    import json, os, sys, warnings
    import torch
    from lmcockpit.core.run.folder import create_run_dir
    from lmcockpit.core.train.group import ProcessGroup
    from lmcockpit.core.train.trainer import Trainer
    from tests.helpers import tiny_config

    device = os.environ.get("LMCOCKPIT_PROBE_DEVICE", "cpu")  # bench/gpu_check.py's ddp part: "cuda"
    cfg = tiny_config("training.grad_accum_steps=2", "eval.every=0", "checkpoint.every=0",
                      f"hardware.device={json.dumps(device)}")
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        trainer = Trainer(cfg, create_run_dir(cfg, "ddp", sys.argv[1]), lambda e: None, lambda line: None,
                          lambda block: None, group=ProcessGroup("ddp"))
        trainer.setup()
    steps = []
    for _ in range(3):
        trainer.train_step()
        grads = [p.grad for p in trainer.model.parameters()]
        steps.append({"none": sum(g is None for g in grads),
                      "zero": all(not g.any() for g in grads if g is not None),
                      "storages": sorted({g.untyped_storage().data_ptr() for g in grads if g is not None}),
                      "allocated": torch.cuda.memory_allocated() if device == "cuda" else 0})
    deprecated = [str(w.message) for w in caught if "broadcast_buffers" in str(w.message)]
    print(json.dumps({"params": len(grads), "steps": steps, "deprecated": deprecated}))
    trainer.close()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ddp_gradients_stay_views_into_its_buckets_across_steps(tmp_path):
    """A torchrun group of one on gloo, as `--nproc 1` runs: DDP wraps the model all the same.
    Set to None after a step, the gradients would come back from the next accumulated backward
    as fresh tensors, 4 bytes a parameter beside the buckets."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-c", DDP_PROBE, str(tmp_path / "run")], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    for step in probe["steps"]:
        assert step["none"] == 0 and step["zero"]
        assert len(step["storages"]) < probe["params"]  # many gradients in one bucket's storage
    # DDP rebuilds its buckets once, after the first step; from then on they are the same memory.
    assert probe["steps"][1]["storages"] == probe["steps"][2]["storages"]
    assert probe["deprecated"] == []  # torch 2.13 renamed broadcast_buffers: group.no_buffer_sync


# ------------------------------------------------------------------ micro-batch search
class StandInGPU:
    """The caching allocator's counters as memory_probe.CudaMemory reads them: each trial of
    micro-batch `mb` peaks at `mb` MiB, and up to 4 fit."""

    def __init__(self):
        self.peak, self.resets = 0, 0

    def budget(self) -> int:
        return 8 * 2**30

    def fits(self, mb: int) -> bool:
        self.peak = max(self.peak, mb * 2**20)
        return mb <= 4

    def take_peak(self) -> int:
        peak, self.peak = self.peak, 0
        self.resets += 1
        return peak


def test_the_peak_counts_afresh_after_the_micro_batch_search(tmp_path):
    cfg = tiny_config("training.micro_batch_size=16", "training.grad_accum_steps=1", "eval.every=0")
    lines: list[str] = []
    trainer = Trainer(cfg, create_run_dir(cfg, "test", str(tmp_path / "run")), lambda e: None, lines.append,
                      lambda block: None)
    try:
        trainer.setup()
        gpu = StandInGPU()
        trial_peak = memory_probe.fit_micro_batch(trainer, gpu)
    finally:
        trainer.close()
    # Tried 16 and 8 (too large), then 4: the trials' peak was 16's; training's starts from zero.
    assert (trainer.cfg.training.micro_batch_size, trainer.cfg.training.grad_accum_steps) == (4, 4)
    assert trial_peak == 16 * 2**20 and gpu.peak == 0 and gpu.resets == 1
    assert lines[-1].endswith("tried 16, 8, 4; the trials peaked at 0.02 GiB allocated)")
