import pytest
import torch

from lmcockpit.core.config import OptimizerConfig
from lmcockpit.core.model import muon as muon_mod
from lmcockpit.core.model.gpt import GPT, GPTShape
from lmcockpit.core.model.muon import Muon, iteration_dtype, newton_schulz
from lmcockpit.core.train.optim import build_optimizers, lr_multiplier, split_params


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTShape(vocab_size=128, n_layer=2, d_model=32, n_head=4, n_kv_head=2, head_dim=8,
                        mlp_hidden=64, max_seq_len=16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # a CPU run's fp32, or its measured bf16
def test_singular_values_land_in_the_quintic_band(dtype):
    torch.manual_seed(0)
    for shape in [(64, 64), (32, 96), (96, 32)]:
        # singular values spread over two orders of magnitude, none tiny
        u, _ = torch.linalg.qr(torch.randn(shape[0], shape[0]))
        v, _ = torch.linalg.qr(torch.randn(shape[1], shape[1]))
        k = min(shape)
        s = torch.logspace(-1, 1, k)
        G = u[:, :k] @ torch.diag(s) @ v[:, :k].T
        ortho = newton_schulz(G, dtype=dtype)
        assert ortho.dtype == dtype
        sv = torch.linalg.svdvals(ortho.float())
        assert sv.min() > 0.65 and sv.max() < 1.25, (shape, sv.min(), sv.max())


def test_batched_call_equals_one_call_per_matrix():
    torch.manual_seed(1)
    stack = torch.randn(5, 24, 40)
    batched = newton_schulz(stack)
    single = torch.stack([newton_schulz(m) for m in stack])
    assert torch.equal(batched, single)


def test_step_orthogonalises_once_per_shape(monkeypatch):
    model = tiny_model()
    muon_params = [p for _, p in split_params(model)[0]]
    shapes = {p.shape for p in muon_params}
    calls = []
    real = muon_mod.newton_schulz

    def counting(G, steps=5, dtype=None):
        calls.append(tuple(G.shape))
        return real(G, steps, dtype)

    monkeypatch.setattr(muon_mod, "newton_schulz", counting)
    opt = Muon(muon_params, lr=0.02)
    for p in muon_params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert len(calls) == len(shapes)
    # each call stacks every matrix of its shape: 2 layers × (k, v) share one shape, and so on
    assert sum(c[0] for c in calls) == len(muon_params)


def test_muon_update_is_nesterov_momentum_orthogonalised_and_scaled():
    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.randn(48, 16))
    g = torch.randn(48, 16)
    before = p.detach().clone()
    opt = Muon([p], lr=0.1, momentum=0.9)
    p.grad = g.clone()
    opt.step()
    buf = 0.1 * g  # lerp of a zero buffer toward g by (1 - 0.9)
    expected = newton_schulz(g.lerp(buf, 0.9)[None])[0].float() * (48 / 16) ** 0.5
    assert torch.allclose(before - p.detach(), 0.1 * expected, atol=1e-6)


@pytest.mark.parametrize("device, capability, hip, dtype", [
    ("cpu", None, False, torch.float32),
    ("cuda", (9, 0), False, torch.bfloat16), ("cuda", (8, 0), False, torch.bfloat16),  # H100, A100
    ("cuda", (8, 6), False, torch.bfloat16),  # RTX 30xx
    ("cuda", (7, 5), False, torch.float16), ("cuda", (7, 0), False, torch.float16),  # T4 / RTX 20xx, V100
    ("cuda", (6, 1), False, torch.float32),  # Pascal: no tensor cores
    ("cuda", (9, 4), True, torch.bfloat16),  # ROCm (torch reports gfx942 as 9.4)
])
def test_iteration_dtype_follows_the_device(device, capability, hip, dtype):
    assert iteration_dtype(device, capability, hip) == dtype


def relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm())


def test_fp16_iteration_is_closer_to_fp32_than_bf16():
    """What a Volta or Turing GPU iterates in, on the CPU: within 0.3% of the fp32 result (bf16,
    what newer GPUs use, is within 2%), for gradients far below or above fp16's range too: the
    stack is normalised in fp32 before it is rounded to fp16."""
    torch.manual_seed(3)
    for shape in [(4, 64, 64), (3, 48, 128), (3, 128, 48)]:
        G = torch.randn(shape)
        assert relative(newton_schulz(G, dtype=torch.bfloat16), newton_schulz(G, dtype=torch.float32)) < 0.02
        for scale in (1.0, 1e-6, 1e6):  # 1e-6: a fortieth of the entries would round to 0 in fp16; 1e6: to inf
            ref = newton_schulz(G * scale, dtype=torch.float32)
            assert relative(newton_schulz(G * scale, dtype=torch.float16), ref) < 3e-3, (shape, scale)


def test_muon_step_iterating_in_fp16_matches_fp32(monkeypatch):
    model = tiny_model()
    params = [p for _, p in split_params(model)[0]]
    grads = [torch.randn_like(p) for p in params]
    updates = {}
    for dtype in (torch.float32, torch.float16):
        monkeypatch.setattr(muon_mod, "device_iteration_dtype", lambda device, dtype=dtype: dtype)
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for c, g in zip(copies, grads):
            c.grad = g.clone()
        Muon(copies, lr=0.02).step()
        updates[dtype] = [p.detach() - c.detach() for p, c in zip(params, copies)]
        assert all(c.dtype == torch.float32 for c in copies)
    for ref, u in zip(updates[torch.float32], updates[torch.float16]):
        assert relative(u, ref) < 3e-3


def test_a_cpu_run_in_bf16_iterates_in_bf16_and_updates_as_fp32_does():
    """On a CPU Newton–Schulz follows the run's precision: bf16 where the probe chose it (half the
    time of fp32 on an AVX512-BF16 EPYC), with updates within 2% of fp32's."""
    model = tiny_model()
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    updates = {}
    for precision in ("fp32", "bf16"):
        copy = tiny_model()
        _, muon = build_optimizers(copy, OptimizerConfig(), torch.device("cpu"), precision)
        assert muon.ns_dtype == (torch.bfloat16 if precision == "bf16" else None)
        for n, p in copy.named_parameters():
            p.grad = grads[n].clone()
        before = {n: p.detach().clone() for n, p in copy.named_parameters()}
        muon.step()
        updates[precision] = {n: before[n] - p.detach() for n, p in copy.named_parameters() if p.ndim == 2
                              and n.startswith("layers.")}
        assert all(p.dtype == torch.float32 for p in copy.parameters())
    for n, ref in updates["fp32"].items():
        assert 0 < relative(updates["bf16"][n], ref) < 0.02, n


def test_parameter_grouping():
    model = tiny_model()
    muon, adamw = split_params(model)
    muon_names = {n for n, _ in muon}
    adamw_names = {n for n, _ in adamw}
    assert muon_names == {n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("layers.")}
    assert "embed_tokens.weight" in adamw_names  # the tied head too
    assert all(p.ndim == 1 for n, p in adamw if n != "embed_tokens.weight")
    assert len(muon) + len(adamw) == len(list(model.parameters()))
    opts = build_optimizers(model, OptimizerConfig(), torch.device("cpu"))
    assert [type(o).__name__ for o in opts] == ["AdamW", "Muon"]


def test_schedules():
    cos = OptimizerConfig(warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert lr_multiplier(0, 101, cos) == 0.1 and lr_multiplier(9, 101, cos) == 1.0
    assert abs(lr_multiplier(55, 101, cos) - 0.55) < 1e-9  # half way down: floor + (1 - floor)/2
    assert abs(lr_multiplier(100, 101, cos) - 0.1) < 1e-9
    wsd = OptimizerConfig(warmup_steps=10, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert lr_multiplier(50, 101, wsd) == 1.0 and lr_multiplier(79, 101, wsd) == 1.0
    assert abs(lr_multiplier(90, 101, wsd) - 0.5) < 1e-9 and lr_multiplier(100, 101, wsd) == 0.0
