"""`--from RUN_OR_CHECKPOINT`: the base a fine-tuning run starts from, checked, and the config it trains with.

The front-end's part, before any run folder or engine: the checkpoint found (a run folder's latest,
or a checkpoint folder) and checked as a resume checks one; the preset's model shape compared with
the base's, key by key; the base's tokenizer taken, with the embedding rows it needs once the chat
template's turn tokens are added (tokenizer.vocab_size: the base's, grown where they are new). The
config records where the weights came from (training.from_checkpoint, training.from_step), so
`compare` and the run's log say "fine-tuned from X at step N", and a resume reads it there.
The engine's part is core/train/finetune.py. Torch: never.
"""

from __future__ import annotations

import dataclasses

from ..config import Config, ConfigError
from ..run.checkpoint_folder import check_checkpoint, checkpoint_config, find_checkpoint, tokenizer_file
from .chat_data import grown_vocab


def shape(cfg: Config) -> dict[str, object]:
    """What decides the weights' shapes and what they compute, by config key (0-means-default keys resolved)."""
    m = cfg.model
    return {"model.n_layer": m.n_layer, "model.d_model": m.d_model, "model.n_head": m.n_head,
            "model.n_kv_head": m.n_kv_head, "model.head_dim": cfg.head_dim, "model.mlp_hidden": cfg.mlp_hidden,
            "model.rope_theta": m.rope_theta, "model.norm_eps": m.norm_eps, "model.mlp": m.mlp,
            "model.tie_embeddings": m.tie_embeddings, "model.logit_softcap": m.logit_softcap,
            "model.value_embeds": m.value_embeds, "model.unet_skips": m.unet_skips, "model.window": m.window,
            "model.short_window": m.short_window}


def plan_from(cfg: Config, spec: str) -> Config:
    """`cfg` (the preset's, --set applied) as a fine-tuning run from `spec`; a ConfigError of one
    line where it cannot be one."""
    if cfg.data.format != "chat":
        raise ConfigError(f"--from {spec}: a fine-tuning run trains on conversations; its preset needs "
                          'data.format = "chat" (as presets/chat-cpu.toml has)', keys=("data.format",))
    try:
        ckpt = find_checkpoint(spec)
    except ConfigError as e:  # its message starts with the path: said as the flag's
        raise ConfigError(f"--from {e}", keys=("training.from_checkpoint",)) from None
    step = check_checkpoint(ckpt)
    base = checkpoint_config(ckpt)
    ours, theirs = shape(cfg), shape(base)
    for key, value in ours.items():
        if value != theirs[key]:
            raise ConfigError(f"--from {spec}: {key} = {value} here but {theirs[key]} in the base model "
                              f"({ckpt}); a fine-tuning run keeps its base's shape", keys=(key,))
    rows, _ = grown_vocab(tokenizer_file(ckpt, base), base.tokenizer.vocab_size)
    return dataclasses.replace(
        cfg, tokenizer=dataclasses.replace(base.tokenizer, vocab_size=rows),
        training=dataclasses.replace(cfg.training, from_checkpoint=str(ckpt.resolve()), from_step=step))
