"""A fine-tuning run (training.from_checkpoint, set by --from): its data, its starting weights, its step 0.

Not a resume: the run has its own config, schedule and data, and its optimizer state starts fresh.
nanochat's chat_sft does the same; Muon's momentum at the end of pretraining points along the last
pretraining steps, and carried over it would push the first fine-tuning steps that way, whatever
the conversations' gradients say. What it takes from the base is its weights, read from the
checkpoint's model.safetensors after the checkpoint is checked as a resume checks it
(run.checkpoint_folder.check_checkpoint: lmcockpit's own files, its metadata pickle never
unpickled here); safetensors holds tensors only.

A base whose tokenizer lacked the turn tokens has fewer embedding rows than the run's model
(tokenizer.vocab_size, grown by the front-end's plan: run.base_model): the new rows start at the
mean of the base's rows. A new token's logit is then h · mean, the average logit, so the model
starts neither favouring nor shunning it (random rows of init_std would each put an arbitrary
direction into the residual stream where the token is read, and a tied head would score it at
random). A tied head is the embedding and grows with it; an untied head (`lm_head`) and the value
embeddings are vocabulary tables too, and grow the same way.

The run scores its starting weights before its first step (an `eval` row at step 0): the line a
fine-tuning run's gains are measured from. A resumed fine-tuning run has its own checkpoint and
loads that (Checkpoints.load), never the base again.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ConfigError
from ..data import chat_data
from ..run.checkpoint_folder import WEIGHTS, check_checkpoint, checkpoint_config, tokenizer_file
from ..run.folder import TOKENIZER

EMBEDDING = "embed_tokens.weight"


def vocabulary_table(name: str) -> bool:
    """A weight with a row per token: the embedding, an untied head, a value embedding (model.value_embeds)."""
    return name in (EMBEDDING, "lm_head.weight") or (name.startswith("value_embeds.") and name.endswith(".weight"))


def prepare_data(tr) -> chat_data.ChatTrainData:
    """The run's tokenizer (its own when resumed; else the base's, with the turn tokens) and the
    rows of its conversations: the first process of each machine builds, the others then read."""
    cfg = tr.cfg
    if not cfg.training.from_checkpoint:
        raise ConfigError('data.format = "chat" fine-tunes a base model: start it with --from RUN_OR_CHECKPOINT',
                          keys=("data.format", "training.from_checkpoint"))

    def ready() -> chat_data.ChatTrainData:
        base = Path(cfg.training.from_checkpoint)
        source = tr.own_tokenizer() or tokenizer_file(base, checkpoint_config(base))
        own = chat_data.run_tokenizer(source, tr.run_dir / TOKENIZER)
        tr.stop_if_told(every=0)
        return chat_data.prepare(cfg, own, tr.log)

    data = ready() if tr.group.local_rank == 0 else None
    tr.group.barrier()
    return data or ready()


def grown_embedding(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` with rows added up to `rows`, each the mean of the rows it had (in float32, then its dtype)."""
    if rows == weight.shape[0]:
        return weight
    if rows < weight.shape[0]:
        raise ConfigError(f"the base model has {weight.shape[0]:,} embedding rows, more than this run's "
                          f"tokenizer.vocab_size = {rows:,}", keys=("tokenizer.vocab_size",))
    mean = weight.float().mean(dim=0, keepdim=True).to(weight.dtype)
    return torch.cat([weight, mean.expand(rows - weight.shape[0], -1)])


def start_from_base(tr) -> None:
    """A new fine-tuning run's weights: the base checkpoint's, its embedding grown to the run's vocabulary.
    Called on the bare model, before it is wrapped (DDP, FSDP) and its optimizers are built."""
    cfg = tr.cfg
    if not cfg.training.from_checkpoint or tr.resume_from:
        return
    from safetensors.torch import load_file

    ckpt = Path(cfg.training.from_checkpoint)
    step = check_checkpoint(ckpt)
    weights = load_file(str(ckpt / WEIGHTS), device="cpu")
    rows = tr.model.embed_tokens.weight.shape[0]
    had = weights[EMBEDDING].shape[0] if EMBEDDING in weights else rows
    for name in [name for name in weights if vocabulary_table(name)]:
        weights[name] = grown_embedding(weights[name], rows)
    try:
        tr.model.load_state_dict(weights)
    except RuntimeError as e:
        raise ConfigError(f"--from {ckpt}: its weights do not fit this run's model "
                          f"({str(e).strip().splitlines()[-1].strip()})") from None
    grown = f"; embedding grown from {had:,} to {rows:,} rows (the turn tokens), the new ones the mean of the rest" \
        if rows > had else ""
    tr.log(f"fine-tuning from {ckpt} at step {step}: its weights, a fresh optimizer state and this run's schedule"
           f"{grown}")


def evaluate_start(tr) -> None:
    """The starting weights scored before the first step (an `eval` row at step 0), for a new
    fine-tuning run: what its evaluations are measured against."""
    if tr.cfg.training.from_checkpoint and tr.step == 0 and tr.stop is None:
        tr.evaluation.evaluate(True, bool(tr.evaluation.tasks))
