import torch

from lmcockpit.core.config import OptimizerConfig
from lmcockpit.core.model.gpt import GPT, GPTShape, apply_rotary, rotary_tables
from lmcockpit.core.train.optim import build_optimizers

SHAPE = GPTShape(vocab_size=97, n_layer=2, d_model=32, n_head=4, n_kv_head=2, head_dim=8, mlp_hidden=64,
                 max_seq_len=32)


def test_parameter_count_by_hand():
    model = GPT(SHAPE)
    d, hd = 32, 8
    per_layer = (d * 4 * hd + 2 * d * 2 * hd + 4 * hd * d  # q, k, v, o
                 + 3 * d * 64  # gate, up, down
                 + 2 * d + 2 * hd)  # two block norms, q_norm, k_norm
    assert model.num_params() == 97 * d + 2 * per_layer + d  # tied embedding once, final norm
    assert "lm_head.weight" not in model.state_dict()


def test_causal_future_tokens_do_not_change_the_past():
    torch.manual_seed(0)
    model = GPT(SHAPE)
    x = torch.randint(0, 97, (2, 16))
    y = x.clone()
    y[:, 10:] = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_rotary_runs_in_float32_and_returns_the_input_dtype():
    cos, sin = rotary_tables(8, 16, 10000.0)
    assert cos.dtype == torch.float32
    x = torch.randn(1, 2, 16, 8).bfloat16()
    out = apply_rotary(x, cos, sin)
    assert out.dtype == torch.bfloat16
    ref = apply_rotary(x.float(), cos, sin)
    assert torch.allclose(out.float(), ref, atol=1e-2)
    # a rotation keeps the norm of each (i, i + D/2) pair
    assert torch.allclose(ref.norm(dim=-1), x.float().norm(dim=-1), atol=1e-4)


def test_loss_falls_on_a_tiny_model():
    torch.manual_seed(0)
    model = GPT(SHAPE)
    opts = build_optimizers(model, OptimizerConfig(lr=0.01, muon_lr=0.03), torch.device("cpu"))
    x = torch.randint(0, 97, (4, 32))
    first = None
    for _ in range(40):
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        first = first if first is not None else loss.item()
    assert first > 4.0  # about ln(97) at initialisation
    assert loss.item() < 0.5 * first


def test_token_losses_agree_with_the_mean_loss():
    torch.manual_seed(0)
    model = GPT(SHAPE)
    x = torch.randint(0, 97, (2, 17))
    with torch.no_grad():
        assert torch.allclose(model.token_losses(x[:, :-1], x[:, 1:]).mean(), model(x[:, :-1], x[:, 1:]))


def test_blockwise_loss_gives_the_plain_loss_and_gradients(monkeypatch):
    """Eager training's LinearCrossEntropy against F.cross_entropy of the whole logits, in float32,
    with blocks smaller than the batch (so several blocks and a short last one are exercised)."""
    import torch.nn.functional as F

    from lmcockpit.core.model.gpt import LinearCrossEntropy

    monkeypatch.setattr(LinearCrossEntropy, "BLOCK_ELEMENTS", 97 * 5)  # 5 rows a block, 34 rows in all
    torch.manual_seed(0)
    model = GPT(SHAPE)
    x = torch.randint(0, 97, (2, 18))
    blockwise = model(x[:, :-1], x[:, 1:])
    blockwise.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plain = F.cross_entropy(model(x[:, :-1]).view(-1, 97), x[:, 1:].reshape(-1))
    plain.backward()
    assert torch.allclose(blockwise, plain, rtol=1e-6)
    for n, p in model.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-7), n


def test_checkpoint_refuses_to_start_without_the_disk_space(tmp_path, monkeypatch):
    """checkpoint.save itself measures the disk before it writes: short of room it refuses with
    the reason, and the checkpoint before stays the latest, with no half-written folder. (A full
    disk cannot be made here: the filesystem's answer is what is made up.)"""
    import shutil

    import pytest

    from lmcockpit.core.train import checkpoint
    from lmcockpit.core.train.checkpoint import CheckpointError, check_free_space

    check_free_space(tmp_path, 1 << 20)  # a megabyte is there
    with pytest.raises(CheckpointError, match=r"not enough free disk for a checkpoint in .*GiB free"):
        check_free_space(tmp_path, 1 << 60)  # an exabyte is not

    model = GPT(SHAPE)
    opts = build_optimizers(model, OptimizerConfig(), torch.device("cpu"))
    root = tmp_path / "checkpoints"
    checkpoint.save(root, 1, model, opts, {}, "", keep=2)
    real = shutil.disk_usage
    need = checkpoint.estimate_bytes(model, opts)  # the weights twice: the save asks for more than this
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: real(path)._replace(free=need))
    with pytest.raises(CheckpointError, match=rf"not enough free disk for a checkpoint in {root}: "):
        checkpoint.save(root, 2, model, opts, {}, "", keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert (root / "latest").read_text() == "step_000001\n"


def test_fp16_autocast_keeps_the_plain_loss_so_the_loss_scale_reaches_the_logits_gradient():
    """Under fp16 the blockwise loss would round (softmax − one-hot) / tokens to fp16 before the
    GradScaler's factor arrives: most of the vocabulary's gradient underflows to zero. So fp16
    takes F.cross_entropy's path, whose gradients (scaled as a GradScaler scales them) match it."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = GPT(SHAPE)
    x = torch.randint(0, 97, (2, 18))
    scale = 65536.0
    with torch.autocast("cpu", dtype=torch.float16):
        (model(x[:, :-1], x[:, 1:]) * scale).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(x[:, :-1])
    (F.cross_entropy(logits.float().view(-1, 97), x[:, 1:].reshape(-1)) * scale).backward()
    for n, p in model.named_parameters():
        assert torch.equal(grads[n], p.grad), n
