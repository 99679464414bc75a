"""The speedrun's model options (model.mlp, zero_init_proj, tie_embeddings, logit_softcap,
value_embeds, unet_skips, window/short_window): each one's math against a reference written out
here, the optimizer's split, the counts without torch, and a checkpoint's round trip."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from lmcockpit.core.config import ConfigError, load_config
from lmcockpit.core.hardware import compute_estimate, memory_estimate
from lmcockpit.core.model.attention_masks import flex_block_mask, window_mask, windowed_attention
from lmcockpit.core.model.gpt import GPT, Attention, Block, GPTShape, KVCache, rotary_tables, shape_from_config
from lmcockpit.core.model.head_loss import LinearCrossEntropy
from lmcockpit.core.train.optim import split_params

from .helpers_model import assert_blockwise_loss_is_plain
from .helpers import tiny_config

SHAPE = GPTShape(vocab_size=97, n_layer=4, d_model=32, n_head=4, n_kv_head=2, head_dim=8, mlp_hidden=64,
                 max_seq_len=24)
ALL_ON = ["model.mlp=\"relu2\"", "model.zero_init_proj=true", "model.tie_embeddings=false", "model.logit_softcap=15.0",
          "model.value_embeds=1", "model.unet_skips=true", "model.window=16", "model.short_window=8"]


def shaped(**options) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(SHAPE, **options))


def test_relu2_mlp_is_down_of_relu_up_squared_with_4x_hidden_by_default():
    model = shaped(mlp="relu2")
    mlp = model.layers[0].mlp
    assert not hasattr(mlp, "gate_proj")
    x = torch.randn(3, 5, 32)
    expected = torch.clamp(x @ mlp.up_proj.weight.T, min=0) ** 2 @ mlp.down_proj.weight.T
    assert torch.allclose(mlp(x), expected, atol=1e-6)
    assert tiny_config("model.mlp=\"relu2\"").mlp_hidden == 4 * tiny_config().model.d_model
    assert tiny_config("model.mlp=\"relu2\"", "model.mlp_hidden=96").mlp_hidden == 96


def test_zero_init_projections_make_each_block_the_identity_at_the_start():
    model = shaped(zero_init_proj=True)
    cos, sin = model.rope_cos[:6], model.rope_sin[:6]
    x = torch.randn(2, 6, 32)
    for layer in model.layers:
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
        assert torch.equal(layer(x, cos, sin), x)
    assert shaped().layers[0].self_attn.o_proj.weight.any()  # off: GPT-2's scaled normal init


def test_an_untied_head_starts_at_zero_and_is_its_own_matrix():
    model = shaped(tie_embeddings=False)
    assert model.lm_head.weight.shape == (97, 32) and not model.lm_head.weight.any()
    assert model.head_weight is model.lm_head.weight
    x = torch.randint(0, 97, (2, 9))
    # Uniform logits at the start: the loss is ln V, and the head is what the logits are made of.
    assert torch.allclose(model(x[:, :-1], x[:, 1:]), torch.tensor(math.log(97)))
    with torch.no_grad():
        model.lm_head.weight.normal_()
        expected = model.hidden(x) @ model.lm_head.weight.T
    assert torch.allclose(model(x), expected, atol=1e-5)
    assert "lm_head.weight" in model.state_dict() and "lm_head.weight" not in shaped().state_dict()


def test_softcap_caps_the_logits_in_every_loss_path_and_in_decoding(monkeypatch):
    model = shaped(logit_softcap=2.0)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(50)  # logits well beyond the cap, where tanh bends them
    x = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        raw = model.hidden(x) @ model.embed_tokens.weight.T
        capped = 2.0 * torch.tanh(raw / 2.0)
        assert raw.abs().max() > 4 and torch.allclose(model(x), capped, atol=1e-5)
        expected = F.cross_entropy(capped[:, :-1].reshape(-1, 97), x[:, 1:].reshape(-1), reduction="none")
        assert torch.allclose(model.token_losses(x[:, :-1], x[:, 1:]).flatten(), expected, atol=1e-5)
        where = torch.zeros(2, 12, dtype=torch.bool)
        where[:, 4:] = True
        losses, hits = model.token_scores(x[:, :-1], x[:, 1:], where)
        assert torch.allclose(losses, expected.view(2, 12)[:, 4:].flatten(), atol=1e-5)
        assert torch.equal(hits, (capped[:, :-1].argmax(-1) == x[:, 1:])[:, 4:].flatten())
        assert torch.allclose(model.decode(x, KVCache(4, 24)), capped[:, -1], atol=1e-5)
    # Training's block-wise loss and its gradients: the plain loss of the capped logits.
    monkeypatch.setattr(LinearCrossEntropy, "BLOCK_ELEMENTS", 97 * 5)
    assert_blockwise_loss_is_plain(model, x, 97, rtol=1e-4, atol=1e-6)


def test_value_embeddings_mix_into_the_values_of_the_first_and_last_layers():
    model = shaped(value_embeds=2)
    assert [model.shape.value_table(i) for i in range(4)] == [0, 1, 0, 1]
    assert [t.weight.shape for t in model.value_embeds] == [(97, 16)] * 2  # n_kv_head · head_dim wide
    attn = model.layers[0].self_attn
    assert torch.equal(attn.value_mix, torch.tensor([0.5, 0.5]))
    with torch.no_grad():
        attn.value_mix.copy_(torch.tensor([0.3, -0.8]))
    cos, sin = rotary_tables(8, 6, 10000.0)
    x, idx = torch.randn(2, 6, 32), torch.randint(0, 97, (2, 6))
    ve = model.value_embeds[0](idx)
    _, _, v = attn._qkv(x, cos, sin, ve)
    expected = (0.3 * (x @ attn.v_proj.weight.T) - 0.8 * ve).view(2, 6, 2, 8).transpose(1, 2)
    assert torch.allclose(v, expected, atol=1e-6)
    # Through the model: each layer gets its table's embedding of the tokens, written out by hand.
    with torch.no_grad():
        cos, sin = model.rope_cos[:6], model.rope_sin[:6]
        h = model.embed_tokens(idx)
        for layer, table in zip(model.layers, (0, 1, 0, 1)):
            h = layer(h, cos, sin, model.value_embeds[table](idx))
        assert torch.allclose(model.hidden(idx), model.norm(h), atol=1e-6)


def test_unet_skips_add_the_first_half_outputs_to_the_second_half_inputs_last_first():
    model = shaped(unet_skips=True)
    with torch.no_grad():
        model.skip_weights.copy_(torch.tensor([0.3, -0.7]))
        idx = torch.randint(0, 97, (2, 7))
        cos, sin = model.rope_cos[:7], model.rope_sin[:7]
        L = model.layers
        x1 = L[0](model.embed_tokens(idx), cos, sin)
        x2 = L[1](x1, cos, sin)
        x3 = L[2](x2 + 0.3 * x2, cos, sin)
        x4 = L[3](x3 - 0.7 * x1, cos, sin)
        assert torch.allclose(model.hidden(idx), model.norm(x4), atol=1e-6)


def test_long_and_short_windows_follow_the_records_pattern():
    cfg = load_config("debug", ["model.n_layer=12", "model.window=1792", "model.short_window=896"])[0]
    L, S = 1792, 896
    assert cfg.layer_windows == (L, S, S, S, L, S, S, L, S, S, S, L)  # the 2025-01-16 record's 12 layers
    assert tiny_config("model.window=64").layer_windows == (64, 64)
    assert tiny_config("model.short_window=8", "model.n_layer=3").layer_windows == (0, 8, 0)
    assert shape_from_config(tiny_config()).windows == ()


def reference_window_attention(q, k, v, window):
    """Each query's softmax over the keys of its window alone, head by head (K/V heads shared)."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for h in range(q.shape[1]):
        for t in range(q.shape[2]):
            lo = max(0, t - window + 1)
            scores = q[:, h, t, None] @ k[:, h // groups, lo:t + 1].transpose(-1, -2) / math.sqrt(q.shape[-1])
            out[:, h, t] = (scores.softmax(-1) @ v[:, h // groups, lo:t + 1])[:, 0]
    return out


def test_windowed_attention_is_the_reference_and_flex_attentions_block_mask_agrees():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 40, 8), torch.randn(2, 2, 40, 8), torch.randn(2, 2, 40, 8)
    mine = windowed_attention(q, k, v, 6)
    assert torch.allclose(mine, reference_window_attention(q, k, v, 6), atol=1e-5)
    assert window_mask(4, 2).tolist() == [[True, False, False, False], [True, True, False, False],
                                          [False, True, True, False], [False, False, True, True]]
    # FlexAttention runs on CPU too (unfused): its block mask, built from the same rule, agrees.
    from torch.nn.attention.flex_attention import flex_attention

    block = flex_block_mask(40, 6, "cpu")
    i = torch.arange(40)
    assert torch.equal(block.mask_mod(0, 0, i[:, None], i[None, :]), window_mask(40, 6))
    flex = flex_attention(q, k, v, block_mask=block, enable_gqa=True)
    assert torch.allclose(flex, mine, atol=1e-5)


def test_decoding_with_the_cache_applies_the_window():
    model = shaped(windows=(5, 3, 3, 5), value_embeds=1, unet_skips=True, tie_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.normal_()
        x = torch.randint(0, 97, (2, 20))
        full = model(x)
        cache = KVCache(4, 24)
        steps = [model.decode(x[:, :7], cache)]
        steps += [model.decode(x[:, t:t + 1], cache) for t in range(7, 20)]
    assert torch.allclose(torch.stack(steps, 1), full[:, 6:], atol=1e-4)
    assert not torch.allclose(full, shaped(value_embeds=1, unet_skips=True, tie_embeddings=False)(x))


def test_muon_gets_only_the_blocks_matrices_and_the_counts_match_the_model():
    cfg = tiny_config(*ALL_ON, "model.n_layer=4")
    model = GPT(shape_from_config(cfg))
    muon, adamw = split_params(model)
    assert all(n.startswith("layers.") and p.ndim == 2 for n, p in muon)
    assert {"lm_head.weight", "value_embeds.0.weight", "skip_weights", "layers.0.self_attn.value_mix",
            "embed_tokens.weight"} <= {n for n, _ in adamw}
    counts = memory_estimate.param_counts(cfg)
    assert counts.total == model.num_params()
    assert counts.muon == sum(p.numel() for _, p in muon) and counts.adamw == sum(p.numel() for _, p in adamw)
    assert compute_estimate.flops_per_token(cfg) == model.flops_per_token(cfg.training.seq_len)
    # The untied token embedding and the value embeddings are looked up, not multiplied: no FLOPs.
    untied = tiny_config("model.tie_embeddings=false")
    tied = tiny_config()
    assert compute_estimate.flops_per_token(untied) == compute_estimate.flops_per_token(tied)
    assert memory_estimate.param_counts(untied).total == memory_estimate.param_counts(tied).total + 512 * 64


def test_a_checkpoint_round_trips_every_option(tmp_path):
    from lmcockpit.core.train import checkpoint_io
    from lmcockpit.core.train.optim import build_optimizers

    cfg = tiny_config(*ALL_ON, "model.n_layer=4")
    torch.manual_seed(0)
    model = GPT(shape_from_config(cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # away from the zero and constant inits, so a lost tensor shows
    opts = build_optimizers(model, cfg.optimizer, torch.device("cpu"))
    path = checkpoint_io.save(tmp_path, 3, model, opts, {}, cfg.to_toml(), keep=2)
    torch.manual_seed(1)
    again = GPT(shape_from_config(cfg))
    # What inference and export read: the whole weights, every tensor expected and nothing else.
    from safetensors.torch import load_file

    again.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    x = torch.randint(0, 512, (2, 20))
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


@pytest.mark.parametrize("overrides, words", [
    (["model.value_embeds=2", "model.n_layer=3"], "model.value_embeds = 2 feeds the first and the last 2 layers"),
    (["model.window=8", "model.short_window=16"], "model.short_window = 16 is longer than model.window = 8"),
    (["model.mlp=\"gelu\""], "model.mlp"),
    (["model.logit_softcap=-1.0"], "model.logit_softcap"),
])
def test_bad_option_values_are_config_errors(overrides, words):
    with pytest.raises(ConfigError, match=words):
        tiny_config(*overrides)


def test_defaults_build_todays_model():
    """Every option off by default: the same parameters as before they existed, the same init draws."""
    cfg = tiny_config()
    shape = shape_from_config(cfg)
    plain = GPTShape(**{f.name: getattr(shape, f.name) for f in dataclasses.fields(GPTShape)
                        if f.name in ("vocab_size", "n_layer", "d_model", "n_head", "n_kv_head", "head_dim",
                                      "mlp_hidden", "max_seq_len", "rope_theta", "norm_eps", "init_std")})
    assert shape == plain
    assert isinstance(Block(shape).self_attn, Attention) and not hasattr(Block(shape).self_attn, "value_mix")
