import pytest
import torch

from lmcockpit.core.config import OptimizerConfig
from lmcockpit.core.model import muon as muon_mod
from lmcockpit.core.model.gpt import GPT, GPTShape
from lmcockpit.core.model.muon import Muon, iteration_dtype, newton_schulz
from lmcockpit.core.run.folder import read_metrics
from lmcockpit.core.train.optim import build_optimizers, lr_multiplier, split_params

from .helpers import cli, drive_engine, losses, tiny_config


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

    def counting(G, *args, **kwargs):
        calls.append(tuple(G.shape))
        return real(G, *args, **kwargs)

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


def spread_matrix(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """A random matrix whose singular values spread over three orders of magnitude."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(shape[0], shape[0], generator=gen))
    v, _ = torch.linalg.qr(torch.randn(shape[1], shape[1], generator=gen))
    k = min(shape)
    return u[:, :k] @ torch.diag(torch.logspace(-3, 0, k)) @ v[:, :k].T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_polar_express_lands_closer_to_orthogonal_than_the_quintic_in_as_many_steps(dtype):
    for shape in [(64, 64), (32, 96), (96, 32)]:
        G = spread_matrix(shape, seed=4)
        for steps in (5, 7):
            quintic = torch.linalg.svdvals(newton_schulz(G, steps, dtype).float())
            polar = torch.linalg.svdvals(newton_schulz(G, steps, dtype, kind="polar_express").float())
            # the quintic leaves the smallest far from 1 and overshoots the largest; Polar Express does neither
            assert (polar - 1).abs().max() < (quintic - 1).abs().max(), (shape, steps)
            assert (polar - 1).abs().mean() < 0.6 * (quintic - 1).abs().mean(), (shape, steps)  # about half


def test_polar_express_applies_its_five_polynomials_in_order():
    """The reference: each iteration X ← aX + b(XXᵀ)X + c(XXᵀ)²X with the paper's i-th coefficients,
    in float64 on the input over 1.02 times its norm."""
    G = spread_matrix((24, 40), seed=5).double()
    X = G / (G.norm() * 1.02)
    for a, b, c in muon_mod.POLAR_EXPRESS_COEFFS:
        A = X @ X.T
        X = a * X + b * A @ X + c * A @ A @ X
    assert torch.allclose(newton_schulz(G.float(), 5, torch.float32, kind="polar_express").double(), X, atol=1e-4)


def test_unknown_coefficients_are_refused_when_the_optimizer_is_built():
    with pytest.raises(ValueError, match="polar_express"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], coefficients="cubic")


def normuon_reference(updates: list[torch.Tensor], beta2: float) -> list[torch.Tensor]:
    """NorMuon written out, row by row (a tall or square matrix's neurons are its rows)."""
    v = torch.zeros(updates[0].shape[0])
    out = []
    for u in updates:
        v = beta2 * v + (1 - beta2) * (u ** 2).mean(dim=1)
        scaled = u / v.sqrt()[:, None]
        out.append(scaled * u.norm() / scaled.norm())
    return out


def test_normuon_divides_each_neuron_by_its_running_rms_and_keeps_the_norm():
    gen = torch.Generator().manual_seed(6)
    updates = [torch.randn(16, 8, generator=gen) * torch.linspace(0.1, 3, 16)[:, None] for _ in range(3)]
    second = torch.zeros(16, 1)
    for u, ref in zip(updates, normuon_reference(updates, 0.9)):
        got = muon_mod.normuon_scaled(u, second, 0.9)
        assert torch.allclose(got, ref, atol=1e-5)
        assert torch.allclose(got.norm(), u.norm())
    # a wide matrix's neurons are its columns: the transpose gives the transposed result
    wide = [u.T.contiguous() for u in updates]
    second_wide = torch.zeros(1, 16)
    for u, ref in zip(wide, normuon_reference(updates, 0.9)):
        assert torch.allclose(muon_mod.normuon_scaled(u, second_wide, 0.9), ref.T, atol=1e-5)


def test_normuon_step_and_its_state_resume_exactly():
    """Three steps in one go equal two steps, a state_dict round trip into a new optimizer, and a
    third: the second moment is optimizer state, saved and restored with the momentum."""
    model = tiny_model()
    params = [p for _, p in split_params(model)[0]]
    gen = torch.Generator().manual_seed(7)
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(3)]

    def steps(opt, ps, gs):
        for g_step in gs:
            for p, g in zip(ps, g_step):
                p.grad = g.clone()
            opt.step()

    straight = [torch.nn.Parameter(p.detach().clone()) for p in params]
    steps(Muon(straight, coefficients="polar_express", normuon=True), straight, grads)
    first = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = Muon(first, coefficients="polar_express", normuon=True)
    steps(opt, first, grads[:2])
    assert all("second_moment" in opt.state[p] for p in first)
    saved = opt.state_dict()
    resumed = Muon(first, coefficients="polar_express", normuon=True)
    resumed.load_state_dict(saved)
    steps(resumed, first, grads[2:])
    for a, b in zip(straight, first):
        assert torch.equal(a, b)
    plain = [torch.nn.Parameter(p.detach().clone()) for p in params]
    steps(Muon(plain, coefficients="polar_express"), plain, grads)
    assert any(not torch.equal(a, b) for a, b in zip(straight, plain))  # NorMuon changed the steps


def test_the_variants_reach_the_optimizer_from_the_config_and_the_defaults_change_nothing():
    cfg = OptimizerConfig(muon_coefficients="polar_express", normuon=True, normuon_beta2=0.9)
    _, muon = build_optimizers(tiny_model(), cfg, torch.device("cpu"))
    group = muon.param_groups[0]
    assert (group["coefficients"], group["normuon"], group["normuon_beta2"]) == ("polar_express", True, 0.9)
    _, default = build_optimizers(tiny_model(), OptimizerConfig(), torch.device("cpu"))
    assert (default.param_groups[0]["coefficients"], default.param_groups[0]["normuon"]) == ("quintic", False)


def test_polar_express_in_fp16_stays_within_fp16_s_rounding_of_fp32():
    """Its first polynomial's coefficients are the largest (22.5): still far inside fp16's range on a
    Volta or Turing GPU, for gradients far outside it too (normalised in fp32 before rounding)."""
    torch.manual_seed(8)
    for shape in [(4, 64, 64), (3, 48, 128), (3, 128, 48)]:
        G = torch.randn(shape)
        for scale in (1.0, 1e-6, 1e6):
            ref = newton_schulz(G * scale, dtype=torch.float32, kind="polar_express")
            got = newton_schulz(G * scale, dtype=torch.float16, kind="polar_express")
            assert torch.isfinite(got).all() and relative(got, ref) < 3e-3, (shape, scale)


@pytest.mark.slow
def test_normuon_under_fsdp_trains_as_one_process_and_its_checkpoint_resumes_on_one_exactly(tmp_path):
    """Two FSDP ranks (gloo) with Polar Express and NorMuon: each rank orthogonalises and normalises
    the whole update, its second moment a replicated DTensor in the DCP checkpoint; the losses are
    one process's, and the sharded checkpoint resumes on one process to the same losses."""
    variants = ["optimizer.muon_coefficients=\"polar_express\"", "optimizer.normuon=true", "training.max_steps=4",
                "checkpoint.every=2", "eval.every=0", "training.log_every=1"]
    _, one = drive_engine(tiny_config(*variants, "training.grad_accum_steps=2"), tmp_path / "one")
    _, fsdp = drive_engine(tiny_config(*variants, "distributed.nproc=2", "distributed.strategy=\"fsdp\""),
                           tmp_path / "fsdp")
    assert len(losses(one)) == 4 and losses(fsdp) == losses(one)
    proc = cli("--run", "--resume", str(tmp_path / "fsdp" / "checkpoints" / "step_000002"), "--set",
               "distributed.nproc=1", "--out", str(tmp_path / "resumed"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["loss"] for r in read_metrics(tmp_path / "resumed", "step")] == losses(one)[2:]
