"""Which kernel attention runs on (core/hardware/attention.py): the decision by case, as torch 2.13's
sdp_utils checks it, and the run header's line. The kernels' numerics are in test_model.py, the
memory they keep in test_fit.py."""

import pytest
import torch

from lmcockpit.core.hardware import attention as A
from lmcockpit.core.hardware.device import attention_header

from .helpers import tiny_config


@pytest.mark.parametrize("device, precision, cc, head_dim, path", [
    # Flash (or cuDNN) shares the K/V heads itself: 16-bit, Ampere to sm121.
    ("cuda", "bf16", (8, 0), 64, A.NATIVE),
    ("cuda", "fp16", (8, 6), 128, A.NATIVE),
    ("cuda", "bf16", (9, 0), 256, A.NATIVE),
    ("cuda", "bf16", (12, 0), 128, A.NATIVE),
    # fp32 is not a flash dtype on any GPU: memory-efficient, which has no GQA in torch 2.13.
    ("cuda", "fp32", (8, 0), 64, A.EXPAND),
    ("cuda", "fp32", (9, 0), 128, A.EXPAND),
    # fp16 before Ampere (V100, T4 / RTX 20xx): no flash there.
    ("cuda", "fp16", (7, 0), 64, A.EXPAND),
    ("cuda", "fp16", (7, 5), 128, A.EXPAND),
    # Head sizes flash refuses: above 256, and (192, 224] for training on the consumer cards.
    ("cuda", "bf16", (9, 0), 320, A.EXPAND),
    ("cuda", "bf16", (8, 6), 200, A.EXPAND),
    ("cuda", "bf16", (8, 0), 200, A.NATIVE),
    # Memory-efficient's GEMM alignment: 8 elements in 16-bit, 4 in fp32 from Ampere, 1 before.
    ("cuda", "fp16", (7, 5), 36, A.MATH),
    ("cuda", "fp32", (8, 0), 34, A.MATH),
    ("cuda", "fp32", (8, 0), 36, A.EXPAND),
    ("cuda", "fp32", (7, 5), 34, A.EXPAND),
    # Newer than torch 2.13 knows: no fused kernel accepts the architecture.
    ("cuda", "bf16", (13, 0), 64, A.MATH),
    # The CPU's flash kernel takes GQA in every float dtype.
    ("cpu", "fp32", None, 64, A.NATIVE),
    ("cpu", "bf16", None, 64, A.NATIVE),
    ("cpu", "fp16", None, 36, A.NATIVE),
])
def test_the_attention_path_by_case(device, precision, cc, head_dim, path):
    assert A.attention_path(device, precision, cc, head_dim) == path


def test_a_run_config_resolves_auto_precision_and_shares_nothing_without_gqa():
    cfg = tiny_config()  # 4 heads, 2 K/V heads, head_dim 16, precision "auto"
    assert A.path_for(cfg, "cuda") == A.NATIVE  # an unknown GPU is taken for Ampere: bf16
    assert A.path_for(cfg, "cuda", (7, 5)) == A.EXPAND  # auto is fp16 there
    assert A.path_for(cfg, "cuda", (7, 5), precision="fp32") == A.EXPAND
    assert A.path_for(tiny_config('training.precision="fp32"'), "cuda") == A.EXPAND
    assert A.path_for(cfg, "cpu") == A.NATIVE
    assert A.path_for(tiny_config("model.n_kv_head=4"), "cuda", (7, 5)) == A.NATIVE  # nothing to repeat


def test_the_extra_bytes_are_the_repeated_kv_and_for_math_its_probabilities():
    cfg = tiny_config("training.seq_len=64")  # q = 4·16 = 64, kv = 2·16 = 32
    assert A.extra_bytes_per_token(cfg, 2, A.NATIVE) == 0
    assert A.extra_bytes_per_token(cfg, 2, A.EXPAND) == 2 * 2 * (64 - 32)
    assert A.extra_bytes_per_token(cfg, 4, A.MATH) == 2 * 4 * (64 - 32) + 4 * 4 * 64


def test_the_header_says_the_kernel_and_what_expanding_costs():
    sized = ["model.n_layer=4", "training.micro_batch_size=8", "model.max_seq_len=512", "training.seq_len=512"]
    cfg = tiny_config(*sized)
    assert A.header(cfg, A.NATIVE, "flash", "bf16") == "attention: flash, GQA native"
    # 2 × 4 bytes × 32 repeated elements per token and layer, 8 × 512 tokens, 4 layers: 4 MiB.
    assert A.header(cfg, A.EXPAND, "memory-efficient", "fp32") == (
        "attention: memory-efficient, K/V expanded from 2 to 4 heads (+4.0 MiB of activations)")
    ckpt = tiny_config(*sized, "training.activation_checkpointing=true")
    assert "(+1.0 MiB of activations)" in A.header(ckpt, A.EXPAND, "memory-efficient", "fp32")
    surprise = A.header(cfg, A.NATIVE, "math", "bf16")
    assert surprise.startswith("attention: math, GQA native; warning: the math kernel is slow")
    assert surprise.endswith("attention.py expected a fused kernel at bf16")
    odd = A.header(tiny_config("model.head_dim=36"), A.MATH, "math", "fp16")
    assert odd.endswith("a head_dim that is a multiple of 8 (not 36) lets the memory-efficient kernel take it")


def test_the_header_on_the_cpu_is_torchs_own_choice():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = tiny_config()
    for precision in ("fp32", "bf16"):
        assert attention_header(cfg, torch.device("cpu"), precision) == "attention: flash (CPU), GQA native"
    with sdpa_kernel(SDPBackend.MATH):  # a fall to the math kernel is said
        assert attention_header(cfg, torch.device("cpu"), "fp32").startswith(
            "attention: math (CPU), GQA native; warning:")
