import dataclasses

import pytest
import torch

from lmcockpit.core import protocol as P
from lmcockpit.core.config import load_config
from lmcockpit.core.hardware import attention, memory_estimate
from lmcockpit.core.model.gpt import GPT, shape_from_config
from lmcockpit.core.model.muon import Muon
from lmcockpit.core.train import memory_probe
from lmcockpit.core.train.optim import split_params

from .helpers import cpu_bytes_held, drive_engine, tiny_config


def model_of(cfg) -> GPT:
    return GPT(shape_from_config(cfg))  # every option of the config's model (the cpu preset's since #55)


@pytest.mark.parametrize("preset, overrides", [
    ("debug", []), ("cpu", []), ("3060", []),
    ("debug", ["model.head_dim=32", "model.mlp_hidden=200", "model.n_kv_head=1"]),  # head_dim ≠ d_model / n_head
])
def test_parameter_count_formula_equals_the_model(preset, overrides):
    cfg, _ = load_config(preset, overrides)
    counts, model = memory_estimate.param_counts(cfg), model_of(cfg)
    assert counts.total == model.num_params()
    muon, adamw = split_params(model)
    assert counts.muon == sum(p.numel() for _, p in muon)
    assert counts.adamw == sum(p.numel() for _, p in adamw)


# The hand-worked config: V = 512, L = 2, d = 64, 4 heads of 16 (q = 64), 2 kv heads (kv = 32),
# F = 128; micro-batch 8 × 64 tokens = 512 tokens.
HAND = ["model.mlp_hidden=128", "training.micro_batch_size=8", "training.seq_len=64"]
N = 512 * 64 + (2 * (2 * 64 + 2 * 16) + 64) + 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)
# embedding 32768; norms 384; matrices 2 · 36864 = 73728
ADAMW, MUON = 32768 + 384, 73728


def test_hand_worked_parts():
    cfg = tiny_config(*HAND)
    assert N == 106880 and memory_estimate.param_counts(cfg).total == N
    assert (memory_estimate.param_counts(cfg).adamw, memory_estimate.param_counts(cfg).muon) == (ADAMW, MUON)
    # Muon stacks same shapes: its largest working set is gate and up, 4 matrices of 128×64: the
    # fp32 stack and the last update, the two iterates (bf16 on a GPU, fp32 on a CPU) and two
    # 64×64 Gram products each.
    assert memory_estimate.muon_step_bytes(cfg, "cuda") == 4 * 128 * 64 * (4 + 2 * 2) + 4 * 128 * 64 + 4 * 2 * 2 * 64 * 64
    assert memory_estimate.muon_step_bytes(cfg, "cpu") == 4 * 128 * 64 * (4 + 2 * 4) + 4 * 128 * 64 + 4 * 2 * 4 * 64 * 64


# memory_estimate.py's per-token counts against what autograd saves in a real forward on the CPU.
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_eager_activations_are_what_autograd_saves(amp):
    cfg = tiny_config(*HAND)
    measured = memory_probe.saved_bytes_per_token(cfg, "cpu", compiled=False, amp_dtype=amp)
    assert measured == memory_estimate.saved_per_token(cfg, 2 if amp else 4, compiled=False)


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_expanded_kv_activations_are_what_autograd_saves(amp):
    """The path for GPUs where no fused kernel takes grouped-query attention, forced on the CPU:
    the kernel keeps K and V repeated to the query's heads (4 of 16, not 2), 2·a·(64 − 32) bytes
    more per token in each of the 2 layers."""
    cfg = tiny_config(*HAND)
    a = 2 if amp else 4
    measured = memory_probe.saved_bytes_per_token(cfg, "cpu", compiled=False, amp_dtype=amp, expand_kv=True)
    assert measured == memory_estimate.saved_per_token(cfg, a, compiled=False, path=attention.EXPAND)
    assert measured - memory_estimate.saved_per_token(cfg, a, compiled=False) == 2 * 2 * a * (64 - 32)


def test_the_estimate_counts_the_expanded_kv_where_no_kernel_takes_gqa():
    tokens, extra = 512, 2 * 2 * (64 - 32)  # per layer and token at 2 bytes; 2 layers
    base = memory_estimate.estimate(tiny_config(*HAND, "training.compile=true"), "cuda")  # bf16 flash: GQA native
    t4 = memory_estimate.estimate(tiny_config(*HAND, "training.compile=true"), "cuda", compute_capability=(7, 5))  # fp16
    assert t4.activations - base.activations == tokens * 2 * extra
    fp32 = tiny_config(*HAND, "training.compile=true", 'training.precision="fp32"')
    assert (memory_estimate.estimate(fp32, "cuda").activations - memory_estimate.estimate(fp32, "cpu").activations
            == tokens * 2 * 2 * extra)  # a = 4; the CPU's flash kernel takes GQA in fp32
    # The micro-batch search asks the estimate with the GPU's compute capability: 8 fits exactly
    # on an Ampere card, not on a T4, whose attention keeps the repeated K/V.
    cfg = tiny_config(*HAND)
    budget = memory_estimate.estimate(cfg, "cuda", 8).reserved
    assert memory_estimate.largest_micro_batch(cfg, budget, limit=8) == 8
    assert memory_estimate.largest_micro_batch(cfg, budget, limit=8, compute_capability=(7, 5)) < 8


@pytest.mark.slow
def test_compiled_activations_are_what_the_partitioner_saves():
    cfg = tiny_config(*HAND)
    measured = memory_probe.saved_bytes_per_token(cfg, "cpu", compiled=True, amp_dtype=torch.bfloat16)
    assert measured == pytest.approx(memory_estimate.saved_per_token(cfg, 2, compiled=True), rel=0.03)


@pytest.mark.parametrize("preset, overrides", [("debug", HAND), ("cpu", ["model.n_layer=2"])])
def test_muons_step_holds_what_fit_counts(preset, overrides):
    cfg, _ = load_config(preset, overrides)
    model = model_of(cfg)
    muon, _ = split_params(model)
    opt = Muon([p for _, p in muon])
    for _, p in muon:
        p.grad = torch.randn_like(p)
    opt.step()  # creates the momentum buffers, which stay: the optimizer state, counted apart
    assert cpu_bytes_held(opt.step) == memory_estimate.muon_step_bytes(cfg, "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch, accum, recompute", [(1, 1, False), (16, 1, False), (8, 2, False),
                                                         (16, 1, True), (8, 2, True)])
def test_an_eager_step_on_the_cpu_peaks_where_fit_says(tmp_path, micro_batch, accum, recompute):
    """The whole estimate against a real training step: at micro-batch 1 Muon's step is the peak,
    at 16 the blockwise loss's forward, and with accumulation the second micro-batch's loss, all
    gradients alive beside it. With activation checkpointing, a block recomputed in backward."""
    from lmcockpit.core.run.folder import create_run_dir
    from lmcockpit.core.train.trainer import Trainer

    cfg = tiny_config(f"training.micro_batch_size={micro_batch}", f"training.grad_accum_steps={accum}",
                      f"training.activation_checkpointing={str(recompute).lower()}", "eval.every=0", "checkpoint.every=0")
    trainer = Trainer(cfg, create_run_dir(cfg, "test", str(tmp_path / "run")), lambda e: None, lambda line: None,
                      lambda block: None)
    try:
        trainer.setup()
        trainer.train_step()  # the optimizers' state exists from here on
        state = [*trainer.model.parameters(), *trainer.model.buffers(),
                 *(v for opt in trainer.optimizers for st in opt.state.values() for v in st.values()
                   if torch.is_tensor(v))]
        held = sum(t.untyped_storage().nbytes() for t in state) + cpu_bytes_held(trainer.train_step)
        # Checkpointing: the estimate counts a block's new gradients whole; the peak comes partway.
        assert held == pytest.approx(memory_estimate.estimate(trainer.cfg, "cpu").allocated, rel=0.015 if recompute else 0.01)
    finally:
        trainer.close()
        torch.use_deterministic_algorithms(False)  # the trainer set it for this whole process


@pytest.mark.slow
def test_an_eager_fp16_step_holds_the_plain_loss_that_fit_counts():
    """fp16 without compile keeps the whole logits' loss (gpt._fp16_autocast): with a vocabulary
    512 times the width, the loss is most of the step, counted as if blockwise it was half."""
    cfg = tiny_config("tokenizer.vocab_size=32768", "training.micro_batch_size=4", "training.precision=\"fp16\"")
    torch.manual_seed(0)
    model = model_of(cfg)
    x = torch.randint(0, 32768, (4, cfg.training.seq_len + 1))

    def step():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()

    step()
    model.zero_grad(set_to_none=True)
    e = memory_estimate.estimate(cfg, "cpu")
    casts = e.weights - 4 * memory_estimate.param_counts(cfg).total
    assert cpu_bytes_held(step) == pytest.approx(casts + e.activations + e.loss, rel=0.01)


def test_estimate_compiled_bf16_with_accumulation_by_hand():
    cfg = tiny_config(*HAND, "training.compile=true", "training.grad_accum_steps=2")
    e = memory_estimate.estimate(cfg, "cuda")
    a = 2  # bf16
    assert e.weights == 4 * N + 2 * (N - 384)  # fp32 master weights + bf16 copies of the matrices and the head
    assert e.grads == 4 * N  # accumulation: all gradients alive at the second micro-batch's peak
    assert e.optimizer == 8 * ADAMW + 4 * MUON
    # Per layer and token: 2 norms × (fp32 residual 4·64 + cast a·64); q, k, v a·(64 + 64);
    # SDPA's q, k a·(64 + 32); its output a·64; log-sum-exp 4·4; gate, up, product 3·a·128;
    # the norms' reciprocal RMS, 4 bytes for each of 2 + 4 + 2 rows.
    layer = 2 * (4 * 64 + a * 64) + a * 128 + a * 96 + a * 64 + 16 + 3 * a * 128 + 4 * 8
    assert layer == 2160
    # After the blocks: token ids 8, final norm's input and statistic 4·64 + 4, the head's input
    # a·64, the loss's two per-row statistics 8.
    assert e.activations == 512 * (2 * layer + 8 + 4 * 64 + 4 + a * 64 + 8)
    # The logits in bf16, and the head's bf16 gradient beside the lookup's fp32 one.
    assert e.loss == 512 * 512 * a + (4 + a) * 512 * 64
    assert e.muon_step == memory_estimate.muon_step_bytes(cfg, "cuda") == 360448
    peak = e.weights + e.grads + e.optimizer + e.activations + e.loss  # above the optimizer step's
    assert peak == 4767744
    assert e.margin == int(peak * memory_estimate.COMPILE_MARGIN)
    assert e.allocated == peak + e.margin
    assert e.reserved == int(e.allocated * (1 + memory_estimate.ALLOCATOR_MARGIN))
    assert e.total == e.reserved + memory_estimate.CUDA_CONTEXT_BYTES


def test_estimate_eager_fp32_with_checkpointing_by_hand():
    cfg = tiny_config(*HAND, "training.activation_checkpointing=true")
    e = memory_estimate.estimate(cfg, "cpu")
    a = 4  # fp32 on the CPU
    assert e.weights == 4 * N  # no low-precision copies
    assert e.grads == 0  # no accumulation: backward has made none yet at the peak
    # Eager, one block: two norms' inputs and outputs 16·64; the q/k/v and gate/up inputs (one
    # shared fp32 tensor per norm) 2·a·64; QK-norm's input and output 8·(64 + 32); v a·32; SDPA's
    # q, k a·96; its output a·64; log-sum-exp 16; SwiGLU's four tensors 4·a·128; the norms'
    # reciprocal RMS 4·8.
    layer = 16 * 64 + 2 * a * 64 + 8 * 96 + a * 32 + a * 96 + a * 64 + 16 + 4 * a * 128 + 4 * 8
    assert layer == 5168
    # Checkpointing: each block's fp32 input; then the token ids, the final norm's input, output
    # and statistic, and the head input's gradient the loss computed.
    assert e.activations == 512 * (2 * 4 * 64 + 8 + 8 * 64 + 4 + 4 * 64)
    # Blockwise loss, its forward: the head's input, the head weight's fp32 gradient, and all 512
    # rows of 512 logits in one block with logsumexp's temporary.
    assert e.loss == 4 * (512 * 64 + 512 * 64) + 8 * 512 * 512
    # Backward recomputes a block: its activations and two gradients of the MLP's width (128),
    # beside the head's gradient, waiting for the embedding's, and the block's new gradients (no
    # accumulation).
    assert e.recompute == 512 * (layer + 2 * a * 128) + 4 * 32768 + 4 * (MUON + 384 - 64) // 2
    # The larger moment here: the blocks' inputs and the recomputed block, after the loss.
    held = e.weights + e.optimizer
    assert e.allocated == held + 512 * 2 * 4 * 64 + e.recompute == 4699264 and e.margin == 0
    assert held + e.activations + e.loss < e.allocated
    assert e.total == e.reserved == int(4699264 * (1 + memory_estimate.ALLOCATOR_MARGIN))  # no CUDA context on a CPU


def test_the_estimator_uses_the_models_loss_block():
    from lmcockpit.core.model.gpt import LinearCrossEntropy
    assert memory_estimate.LOSS_BLOCK_ELEMENTS == {"cuda": LinearCrossEntropy.GPU_BLOCK_ELEMENTS,
                                       "cpu": LinearCrossEntropy.BLOCK_ELEMENTS}


def test_fsdp_keeps_a_share_of_the_state_per_gpu_and_ddp_all_of_it():
    one = memory_estimate.estimate(tiny_config(*HAND, "training.compile=true", "training.grad_accum_steps=2"), "cuda")
    ddp = memory_estimate.estimate(tiny_config(*HAND, "training.compile=true", "training.grad_accum_steps=2",
                                   "distributed.nproc=4"), "cuda")
    fsdp = memory_estimate.estimate(tiny_config(*HAND, "training.compile=true", "training.grad_accum_steps=2",
                                    "distributed.nproc=4", "distributed.strategy=\"fsdp\""), "cuda")
    # A whole model per GPU; gradients are views into DDP's buckets, which stay between steps.
    assert ddp.grads == one.grads == 4 * N and ddp.inference == one.inference + 4 * N
    assert dataclasses.replace(ddp, inference=one.inference) == one
    no_accumulation = memory_estimate.estimate(tiny_config(*HAND, "training.compile=true", "distributed.nproc=4"), "cuda")
    assert no_accumulation.grads == 4 * N  # the buckets exist at the peak of a step without accumulation too
    # A quarter of the fp32 weights, gradients and moments, plus what is gathered at a time: the
    # embedding (32768) and two blocks' matrices and norms ((MUON + 384 - 64) / 2 layers each).
    gathered = 4 * (32768 + 2 * (MUON + 384 - 64) // 2)
    assert fsdp.weights == 4 * N // 4 + gathered + 2 * (N - 384)  # autocast's bf16 copies stay whole
    assert fsdp.grads == 4 * N // 4 + gathered
    assert fsdp.optimizer == (8 * ADAMW + 4 * MUON) // 4
    assert fsdp.activations == one.activations and fsdp.allocated < one.allocated


def test_checkpointing_and_cuda_graphs_move_the_estimate_the_right_way():
    base = memory_estimate.estimate(tiny_config(*HAND, "training.compile=true"), "cuda")
    ckpt = memory_estimate.estimate(tiny_config(*HAND, "training.compile=true", "training.activation_checkpointing=true"), "cuda")
    graphs = memory_estimate.estimate(tiny_config(*HAND, "training.compile=true", "training.compile_mode=\"reduce-overhead\""),
                          "cuda")
    assert ckpt.activations < base.activations
    # CUDA graphs keep every gradient between steps (memory_estimate.keeps_grads), and evaluation has its own
    # pool beside the graphs'.
    assert base.grads == 0 and graphs.grads == 4 * N
    assert graphs.allocated > base.allocated and graphs.reserved - base.reserved > graphs.allocated - base.allocated


def test_verdict_thresholds():
    card = 1000
    assert memory_estimate.verdict(900, card) == "fits"
    assert memory_estimate.verdict(901, card) == "tight"
    assert memory_estimate.verdict(1000, card) == "tight"
    assert memory_estimate.verdict(1001, card) == "does not fit"


def test_largest_micro_batch_is_the_edge_of_the_budget():
    cfg, _ = load_config("4090")
    budget = 20 * memory_estimate.GiB
    mb = memory_estimate.largest_micro_batch(cfg, budget, limit=256)
    assert 1 <= mb < 256
    assert memory_estimate.estimate(cfg, "cuda", mb).reserved <= budget < memory_estimate.estimate(cfg, "cuda", mb + 1).reserved
    assert memory_estimate.largest_micro_batch(cfg, 1) == 0


@pytest.mark.parametrize("effective, start, limit, tried, chosen", [
    (24, 24, 5, [24, 12, 6, 3], 3),  # halving through divisors of 24
    (24, 10, 5, [8, 4], 4),  # 10 does not divide 24: its largest divisor below 10 first
    (24, 100, 100, [24], 24),  # never above the effective batch: accumulation 1
    (12, 12, 0, [12, 6, 3, 1], None),  # not even 1
    (7, 6, 7, [1], 1),  # a prime effective batch has only 1 below it
])
def test_choose_micro_batch_halves_and_keeps_the_effective_batch(effective, start, limit, tried, chosen):
    seen = []

    def fits(mb: int) -> bool:  # a card where micro-batches up to `limit` fit
        seen.append(mb)
        return mb <= limit

    assert memory_estimate.choose_micro_batch(effective, start, fits) == chosen
    assert seen == tried
    assert all(effective % mb == 0 for mb in seen)


def test_out_of_memory_message_says_where_how_much_and_what_to_change():
    cfg, _ = load_config("4090")
    error = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.64 GiB of which "
             "1.10 GiB is free.\nIncluding non-PyTorch memory, this process has 22.5 GiB memory in use.")
    msg = memory_estimate.out_of_memory_message(cfg, 12, error, "NVIDIA GeForce RTX 4090", int(23.64 * memory_estimate.GiB),
                                    int(21.3 * memory_estimate.GiB), 10)
    assert msg.startswith("out of GPU memory in training step 12 (tried to allocate 2.00 GiB with 1.10 GiB free of "
                          "23.64 GiB): micro-batch 8 × 2048 tokens, config sized for RTX 4090 (24 GB), on NVIDIA "
                          "GeForce RTX 4090 with 23.64 GiB; peak allocated 21.30 GiB (estimated ")
    # What holds the memory, as the estimator counts it at this micro-batch.
    est = memory_estimate.estimate(cfg, "cuda")
    assert (f"holding (as estimated at micro-batch 8) parameters {est.weights / memory_estimate.GiB:.2f} GiB, "
            f"gradients {est.grads / 2**20:.2f} MiB, optimizer state {est.optimizer / memory_estimate.GiB:.2f} GiB, "
            f"activations {est.activations / memory_estimate.GiB:.2f} GiB, the loss {est.loss / memory_estimate.GiB:.2f} "
            "GiB. Change: ") in msg
    assert ("Change: --set training.micro_batch_size=4 --set training.grad_accum_steps=16 (the same tokens per "
            "step), or training.auto_micro_batch=true, or training.activation_checkpointing=true") in msg
    assert msg.endswith("; the checkpoint of step 10 is kept.")
    one = memory_estimate.out_of_memory_message(tiny_config("training.micro_batch_size=1"), 1, "a micro-batch of 1 did not fit",
                                    "GPU", memory_estimate.GiB, 0, None)
    assert "(a micro-batch of 1 did not fit)" in one and "a shorter training.seq_len" in one
    assert one.endswith("no checkpoint had been written yet.")

    # Halved to a divisor, so the tokens per step stay; auto_micro_batch only where it can search
    # (one process, not searched already); checkpointing only where it is off.
    def change(*overrides):
        cfg = tiny_config(*overrides)
        return memory_estimate.out_of_memory_message(cfg, 3, "x", "GPU", memory_estimate.GiB, 0, 2).split("Change: ")[1]

    assert change("training.micro_batch_size=6", "training.grad_accum_steps=2") == (
        "--set training.micro_batch_size=3 --set training.grad_accum_steps=4 (the same tokens per step), or "
        "training.auto_micro_batch=true, or training.activation_checkpointing=true; the checkpoint of step 2 is kept.")
    assert change("training.micro_batch_size=3", "distributed.nproc=2", "training.activation_checkpointing=true") == (
        "--set training.micro_batch_size=1 --set training.grad_accum_steps=3 (the same tokens per step); "
        "the checkpoint of step 2 is kept.")
    assert change("training.micro_batch_size=1", "training.activation_checkpointing=true") == (
        "in a new run: a shorter training.seq_len or a smaller model; the checkpoint of step 2 is kept.")


def test_an_out_of_memory_error_is_found_behind_the_compilers_wrapping():
    from lmcockpit.core.train.memory_probe import oom_in

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
    try:
        try:
            raise oom
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("backend compiler failed") from inner
    except RuntimeError as wrapped:
        assert oom_in(wrapped) is oom
    assert oom_in(ValueError("not memory")) is None


@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_gradients():
    cfg = tiny_config()
    torch.manual_seed(0)
    model = model_of(cfg)
    x = torch.randint(0, cfg.tokenizer.vocab_size, (2, 32))
    grads = []
    for on in (False, True):
        model.activation_checkpointing = on
        model.zero_grad()
        model(x[:, :-1], x[:, 1:]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        assert torch.allclose(plain, recomputed, atol=1e-6)


@pytest.mark.slow
def test_auto_micro_batch_on_cpu_keeps_the_tokens_per_step(tmp_path):
    cfg = tiny_config("training.auto_micro_batch=true", "training.micro_batch_size=2", "training.grad_accum_steps=4",
                      "training.max_steps=4", "eval.every=0")
    engine, events = drive_engine(cfg, tmp_path / "run")
    assert engine.final_state == P.FINISHED, engine.failure
    started = next(e for e in events if isinstance(e, P.RunStarted))
    # The estimate says 8 sequences fit in this machine's RAM: one micro-batch of 8, no accumulation.
    assert (started.config["training"]["micro_batch_size"], started.config["training"]["grad_accum_steps"]) == (8, 1)
    assert started.tokens_per_step == cfg.tokens_per_step
    assert any(isinstance(e, P.LogLine) and e.text.startswith("auto micro-batch: 8 × 1") for e in events)

    # The checkpoint records the search's answer as the run's micro-batch: a resume on two
    # processes (where no search can run) takes it, split between them.
    from lmcockpit.core.config import ConfigError
    from lmcockpit.core.run.folder import latest_checkpoint
    from lmcockpit.core.run.resume import plan_resume

    ckpt = latest_checkpoint(tmp_path / "run")
    saved, _ = load_config(str(ckpt / "config.toml"))
    assert (saved.training.auto_micro_batch, saved.training.micro_batch_size, saved.training.grad_accum_steps) == \
        (False, 8, 1)
    plan = plan_resume(str(ckpt), ["distributed.nproc=2", "training.micro_batch_size=4", "training.max_steps=6"],
                       str(tmp_path / "two"))
    assert (plan.cfg.world, plan.cfg.training.micro_batch_size, plan.cfg.training.grad_accum_steps) == (2, 4, 1)
    with pytest.raises(ConfigError, match="2 process\\(es\\) take 4 each, which training.micro_batch_size = 8 does "
                                          "not divide: micro_batch_size × grad_accum_steps × processes must stay 8"):
        plan_resume(str(ckpt), ["distributed.nproc=2", "training.max_steps=6"], str(tmp_path / "refused"))
