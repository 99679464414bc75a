"""The GPT that lmcockpit trains: a Qwen3-shaped decoder in one readable module.

Architecture choices, and why:

* Token embedding tied to the LM head (one matrix, counted once): fewer parameters at small
  scale, and the export is a `Qwen3ForCausalLM` with `tie_word_embeddings = true`.
* Pre-norm blocks with RMSNorm (no biases anywhere): the modern default, cheaper than LayerNorm.
* Grouped-query attention: `n_kv_head` key/value heads shared by `n_head` query heads, computed by
  `scaled_dot_product_attention(is_causal=True, enable_gqa=True)` with no mask (a materialised mask
  doubles attention's cost). Only some kernels share K/V heads themselves: flash and cuDNN in
  bf16/fp16 from Ampere on, and the CPU's flash kernel. Elsewhere (fp32 on a GPU, fp16 before
  Ampere) torch would fall without a word to the math kernel, whose (B, H, T, T) probabilities the
  memory estimate never counted; there the trainer sets `expand_kv` (hardware/attention.py
  decides), and K/V are repeated to the query's heads for the memory-efficient kernel, at
  2·(n_head − n_kv_head)·head_dim more saved elements per token and layer, which memory_estimate.py counts.
  A decoded token's query heads go in as rows of their K/V head instead: no kernel needs GQA for
  that, and the cache is never repeated.
* RMSNorm on queries and keys per head (QK-norm, as Qwen3), applied before rotary: keeps
  attention logits bounded, which lets Muon run hot learning rates without loss spikes.
* Rotary position embedding in the non-interleaved (rotate-half) layout of Qwen3, computed in
  float32 and cast back to the input dtype so bf16 runs keep positional precision.
* SwiGLU MLP (`down(silu(gate(x)) * up(x))`).
* modded-nanogpt's speedrun changes, each a `model.` key, off by default (docs/training.md): a
  ReLU² MLP, zero-initialised o_proj/down_proj, an untied head (`lm_head`, started at zero), a
  logit soft-cap in every loss path and in decoding (head_loss.py), value embeddings mixed into
  the values of the first and last layers, U-net skips from the first half's blocks to the last
  half's, and long/short sliding-window attention (attention_masks.py; the KV cache's decode
  reads the window too). The extra tables and weights sit outside `layers.`, so Muon never gets them.
* Parameter names follow Qwen3 (`embed_tokens`, `layers.N.self_attn.q_proj`, ...), so export is a
  renaming-free copy and transformers reproduces our logits.
* The loss is computed in float32 from logits the matmul produced in the autocast dtype. Eager
  training computes it a block of rows at a time with its gradients on the way
  (`LinearCrossEntropy`): the (tokens × vocabulary) float32 logits and their gradient never exist
  whole. Compiled training keeps the plain form, which inductor fuses itself; so does fp16, whose
  loss scale must reach the logits' gradient before it is rounded. Evaluation's per-token losses
  (`token_losses`) take the same blocks of rows, without gradients, whatever the precision; task
  scoring's (`token_scores`) add whether each target was the greedy argmax.
* Inference has a path of its own (`GPT.decode` with a `KVCache`): a prompt is prefilled with the
  training forward's causal attention, then each new token attends to the cached keys and values.
  The training forward is untouched by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..data.chat_rows import IGNORE  # a target the loss skips: a chat run's prompt and padding
from .attention_masks import windowed_attention
from .head_loss import LinearCrossEntropy, _fp16_autocast, head_scores, softcap


@dataclass(frozen=True)
class GPTShape:
    vocab_size: int
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    mlp_hidden: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    # The speedrun's options (config.ModelConfig says what each does); the defaults are the model above.
    mlp: str = "swiglu"
    zero_init_proj: bool = False
    tie_embeddings: bool = True
    logit_softcap: float = 0.0
    value_embeds: int = 0
    unet_skips: bool = False
    windows: tuple[int, ...] = ()  # each layer's attention window (0: causal over all); () : none anywhere

    def value_table(self, layer: int) -> int | None:
        """Which value-embedding table feeds `layer`: table j the j-th layer and the j-th of the last
        `value_embeds` layers (modded-nanogpt's "012 ... 012"); None for the layers between."""
        n, last = self.value_embeds, self.n_layer - self.value_embeds
        return layer if layer < n else layer - last if layer >= last else None


def shape_from_config(cfg) -> GPTShape:
    """The model a run config describes (`cfg` is a `config.Config`), for training and inference alike."""
    m = cfg.model
    return GPTShape(vocab_size=cfg.tokenizer.vocab_size, n_layer=m.n_layer, d_model=m.d_model, n_head=m.n_head,
                    n_kv_head=m.n_kv_head, head_dim=cfg.head_dim, mlp_hidden=cfg.mlp_hidden,
                    max_seq_len=cfg.max_seq_len, rope_theta=m.rope_theta, norm_eps=m.norm_eps, init_std=m.init_std,
                    mlp=m.mlp, zero_init_proj=m.zero_init_proj, tie_embeddings=m.tie_embeddings,
                    logit_softcap=m.logit_softcap, value_embeds=m.value_embeds, unet_skips=m.unet_skips,
                    windows=cfg.layer_windows if any(cfg.layer_windows) else ())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as Qwen3 does, so bf16 activations do not lose the small variances.
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rotary_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, head_dim), float32, in the rotate-half layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D). Rotation in float32, result in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class KVCache:
    """Keys and values of the positions decoded so far, per layer, with room for `capacity` positions.

    Preallocated on the first write (in the dtype attention produced them), so each decoded token
    costs one in-place write per layer instead of a growing concatenation.
    """

    def __init__(self, n_layer: int, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layer

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store (B, H, T, D) keys and values after the cached positions; all of them so far."""
        end = self.length + k.shape[2]
        if self.layers[layer] is None:
            B, H, _, D = k.shape
            self.layers[layer] = (k.new_empty(B, H, self.capacity, D), v.new_empty(B, H, self.capacity, D))
        ck, cv = self.layers[layer]
        ck[:, :, self.length:end] = k
        cv[:, :, self.length:end] = v
        return ck[:, :, :end], cv[:, :, :end]

    def repeat_rows(self, n: int) -> None:
        """n copies of each row: one prefill of a prompt serves n independent samples."""
        self.layers = [None if kv is None else (kv[0].repeat_interleave(n, 0), kv[1].repeat_interleave(n, 0))
                       for kv in self.layers]


class Attention(nn.Module):
    def __init__(self, s: GPTShape, layer: int = 0):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = s.n_head, s.n_kv_head, s.head_dim
        self.q_proj = nn.Linear(s.d_model, s.n_head * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.d_model, s.n_kv_head * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.d_model, s.n_kv_head * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.n_head * s.head_dim, s.d_model, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.norm_eps)
        self.k_norm = RMSNorm(s.head_dim, s.norm_eps)
        self.expand_kv = False  # repeat K/V to the query's heads for kernels without GQA: GPT.expand_kv
        self.window = s.windows[layer] if s.windows else 0
        if s.value_table(layer) is not None:
            # The weights of this layer's values and of its value embedding: (0.5, 0.5) at the start
            # (GPT.reset_parameters), as modded-nanogpt's lambdas.
            self.value_mix = nn.Parameter(torch.full((2,), 0.5))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ve: torch.Tensor | None = None) -> torch.Tensor:
        return self._out(self._causal(*self._qkv(x, cos, sin, ve)))

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flex: bool = True) -> torch.Tensor:
        if self.expand_kv:
            # Cast before repeating, as decode does, so only the low-precision copy is made (and saved).
            groups = self.n_head // self.n_kv_head
            k, v = k.to(v.dtype).repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if self.window and self.window < q.shape[2]:  # a window as long as the sequence is plain causal
            return windowed_attention(q, k, v, self.window, flex)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
               ve: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self._qkv(x, cos, sin, ve)
        prefill = cache.length == 0
        if not prefill and x.shape[1] != 1:
            raise ValueError("after the prefill, decode takes one token per row at a time")
        # QK-norm leaves k in float32 under autocast, which SDPA would cast to v's dtype anyway: cast
        # the new token's k once here, not the whole cache at every step.
        k, v = cache.write(layer, k.to(v.dtype), v)
        if prefill:  # the prompt attends causally within itself, as in training
            # (a window's explicit mask, not FlexAttention: compiled per length, each new prompt's would recompile)
            return self._out(self._causal(q, k, v, flex=False))
        # A single new token attends to every cached position. Its query heads that share a K/V head
        # go in as that head's rows of queries, (B, H_kv, H / H_kv, D): no kernel needs GQA then, so
        # none falls to the math kernel, and the cache is never repeated to the query's heads.
        B, _, _, D = q.shape
        if self.window:  # the cache keeps every position; the window reads its most recent ones
            k, v = k[:, :, -self.window:], v[:, :, -self.window:]
        grouped = q.reshape(B, self.n_kv_head, self.n_head // self.n_kv_head, D)
        return self._out(F.scaled_dot_product_attention(grouped, k, v).reshape(B, self.n_head, 1, D))

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ve: torch.Tensor | None = None):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x)
        if ve is not None:  # kept in the projection's dtype: the float32 mix would promote attention
            v = (self.value_mix[0] * v + self.value_mix[1] * ve).to(v.dtype)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class MLP(nn.Module):
    """SwiGLU, down(silu(gate(x)) · up(x)); or with mlp = "relu2" modded-nanogpt's ReLU², down(relu(up(x))²)."""

    def __init__(self, s: GPTShape):
        super().__init__()
        self.relu2 = s.mlp == "relu2"
        if not self.relu2:
            self.gate_proj = nn.Linear(s.d_model, s.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(s.d_model, s.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(s.mlp_hidden, s.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.relu2:
            return self.down_proj(F.relu(self.up_proj(x)).square())
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, s: GPTShape, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(s.d_model, s.norm_eps)
        self.self_attn = Attention(s, layer)
        self.post_attention_layernorm = RMSNorm(s.d_model, s.norm_eps)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ve: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ve)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
               ve: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn.decode(self.input_layernorm(x), cos, sin, cache, layer, ve)
        return x + self.mlp(self.post_attention_layernorm(x))


class GPT(nn.Module):
    def __init__(self, shape: GPTShape):
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.d_model)
        self.layers = nn.ModuleList(Block(shape, i) for i in range(shape.n_layer))
        self.norm = RMSNorm(shape.d_model, shape.norm_eps)
        # Outside `layers.`, so optim.split_params gives them to AdamW (as modded-nanogpt does), not Muon.
        self.value_embeds = nn.ModuleList(nn.Embedding(shape.vocab_size, shape.n_kv_head * shape.head_dim)
                                          for _ in range(shape.value_embeds))
        self.skip_weights = nn.Parameter(torch.ones(shape.n_layer // 2)) if shape.unet_skips else None
        self.lm_head = None if shape.tie_embeddings else nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        cos, sin = rotary_tables(shape.head_dim, shape.max_seq_len, shape.rope_theta)
        # Not parameters and not saved: rebuilt from the shape, so checkpoints hold weights only.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.activation_checkpointing = False  # a training choice, not part of the shape: the trainer sets it
        self.reset_parameters()

    @property
    def expand_kv(self) -> bool:
        """Whether attention repeats K/V to the query's heads (hardware/attention.py says when): a
        choice of the device, like activation checkpointing, so neither the shape nor checkpoints
        change with it. A plain bool per layer, which torch.compile treats as a constant."""
        return self.layers[0].self_attn.expand_kv

    @expand_kv.setter
    def expand_kv(self, on: bool) -> None:
        for layer in self.layers:
            layer.self_attn.expand_kv = on

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.shape.init_std
        # Residual-branch outputs are scaled down by depth so the residual stream's variance
        # does not grow with the number of layers at initialisation (GPT-2's rule).
        out_std = std / math.sqrt(2 * self.shape.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("value_mix"):
                nn.init.constant_(p, 0.5)
            elif p.ndim == 1:
                nn.init.ones_(p)  # norms' gains, and the U-net skips' weights (as modded-nanogpt)
            elif name == "lm_head.weight" or (self.shape.zero_init_proj and name.endswith(
                    ("o_proj.weight", "down_proj.weight"))):
                nn.init.zeros_(p)  # modded-nanogpt's: each block starts as the identity, the head at uniform
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=out_std)
            else:
                nn.init.normal_(p, mean=0.0, std=std)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's matrix: the token embedding's when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def num_params(self) -> int:
        """Unique parameters: the tied embedding/head matrix counts once."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N for the matmuls (N without the tables that are only looked
        up: an untied token embedding, the value embeddings) plus 12·H·Q per attended position of
        each layer (T, or its window where shorter)."""
        s = self.shape
        lookups = sum(p.numel() for p in self.value_embeds.parameters())
        if self.lm_head is not None:
            lookups += self.embed_tokens.weight.numel()
        span = sum(min(w or seq_len, seq_len) for w in s.windows) if s.windows else s.n_layer * seq_len
        return 6 * (self.num_params() - lookups) + 12 * s.n_head * s.head_dim * span

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        # Activation checkpointing keeps only each block's input and recomputes the block in
        # backward; only when there is a backward to come (evaluation and sampling skip it).
        recompute = self.activation_checkpointing and torch.is_grad_enabled()

        def step(i: int, layer: Block, x: torch.Tensor, ve: torch.Tensor | None) -> torch.Tensor:
            return checkpoint(layer, x, cos, sin, ve, use_reentrant=False) if recompute else layer(x, cos, sin, ve)
        return self.norm(self._through_layers(idx, step))

    def _through_layers(self, idx: torch.Tensor, step) -> torch.Tensor:
        """The token embeddings of `idx` through every block, `step(i, block, x, ve)` running each:
        the layers' value embeddings and the U-net's skips (the first half's outputs, last first,
        added with learned weights to the inputs of the last half) as the shape has them."""
        x = self.embed_tokens(idx)
        ves = [table(idx) for table in self.value_embeds]
        n, half = self.shape.n_layer, self.shape.n_layer // 2
        skips = []
        for i, layer in enumerate(self.layers):
            if self.skip_weights is not None and i >= n - half:
                x = x + self.skip_weights[i - (n - half)] * skips.pop()
            j = self.shape.value_table(i)
            x = step(i, layer, x, None if j is None else ves[j])
            if self.skip_weights is not None and i < half:
                skips.append(x)
        return x

    def decode(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Float32 logits (B, V) of the next token after `idx` (B, T), which continues the positions
        held in `cache` (T > 1 only for the prefill of an empty cache)."""
        start, T = cache.length, idx.shape[1]
        if start + T > min(cache.capacity, self.shape.max_seq_len):
            raise ValueError(f"{start + T} positions do not fit the cache ({cache.capacity}) or the model's "
                             f"context ({self.shape.max_seq_len})")
        cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        x = self._through_layers(idx, lambda i, layer, x, ve: layer.decode(x, cos, sin, cache, i, ve))
        cache.length += T
        return softcap(F.linear(self.norm(x[:, -1:]), self.head_weight)[:, 0].float(), self.shape.logit_softcap)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) without targets; with them, the mean cross-entropy over the targets that
        are not IGNORE (a chat run's prompt and padding: chat_rows.py)."""
        h = self.hidden(idx)
        if targets is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling() \
                and not _fp16_autocast(h.device.type):
            return LinearCrossEntropy.apply(h.flatten(0, 1), self.head_weight, targets.reshape(-1),
                                            self.shape.logit_softcap)
        logits = F.linear(h, self.head_weight)
        if self.shape.logit_softcap:  # in float32: the cap's tanh would flatten bf16's coarse logits further
            logits = softcap(logits.float(), self.shape.logit_softcap)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE)

    def token_losses(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy (B, T) in float32, for bits-per-byte; evaluation's loss, without
        gradients. A block of rows at a time, as training's loss: the whole float32 logits of a
        micro-batch (and cross-entropy's copies of them) would be the largest allocation of a run."""
        return head_scores(self.hidden(idx).flatten(0, 1), self.head_weight, targets.reshape(-1),
                           self.shape.logit_softcap, argmax=False)[0].view(targets.shape)

    def token_scores(self, idx: torch.Tensor, targets: torch.Tensor,
                     where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What task scoring reads: at the positions `where` marks (B, T), in row order, each
        target's cross-entropy in float32 and whether it was the greedy choice. Only those
        positions reach the head, which at small scale costs more than every layer below it."""
        losses, hits = head_scores(self.hidden(idx)[where], self.head_weight, targets[where],
                                   self.shape.logit_softcap, argmax=True)
        return losses, hits
