import pytest
import torch

from lmcockpit.core.config import OptimizerConfig
from lmcockpit.core.model.gpt import GPT, GPTShape, apply_rotary, rotary_tables
from lmcockpit.core.train.optim import build_optimizers

from .helpers_model import assert_blockwise_loss_is_plain

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


@pytest.mark.slow
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

    from lmcockpit.core.model.gpt import LinearCrossEntropy

    monkeypatch.setattr(LinearCrossEntropy, "BLOCK_ELEMENTS", 97 * 5)  # 5 rows a block, 34 rows in all
    torch.manual_seed(0)
    model = GPT(SHAPE)
    x = torch.randint(0, 97, (2, 18))
    assert_blockwise_loss_is_plain(model, x, 97, rtol=1e-5, atol=1e-7)


def test_a_checkpoint_without_room_on_the_disk_leaves_nothing_and_the_one_before_stays_latest(small_disk,
                                                                                                monkeypatch):
    """checkpoint_io.save measures the disk before it writes, and a disk that fills while it writes is
    caught too: either way NoSpace says why, no half-written folder is left, and the checkpoint
    before stays the latest; once there is room again, the next save is whole."""
    import shutil

    import pytest

    from lmcockpit.core.train import checkpoint_io

    from .helpers import fill

    model = GPT(SHAPE)
    opts = build_optimizers(model, OptimizerConfig(), torch.device("cpu"))
    root = small_disk / "checkpoints"
    checkpoint_io.save(root, 1, model, opts, {}, "", keep=2)
    filler = fill(small_disk)
    with pytest.raises(checkpoint_io.NoSpace, match=rf"not enough free disk for a checkpoint in {root}: .*GiB free"):
        checkpoint_io.save(root, 2, model, opts, {}, "", keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    # Room measured before, then taken by another writer: the disk's own "No space left on device".
    real = shutil.disk_usage
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage", lambda path: real(path)._replace(free=1 << 40))
    with pytest.raises(checkpoint_io.NoSpace, match=r"the disk filled while .*\(No space left on device\)"):
        checkpoint_io.save(root, 2, model, opts, {}, "", keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert (root / "latest").read_text() == "step_000001\n"
    filler.unlink()
    checkpoint_io.save(root, 2, model, opts, {}, "", keep=2)
    assert (root / "latest").read_text() == "step_000002\n" and (root / "step_000002" / "state.json").is_file()


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


def reference_attention(q, k, v):
    """Attention written out in float32, K/V heads repeated to the query's, each query attending
    to the keys up to its own position (the last T of S positions, as a decoded token does)."""
    import math

    G, T, S = q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
    k, v = (t.float().repeat_interleave(G, dim=1) for t in (k, v))
    scores = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    seen = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    return scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v


# Both paths on the CPU's kernels in fp32 and fp16: K/V shared natively (enable_gqa), and K/V
# repeated to the query's heads (the path for GPUs where no fused kernel takes GQA).
ATTENTION_CASES = [(dtype, expand) for dtype in (torch.float32, torch.float16) for expand in (False, True)]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype, expand", ATTENTION_CASES)
def test_causal_attention_and_its_gradients_are_the_repeated_reference(dtype, expand):
    from lmcockpit.core.model.gpt import Attention

    torch.manual_seed(0)
    attn = Attention(SHAPE)
    attn.expand_kv = expand
    q, k, v = (torch.randn(2, h, 16, 8, dtype=dtype, requires_grad=True) for h in (4, 2, 2))
    out = attn._causal(q, k, v)
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_inputs)
    assert out.dtype == dtype and out.shape == (2, 4, 16, 8)
    tol = TOLERANCE[dtype]
    assert torch.allclose(out.float(), ref, atol=tol, rtol=tol)
    grad = torch.randn(2, 4, 16, 8)
    out.backward(grad.to(dtype))
    ref.backward(grad)
    for mine, theirs in zip((q, k, v), ref_inputs):
        assert mine.grad.shape == theirs.shape  # the repeated heads' gradients summed back onto the K/V heads
        assert torch.allclose(mine.grad.float(), theirs.grad, atol=4 * tol, rtol=4 * tol)


@pytest.mark.parametrize("dtype, expand", ATTENTION_CASES)
def test_decoding_with_the_cache_is_the_repeated_reference(dtype, expand):
    """A prompt's prefill (causal, the training path) and then one token at a time (its query heads
    as rows of their K/V head), against the reference over the whole sequence."""
    from lmcockpit.core.model.gpt import Attention, KVCache

    torch.manual_seed(0)
    attn = Attention(SHAPE).to(dtype)
    attn.expand_kv = expand
    cos, sin = rotary_tables(8, 12, 10000.0)
    x = torch.randn(2, 12, 32, dtype=dtype)
    with torch.no_grad():
        q, k, v = attn._qkv(x, cos, sin)
        ref = attn._out(reference_attention(q, k, v).to(dtype)).float()
        cache = KVCache(1, 12)
        steps = [attn.decode(x[:, :5], cos[:5], sin[:5], cache, 0)]
        cache.length = 5
        for t in range(5, 12):
            steps.append(attn.decode(x[:, t:t + 1], cos[t:t + 1], sin[t:t + 1], cache, 0))
            cache.length += 1
    tol = TOLERANCE[dtype]
    assert torch.allclose(torch.cat(steps, 1).float(), ref, atol=tol, rtol=tol)


def test_the_models_expand_kv_reaches_every_layer_and_changes_no_weight():
    model = GPT(SHAPE)
    names = list(model.state_dict())
    model.expand_kv = True
    assert model.expand_kv and all(layer.self_attn.expand_kv for layer in model.layers)
    assert list(model.state_dict()) == names
