"""Run configuration: one TOML file in sections, validated into dataclasses.

Every user mistake becomes a `ConfigError` whose message names the file, the key and what was
expected; the front-ends print it and exit 2. Unknown keys are errors (with the closest valid
name), never silently ignored. This module imports no torch: the front-end validates presets.

Each key is declared once, as its section's field: its type, default, help, bounds, a check of
its own and whether it may change on resume (`setting`, core/config_keys.py). Validation of a
single key, `--resume`'s keys that may change (`safe_on_resume`), a choice's values
(`choices_of`), `--set`'s completion and `lmcockpit help config` (`key_help`) all follow from
those declarations; only the rules between keys are written out, in `_between_keys`.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import sys
import tomllib
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import tomli_w

# SHOWN_CHARS and shown are core/tasks' too: their messages quote values as the config's do.
from .step_schedules import Schedules, entry_problem, order_problem
from .config_keys import SHOWN_CHARS, default_of, problems, rules_of, setting, shown, table_of, type_name  # noqa: F401


class ConfigError(ValueError):
    """A mistake in the user's input: shown as one message, exit code 2, no traceback.

    `where` is what the message blames (a file, `--set`, or `--set ITEM`) and `detail` the rest,
    so that a screen showing the mistake beside the key being edited need not cut up the text;
    `keys`, the config keys the mistake is about (none for one that is about no key)."""

    def __init__(self, detail: str, where: str = "", keys: tuple[str, ...] = ()):
        super().__init__(f"{where}: {detail}" if where else detail)
        self.where, self.detail, self.keys = str(where), detail, keys

    def __reduce__(self):  # pickled whole across the engine's queue, where/detail/keys included
        return type(self), (self.detail, self.where, self.keys)


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT_RANGE = f"a 64-bit integer (from {INT64_MIN:,} to {INT64_MAX:,})"

WANDB_FORBIDDEN = ("/", "\\", "#", "?", "%", ":")  # wandb.init refuses these: said here, before a run
HUB_TOKENIZER = re.compile(r"hf:([A-Za-z0-9][\w.-]*/[\w.-]+)")  # tokenizer.kind naming a Hub model repo


# The forms of keys that no type says (config_keys.Key.check): what is wrong with a value, or None.
def _device(value: str) -> str | None:
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return None
    return 'must be "auto", "cpu", "cuda" or "cuda:N"'


def _hub_tokenizer(value: str) -> str | None:
    if not value.startswith("hf:") or HUB_TOKENIZER.fullmatch(value):
        return None
    return ": expected hf:OWNER/NAME, a model repo on the Hub (e.g. hf:openai-community/gpt2)"


def _wandb_project(value: str) -> str | None:
    if len(value) <= 128 and not any(c in value for c in WANDB_FORBIDDEN):
        return None
    return f"must be a W&B project name: at most 128 characters, none of {' '.join(WANDB_FORBIDDEN)}"


# [notify]: a URL nothing can post to would otherwise show itself only when the run's first event
# is lost, hours in. env:NAME is checked for its form only: the variable is read by the process
# that sends (core/process/notify.py), whose environment this may not be.
def _env_name(value: str) -> bool:
    return re.fullmatch(r"env:[A-Za-z_][A-Za-z0-9_]*", value) is not None


def _http_url(value: str) -> bool:
    try:
        parts = urlsplit(value)
        parts.port  # a port beyond 65535, or not a number, raises here rather than at send time
    except ValueError:
        return False
    # urllib refuses spaces and control characters only when it sends
    return (parts.scheme in ("http", "https") and bool(parts.hostname)
            and not any(c.isspace() or not c.isprintable() for c in value))


def _post_target(value: str) -> str | None:
    return None if value == "" or _env_name(value) or _http_url(value) else "must be an http(s) URL or env:NAME"


def _apprise_url(value: str) -> str | None:
    if _env_name(value) or re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", value):
        return None
    return "must be an Apprise URL (SCHEME://...) or env:NAME"


# Each section's keys: `setting(default, help, bounds..., on_resume=...)` (core/config_keys.py).
# on_resume="safe": `--resume --set` may change it (resume.py); the rest would change the run the
# checkpoint belongs to. A comment above a key says what its one line of help cannot.
@dataclass
class ModelConfig:
    n_layer: int = setting(4, "transformer blocks", gt=0)
    d_model: int = setting(256, "the residual stream's width", gt=0)
    n_head: int = setting(4, "attention heads (query heads)", gt=0)
    n_kv_head: int = setting(2, "key/value heads (grouped-query attention); divides n_head", gt=0)
    head_dim: int = setting(0, "each head's width; 0: d_model // n_head", ge=0)
    mlp_hidden: int = setting(0, "the MLP's hidden width; 0: SwiGLU's multiple of 64 nearest 8/3 · d_model, "
                                 "relu2's 4 · d_model", ge=0)
    # Rotary positions beyond what it trains on are untrained.
    max_seq_len: int = setting(0, "the model's context; 0: training.seq_len", ge=0)
    rope_theta: float = setting(10000.0, "the rotary embeddings' base", gt=0)
    # RMSNorm divides by sqrt(mean(x²) + eps): at 0 or below a zero row is NaN.
    norm_eps: float = setting(1e-6, "RMSNorm's epsilon", gt=0)
    init_std: float = setting(0.02, "the standard deviation of the initial weights", gt=0)
    # The speedrun's model changes (modded-nanogpt's record table; docs/training.md says which
    # record brought each): all off by default, so a preset without them trains what it trained.
    mlp: Literal["swiglu", "relu2"] = setting("swiglu", 'the MLP: "swiglu" (Qwen3\'s) or "relu2": down(relu(up(x))²)')
    zero_init_proj: bool = setting(False, "attention's o_proj and the MLP's down_proj start at zero")
    tie_embeddings: bool = setting(True, "the LM head is the token embedding; false: a head of its own, "
                                         "started at zero")
    logit_softcap: float = setting(0.0, "logits become cap · tanh(logits / cap) before the loss; 0: off", ge=0)
    value_embeds: int = setting(0, "embedding tables mixed into the values of the first and last that many "
                                   "layers; 0: none", ge=0)
    unet_skips: bool = setting(False, "the first half's block outputs added to the second half's inputs "
                                      "(U-net), each with a learned weight")
    window: int = setting(0, "sliding-window attention: the long layers see this many most recent "
                             "positions; 0: all of them", ge=0)
    short_window: int = setting(0, "the short layers' window (3 of each 4 layers, mirrored about the "
                                   "middle); 0: as the long layers", ge=0)


@dataclass
class SourcePart:
    """One part of a mixture: `[[data.sources]]` tables, each with its own source and weight."""
    source: str = setting("", "the part's source, as data.source takes it (required)")
    text_field: str = setting("text", "the JSON field or Parquet/Arrow column holding the text")
    weight: float = setting(1.0, "share of the training tokens (normalised over the parts)", gt=0)


@dataclass
class DataConfig:
    # "python-stdlib"; a text, JSONL (.jsonl/.json, also .gz/.zst/.xz), Parquet or Arrow file; a folder
    # of them (save_to_disk folders too); or "hf:OWNER/NAME[/PATH]", a Hub dataset's Parquet files.
    source: str = setting("python-stdlib", "the training text: a file, a folder, hf:OWNER/NAME or python-stdlib")
    text_field: str = setting("text", "the JSON field or Parquet/Arrow column holding the text")
    val_fraction: float = setting(0.02, "share of documents (files) held out for validation", gt=0, lt=1)
    max_bytes: int = setting(0, "0: all of it; else a deterministic selection of about this many bytes", ge=0)
    cache_dir: str = setting("", 'where token caches go; "": $XDG_CACHE_HOME/lmcockpit')
    workers: int = setting(0, "tokenizer processes preparing the cache; 0: one per core, up to about 1.5 GB",
                           ge=0, on_resume="safe")
    shard_bytes: int = setting(16_000_000, "text per shard of the cache: the unit of parallel work and of resume",
                               gt=0)
    # Each part drawn by its weight, in place of data.source and data.text_field, which then stay unset.
    sources: list[SourcePart] = setting([], "a mixture instead of one source: [[data.sources]] tables")
    # "chat": data.source holds conversations (a JSONL/Parquet file or folder of {"messages": [...]},
    # hf:OWNER/NAME, or python-stdlib-chat), packed into rows with the loss on the assistant's tokens
    # (docs/chat.md); a fine-tuning run's, from a base model (--from).
    # "tokens": data.source holds text already tokenised with tokenizer.kind, as modded-nanogpt's .bin
    # shards (a 256-int32 header, then uint16 ids; data/token_shards.py), trained on as they are.
    format: Literal["text", "chat", "tokens"] = setting(
        "text", '"text" to pretrain on; "chat": conversations, to fine-tune on; "tokens": .bin token shards')
    # Validation tokens of their own (a .bin token shard: a file or hf:OWNER/NAME/FILE), not held out
    # from data.source: the tokens another project reports its losses on, so that they compare.
    val_source: str = setting("", 'a .bin token shard to validate on; "": held out from data.source')
    val_tokens: int = setting(0, "of data.val_source, the first this many tokens; 0: all of it", ge=0)
    # Every training row starts at a document's beginning: at an end-of-text token, which the token
    # cache puts between documents (and modded-nanogpt's shards before each), as the speedrun's
    # later records draw them (data/aligned_rows.py).
    bos_aligned: bool = setting(False, "every training row starts at a document's first (end-of-text) token")


@dataclass
class TokenizerConfig:
    # "bpe": a byte-level BPE trained on the source; a local folder holding tokenizer.json; or
    # "hf:OWNER/NAME", a model repo on the Hub whose tokenizer files are fetched (hf:openai-community/gpt2).
    kind: str = setting("bpe", '"bpe" (trained on the source), a folder with tokenizer.json, or hf:OWNER/NAME',
                        check=_hub_tokenizer)
    # With a pretrained tokenizer, the model's embedding rows: its vocabulary or more (GPT-2's 50,257
    # padded to 50,304, a multiple of 128).
    vocab_size: int = setting(8192, "the BPE's size; with a pretrained tokenizer, the embedding's rows", gt=0)
    train_bytes: int = setting(8_000_000, "how much training text the BPE learns merges from", ge=0)


@dataclass
class TrainingConfig:
    max_steps: int = setting(400, "optimizer steps in the run", gt=0, on_resume="safe")
    # What gets a run past running out of memory (micro-batch, accumulation, auto_micro_batch,
    # activation checkpointing) may change on resume: the same sequences a step, split otherwise.
    micro_batch_size: int = setting(16, "sequences in each forward/backward pass", gt=0, on_resume="safe")
    grad_accum_steps: int = setting(1, "micro-batches accumulated into each step", gt=0, on_resume="safe")
    seq_len: int = setting(256, "tokens in each training sequence", gt=0)
    # The speedrun's schedules (core/step_schedules.py), off when empty: [fraction of max_steps, value]
    # stages, the full batch or length before the first. A share keeps the micro-batch's shape.
    batch_schedule: list[list] = setting(
        [], "[[fraction of max_steps, share of the step's sequences], ...]: smaller batches early; []: off",
        check=lambda v: entry_problem(v, "share"), each=True)
    seq_len_schedule: list[list] = setting(
        [], "[[fraction of max_steps, sequence length], ...]: shorter sequences early (up to seq_len; a compiled "
        "model compiles once per length); []: off", check=lambda v: entry_problem(v, "length"), each=True)
    seed: int = setting(1337, "the seed of the initial weights and of the data's order", ge=0)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = setting(
        "auto", "auto: bf16 where it is supported (and pays, on a CPU), else fp16 on a GPU or fp32")
    compile: bool = setting(True, "torch.compile the model")
    # "default" suits every card; the autotuning modes compile for minutes to win a few per cent, and
    # "reduce-overhead" / "max-autotune" add CUDA graphs (fewer kernel launches: small models gain most).
    compile_mode: Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"] = setting(
        "default", "torch.compile's mode; the last two use CUDA graphs (one process only)")
    # The largest micro-batch that fits (estimated, then confirmed by a trial step), with
    # grad_accum_steps raised so that micro_batch_size × grad_accum_steps stays the same.
    auto_micro_batch: bool = setting(False, "the largest micro-batch that fits, accumulation raised to match",
                                     on_resume="safe")
    activation_checkpointing: bool = setting(
        False, "recompute activations in backward: a fraction of the memory for ~30% more compute", on_resume="safe")
    # What gets a run past a loss spike (below, and optimizer.lr, optimizer.muon_lr) may change on
    # resume: they change the steps to come, which is the point.
    grad_clip: float = setting(1.0, "the gradient norm clipped to; 0: no clipping", ge=0, on_resume="safe")
    log_every: int = setting(10, "steps between log lines", gt=0, on_resume="safe")
    on_nan: Literal["stop", "skip"] = setting("stop", "what a non-finite loss does: end the run, or skip the step",
                                              on_resume="safe")
    max_nan_skips: int = setting(10, "with on_nan \"skip\": the skips before the run stops anyway", ge=0,
                                 on_resume="safe")
    # A loss spike: a step's loss that many standard deviations above the mean of the last
    # spike_window steps (llm.c's test), judged once 10 are seen (against their median until the
    # window fills: train.spikes). "warn" says so; "skip" drops that update; "rollback" goes back
    # to the last checkpoint and steps past the batches since, with the learning rate times
    # spike_lr_factor for spike_lr_steps steps (each further rollback in that stretch cuts it
    # again), at most max_rollbacks times; "stop" ends the run. A run that stops on a spike keeps
    # the last checkpoint before it as its latest: the weights that spiked are not saved.
    on_spike: Literal["warn", "skip", "rollback", "stop"] = setting(
        "warn", "what a loss spike does (README: Spikes, stalls, and when the target is reached)", on_resume="safe")
    spike_window: int = setting(100, "the steps a spike's loss is measured against", ge=2, unit="steps",
                                on_resume="safe")
    spike_zscore: float = setting(6.0, "standard deviations above the mean that make a spike; 0: not watched",
                                  ge=0, on_resume="safe")
    spike_grad_zscore: float = setting(0.0, "the same on the gradient norm; 0: not watched", ge=0, on_resume="safe")
    # A rollback retrying at the rate that spiked meets the spike again.
    spike_lr_factor: float = setting(0.5, "after a rollback, the learning rate times this", gt=0, le=1,
                                     on_resume="safe")
    spike_lr_steps: int = setting(100, "steps at that cut rate after a rollback", ge=0, on_resume="safe")
    max_rollbacks: int = setting(3, "rollbacks before a spike stops the run", ge=0, on_resume="safe")
    # Its time of arrival is fitted from the evaluations so far.
    target_val_loss: float = setting(0.0, "the validation loss aimed at; 0: none", ge=0, on_resume="safe")
    target_task: str = setting("", "a task of eval.tasks whose accuracy is aimed at, instead of a loss",
                               on_resume="safe")
    target_accuracy: float = setting(0.0, "with target_task: the accuracy aimed at, in (0, 1]", on_resume="safe")
    stop_at_target: bool = setting(False, "end the run with a checkpoint once an evaluation reaches the target",
                                   on_resume="safe")
    # Set by --from (a run folder's latest checkpoint, or a checkpoint folder): the run's weights start
    # from that checkpoint's; its optimizer state and schedule start afresh (core/train/finetune.py).
    from_checkpoint: str = setting("", "the checkpoint a fine-tuning run's weights start from (--from); \"\": none")
    from_step: int = setting(0, "that checkpoint's step, recorded with it", ge=0)


@dataclass
class OptimizerConfig:
    # "muon": Muon for the 2-D matrices inside the blocks, AdamW for the rest; "adamw": AdamW for
    # every parameter (lr, betas, weight_decay below), the baseline that shows what Muon adds.
    kind: Literal["muon", "adamw"] = setting("muon", "Muon for the blocks' matrices and AdamW for the rest, or AdamW")
    lr: float = setting(3e-3, "AdamW's rate: embedding (tied head) and norms; with kind \"adamw\", all", gt=0,
                        on_resume="safe")
    muon_lr: float = setting(0.02, "Muon's rate: the 2-D matrices inside the blocks", gt=0, on_resume="safe")
    muon_momentum: float = setting(0.95, "Muon's momentum", ge=0, lt=1)
    # The speedrun's Muon variants (modded-nanogpt's records), off by default: core/model/muon.py.
    muon_coefficients: Literal["quintic", "polar_express"] = setting(
        "quintic", "Newton-Schulz's coefficients: one quintic, or Polar Express's per iteration (closer to orthogonal)")
    normuon: bool = setting(False, "NorMuon: each neuron's update divided by its running RMS, the step's norm kept")
    normuon_beta2: float = setting(0.95, "NorMuon's second-moment decay", ge=0, lt=1)
    weight_decay: float = setting(0.0, "on Muon's matrices; with kind \"adamw\", every 2-D parameter", ge=0)
    beta1: float = setting(0.9, "AdamW's beta1", ge=0, lt=1)
    beta2: float = setting(0.95, "AdamW's beta2", ge=0, lt=1)
    # AdamW divides by sqrt(v) + eps, and v is 0 for a parameter no gradient reached.
    eps: float = setting(1e-8, "AdamW's epsilon", gt=0)
    schedule: Literal["cosine", "wsd"] = setting("cosine", "the learning rate's schedule after warmup: cosine, "
                                                 "or warmup-stable-decay")
    warmup_steps: int = setting(20, "steps of linear warmup", ge=0)
    min_lr_ratio: float = setting(0.1, "the final learning rate as a share of the peak", ge=0, le=1)
    decay_fraction: float = setting(0.2, "wsd: the share of steps spent decaying at the end", ge=0, le=1)


@dataclass
class CheckpointConfig:
    every: int = setting(0, "steps between checkpoints; 0: only at the end", ge=0, on_resume="safe")
    keep: int = setting(3, "checkpoints kept (the oldest go)", gt=0, on_resume="safe")


@dataclass
class EvalConfig:
    every: int = setting(100, "steps between evaluations; 0: only at the end", ge=0, on_resume="safe")
    batches: int = setting(8, "micro-batches of held-out text per evaluation", gt=0, on_resume="safe")
    # Evaluation keeps no activations: its batch may differ from training's (what an out-of-memory
    # error in evaluation tells to change, leaving training's steps as they were).
    batch_size: int = setting(0, "sequences in each forward pass of validation and task scoring; 0: "
                              "training.micro_batch_size", ge=0, on_resume="safe")
    # Scored while training (core/tasks).
    tasks: list[str] = setting([], 'downstream tasks: "python-functions", or a task file\'s path', on_resume="safe")
    tasks_every: int = setting(0, "steps between task scorings; 0: at every evaluation (eval.every)", ge=0,
                               on_resume="safe")
    max_per_task: int = setting(0, "items scored of each task; 0: all of them", ge=0, on_resume="safe")
    references: dict[str, dict[str, float]] = setting(
        {}, "reference models' scores drawn beside the run's: {task = {model = accuracy}}", on_resume="safe")


# Sampling, logging and notification change no step: each may change on resume.
@dataclass
class SampleConfig:
    every: int = setting(0, "steps between samples while training; 0: never", ge=0, on_resume="safe")
    prompts: list[str] = setting(["def fibonacci("], "what the samples continue", on_resume="safe")
    max_new_tokens: int = setting(64, "tokens generated per sample", gt=0, on_resume="safe")
    temperature: float = setting(0.8, "sampling temperature; 0: greedy", ge=0, on_resume="safe")
    top_k: int = setting(50, "sample from the k likeliest tokens; 0: off", ge=0, on_resume="safe")
    top_p: float = setting(1.0, "nucleus sampling; 1: off", gt=0, le=1, on_resume="safe")


@dataclass
class HardwareConfig:
    device: str = setting("auto", '"auto", "cpu", "cuda" or "cuda:N"', check=_device, on_resume="safe")
    gpu_class: str = setting("cpu", "the card this preset was sized for")
    vram_gb: float = setting(0.0, "that card's memory in GB, for the fit verdict", ge=0, unit="GB")
    cost_per_hour: float = setting(0.0, "what the machine costs an hour, for the time to target in money; 0: not said",
                                   ge=0, on_resume="safe")


@dataclass
class DistributedConfig:
    # "ddp": every process holds the whole model; "fsdp": FSDP2 shards weights, gradients and
    # optimizer state across processes, for models that do not fit one card. The process count may
    # change on resume (accumulation follows, so a step takes the same sequences).
    strategy: Literal["ddp", "fsdp"] = setting("ddp", "ddp: a whole model per process; fsdp: shards it across them",
                                               on_resume="safe")
    nproc: int = setting(1, "training processes on each machine (one per GPU); above 1 starts torchrun", gt=0,
                         on_resume="safe")
    # The rendezvous flags (--rdzv-endpoint, --node-rank) say how they meet.
    nnodes: int = setting(1, "machines taking part", gt=0, on_resume="safe")


@dataclass
class LoggingConfig:
    """Where else the metrics go, besides metrics.jsonl (what a team already watches), and what more
    metrics.jsonl holds on demand."""
    tensorboard: bool = setting(False, "event files in the run folder's tensorboard/ (lmcockpit[tensorboard])",
                                on_resume="safe")
    wandb: str = setting("", 'a Weights & Biases project to log to; "": none (lmcockpit[wandb])',
                         check=_wandb_project, on_resume="safe")
    # Its cost, measured by bench/layer_stats.py (bench/RESULTS.md), is what the help says.
    layer_stats_every: int = setting(0, "steps between records of each block's gradient norm and update/weight "
                                     "ratio (the cockpit's layers panel); 0: none. Every 10 steps: at most 0.5% of "
                                     "a cpu preset step; every step: 1 to 5%", ge=0, on_resume="safe")


@dataclass
class NotifyConfig:
    """Where word of a run's events goes (finished, failed, nan, spike, rollback, stalled, target),
    sent by the process that owns the engine, never in training's way."""
    terminal: bool = setting(True, "every attached cockpit: the terminal's notification escape and the bell",
                             on_resume="safe")
    webhook: str = setting("", "a URL that gets each event as a JSON POST; env:NAME reads it from the environment",
                           check=_post_target, on_resume="safe")
    ntfy: str = setting("", "an ntfy topic URL (https://ntfy.sh/TOPIC or a server of your own); env:NAME too",
                        check=_post_target, on_resume="safe")
    apprise: list[str] = setting([], "Apprise URLs (Slack, Discord, e-mail...); env:NAME too (lmcockpit[notify])",
                                 check=_apprise_url, each=True, on_resume="safe")
    stall_after: float = setting(600.0, "seconds without a step (and many step times) before \"stalled\"", ge=0,
                                 on_resume="safe")

    def holds_urls(self) -> bool:
        """Whether a target is written as its URL (token and all) rather than `env:NAME`: the
        files that keep the config are then the user's alone to read (0600)."""
        return any(url and not url.startswith("env:") for url in (self.webhook, self.ntfy, *self.apprise))


@dataclass
class ProfileConfig:
    """torch.profiler over a few steps while the run trains on (core/train/profiling.py); the
    cockpit's `f` asks for the same at any time."""
    # The step before it is the profiler's warm-up; the trace goes to profiles/step_N/trace.json.gz.
    at_step: int = setting(0, "the first step profiled; 0: none (the cockpit's f asks for one at any time)", ge=0,
                           on_resume="safe")
    steps: int = setting(5, "steps profiled, after one warm-up step", gt=0, le=1000, on_resume="safe")  # profiling.MAX_STEPS
    memory: bool = setting(False, "also the CUDA memory history, for pytorch.org/memory_viz (a GPU's only)",
                           on_resume="safe")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    # Derived values the rest of the code reads, so the 0-means-default rules live in one place.
    @property
    def head_dim(self) -> int:
        return self.model.head_dim or self.model.d_model // self.model.n_head

    @property
    def mlp_hidden(self) -> int:
        if self.model.mlp_hidden:
            return self.model.mlp_hidden
        if self.model.mlp == "relu2":
            return 4 * self.model.d_model
        return max(64, round(8 * self.model.d_model / 3 / 64) * 64)

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len or self.training.seq_len

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's attention window, 0 for all the positions before it. As modded-nanogpt's
        records: a long window on every fourth layer counted from either end (the pattern mirrored
        about the middle, as its U-net is), a short one on the others."""
        m = self.model
        short = m.short_window or m.window
        return tuple(m.window if min(i, m.n_layer - 1 - i) % 4 == 0 else short for i in range(m.n_layer))

    @property
    def eval_batch_size(self) -> int:
        return self.eval.batch_size or self.training.micro_batch_size

    @property
    def world(self) -> int:
        """Training processes over all machines."""
        return self.distributed.nproc * self.distributed.nnodes

    @property
    def tokens_per_step(self) -> int:
        t = self.training
        return t.micro_batch_size * t.grad_accum_steps * t.seq_len * self.world

    def data_parts(self) -> list[Config]:
        """The data's parts, each as a config of its own: a single source is one part; a mixture's
        part keeps every setting of the whole but names its own source and text field, so its
        cache is listed, planned and keyed as a single source's would be."""
        if not self.data.sources:
            return [self]
        return [dataclasses.replace(self, data=dataclasses.replace(self.data, source=part.source,
                                                                   text_field=part.text_field, sources=[]))
                for part in self.data.sources]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    def file_mode(self) -> int:
        """The mode of a file that keeps this config: 0600 where [notify] holds a URL's secrets."""
        return 0o600 if self.notify.holds_urls() else 0o644

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


SECTIONS: dict[str, type] = {f.name: f.default_factory().__class__ for f in dataclasses.fields(Config)}


# --------------------------------------------------------------------------------------------
# Reading


def shipped_presets() -> dict[str, Path]:
    """Name → path of every preset shipped as package data."""
    root = resources.files("lmcockpit.presets")
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".toml")}


def resolve_preset(spec: str) -> Path:
    """A path to a TOML file, or the name of a shipped preset (`cpu`, `presets/3090.toml`)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    shipped = shipped_presets()
    name = path.stem if path.suffix == ".toml" else spec
    # `presets/cpu.toml` works from any folder, not only from a checkout's root.
    if name in shipped and (path.suffix != ".toml" or path.parent.name in ("presets", "")):
        return shipped[name]
    if path.exists():
        raise ConfigError("is a folder, expected a preset TOML file", spec)
    hint = _closest(name, shipped)
    raise ConfigError(
        f"preset {shown(spec)} not found: no such file, and no shipped preset of that name"
        f" (shipped: {', '.join(sorted(shipped))}){hint}"
    )


def read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read ({e.strerror})", path) from None
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text, expected a TOML file", path) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # tomllib's message already carries "(at line L, column C)".
        raise ConfigError(f"TOML syntax error: {e}", path) from None
    except (ValueError, RecursionError) as e:
        raise ConfigError(_beyond_parsing(e, text), path) from None


def _beyond_parsing(e: ValueError | RecursionError, text: str = "") -> str:
    """What valid TOML held that Python cannot read, and what was expected (in a file's `text`, on
    which line). tomllib recurses once per level of nesting with no limit of its own (a
    RecursionError), and int() refuses more than sys.get_int_max_str_digits() digits (a ValueError
    that is no TOMLDecodeError, the only other error tomllib lets out)."""
    if isinstance(e, RecursionError):
        return "arrays or tables nested hundreds of levels deep, more than can be read; expected a few levels"
    limit = sys.get_int_max_str_digits()
    long = re.search(rf"[0-9_]{{{limit + 1},}}", text) if text else None
    line = f"line {text.count(chr(10), 0, long.start()) + 1}: " if long else ""
    return f"{line}an integer of more than {limit:,} digits; expected {INT_RANGE}"


def parse_override(item: str) -> tuple[str, str, Any]:
    """`section.key=VALUE` with VALUE in TOML syntax → (section, key, value)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError("expected SECTION.KEY=VALUE, e.g. --set training.max_steps=200", f"--set {shown(item)}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        # A bare word is the common case for strings (`--set data.source=./corpus`).
        if raw.strip() and not any(c in raw for c in "\"'[]{}=\n"):
            value = raw.strip()
        else:
            raise ConfigError(f"{shown(raw.strip())} is not a TOML value (strings in quotes, numbers, true/false, "
                              "[lists])", f"--set {shown(item)}", keys=(key,)) from None
    except (ValueError, RecursionError) as e:
        raise ConfigError(_beyond_parsing(e), f"--set {key} = {shown(raw.strip())}", keys=(key,)) from None
    return parts[0], parts[1], value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in overrides:
        section, key, value = parse_override(item)
        if section not in SECTIONS:  # here, where the --set item is known, so it is named and not the file
            raise ConfigError(f"unknown section [{section}]"
                              f"{_closest(section, SECTIONS) or ' (sections: ' + ', '.join(SECTIONS) + ')'}",
                              f"--set {shown(item)}")
        target = out.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{section!r} is not a section", f"--set {shown(item)}")
        target[key] = value
    return out


def load_config(spec: str | Path, overrides: list[str] | None = None) -> tuple[Config, Path]:
    path = resolve_preset(str(spec))
    raw = apply_overrides(read_toml(path), overrides or [])
    from_set = {".".join(parse_override(item)[:2]) for item in overrides or []}
    return config_from_dict(raw, source=str(path), from_set=from_set), path


def config_from_dict(raw: dict[str, Any], source: str = "<config>", from_set: set[str] = frozenset()) -> Config:
    """`from_set`: the keys that came from `--set`, so their errors blame `--set`, not the file."""
    sections: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown section [{name}]{_closest(name, SECTIONS)}", source)
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a [{name}] section, got a {_toml_type(value)}", source)
        sections[name] = _build_section(name, SECTIONS[name], value, source, from_set)
    cfg = Config(**sections)
    validate(cfg, source, from_set)
    return cfg


def _build_section(name: str, cls: type, values: dict[str, Any], source: str, from_set: set[str]):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        where = "--set" if f"{name}.{key}" in from_set else source
        if key not in known:
            raise ConfigError(f"unknown key {name}.{key}{_closest(key, known, prefix=name + '.')}", where,
                              keys=(f"{name}.{key}",))
        kwargs[key] = _check_type(f"{name}.{key}", value, hints[key], where)
    return cls(**kwargs)


def _build_table(key: str, cls: type, values: dict[str, Any], source: str):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for name in values:
        if name not in known:
            raise ConfigError(f"unknown key {key}.{name}{_closest(name, known, prefix=key + '.')}", source,
                              keys=(f"{key}.{name}",))
    return cls(**{name: _check_type(f"{key}.{name}", v, hints[name], source) for name, v in values.items()})


def _check_type(key: str, value: Any, hint: Any, source: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            allowed = " | ".join(repr(c) for c in choices)
            raise ConfigError(f"{key} = {shown(value)} is not one of {allowed}", source, keys=(key,))
        return value
    if origin is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
        (item,) = typing.get_args(hint)
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(f"{key} must be a list of tables ([[{key}]] entries), got {shown(value)}", source,
                              keys=(key,))
        return [_build_table(f"{key}[{i}]", item, v, source) for i, v in enumerate(value)]
    if origin is dict:
        _, inner = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table, got {_toml_type(value)} {shown(value)}", source, keys=(key,))
        return {name: _check_type(f"{key}.{name}", v, inner, source) for name, v in value.items()}
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            raise ConfigError(f"{key} must be a list of {item.__name__}, got {shown(value)}", source, keys=(key,))
        return list(value)
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }[hint](value)
    if not ok:
        raise ConfigError(f"{key} must be {_article(hint)}, got {_toml_type(value)} {shown(value)}", source,
                          keys=(key,))
    # Counts, sizes and seeds end up in int64 tensors and float arithmetic (the token budget), where
    # a larger integer overflows far from the key that held it.
    if hint is int and not INT64_MIN <= value <= INT64_MAX:
        raise ConfigError(f"{key} = {shown(value)} is out of range, expected {INT_RANGE}", source, keys=(key,))
    if hint is float and isinstance(value, int) and not abs(value) <= sys.float_info.max:
        raise ConfigError(f"{key} = {shown(value)} is beyond any float, expected a finite number", source,
                          keys=(key,))
    return float(value) if hint is float else value


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def cuda_graphs_need_one_process(mode: str, processes: str) -> str:
    """Why a CUDA-graph compile mode cannot train through torchrun: under DDP's no_sync and FSDP's
    unsynchronised micro-batches, autograd installs gradients straight from the graphs' pool, and
    the next replay overwrites them (pytorch/pytorch#169545); DDP with CUDA graphs has open
    failures of its own (#113809, #140395)."""
    return (f"training.compile_mode = {mode!r} uses CUDA graphs, which lmcockpit runs in one process only, not "
            f"through torchrun ({processes}): gradients accumulated by DDP or FSDP would be overwritten by the "
            "next graph replay. Use \"default\" or \"max-autotune-no-cudagraphs\"")


def validate(cfg: Config, source: str = "<config>", from_set: set[str] = frozenset()) -> None:
    """Each key against its own rules (its `setting`), then the rules between keys; the first
    mistake is raised, blaming `--set` when a key it is about came from there (`from_set`)."""
    def blamed(keys: tuple[str, ...]) -> str:
        return "--set" if any(k.split("[")[0] in from_set for k in keys) else source

    for section in dataclasses.fields(cfg):
        for key, message in problems(getattr(cfg, section.name), section.name):
            raise ConfigError(message, blamed((key,)), keys=(key,))
    for keys, message in _between_keys(cfg):
        raise ConfigError(message, blamed(keys), keys=keys)


def _between_keys(cfg: Config) -> Iterator[tuple[tuple[str, ...], str]]:
    """(the keys it is about, message) for each rule that relates several keys and is broken; each
    key's own bounds hold by now (n_kv_head is positive before n_head is divided by it)."""
    m, t, d = cfg.model, cfg.training, cfg.distributed
    if m.n_head % m.n_kv_head:
        yield (("model.n_kv_head", "model.n_head"),
               f"model.n_kv_head = {m.n_kv_head} must divide model.n_head = {m.n_head} (grouped-query attention)")
    if not m.head_dim and m.d_model % m.n_head:
        yield (("model.n_head", "model.d_model", "model.head_dim"),
               f"model.n_head = {m.n_head} must divide model.d_model = {m.d_model} (or set model.head_dim)")
    if cfg.head_dim % 2:
        yield (("model.head_dim", "model.d_model", "model.n_head"),
               f"the head dimension ({cfg.head_dim}) must be even for rotary embeddings")
    if 2 * m.value_embeds > m.n_layer:
        yield (("model.value_embeds", "model.n_layer"),
               f"model.value_embeds = {m.value_embeds} feeds the first and the last {m.value_embeds} layers: at most "
               f"half of model.n_layer = {m.n_layer}")
    if m.window and m.short_window > m.window:
        yield (("model.short_window", "model.window"),
               f"model.short_window = {m.short_window} is longer than model.window = {m.window}: the short "
               "layers' window is the shorter one")
    if t.seq_len > cfg.max_seq_len:
        yield (("training.seq_len", "model.max_seq_len"),
               f"training.seq_len = {t.seq_len} is above the model's context, model.max_seq_len = {m.max_seq_len}")
    for key, stages in (("training.batch_schedule", t.batch_schedule), ("training.seq_len_schedule", t.seq_len_schedule)):
        if problem := order_problem(key, stages):
            yield (key,), problem
    if t.batch_schedule and (problem := Schedules.of(cfg).problem()):  # again at the start: a resume's data unit
        yield ("training.batch_schedule", "training.grad_accum_steps", "distributed.nproc"), problem
    if t.seq_len_schedule and cfg.data.format == "chat":
        yield (("training.seq_len_schedule", "data.format"),
               'training.seq_len_schedule shortens windows of a token stream; data.format = "chat" trains on whole '
               "conversation rows, which keep their length")
    if longer := [n for _, n in t.seq_len_schedule if n > t.seq_len]:
        yield (("training.seq_len_schedule", "training.seq_len"),
               f"training.seq_len_schedule's lengths {longer} are above training.seq_len = {t.seq_len}, the longest "
               "a step takes (what memory is sized for)")
    yield from _data_rules(cfg)
    if t.target_task and t.target_val_loss:
        yield (("training.target_val_loss", "training.target_task"),
               "training.target_val_loss and training.target_task: one target at a time (set the other to its "
               "default)")
    if t.target_task and not 0 < t.target_accuracy <= 1:
        yield (("training.target_accuracy", "training.target_task"),
               f"training.target_accuracy = {t.target_accuracy} must be in (0, 1] with training.target_task")
    if t.target_accuracy and not t.target_task:
        yield (("training.target_accuracy", "training.target_task"),
               f"training.target_accuracy = {t.target_accuracy} needs training.target_task, the task it is of")
    if not t.compile and t.compile_mode != "default":
        yield (("training.compile_mode", "training.compile"),
               f"training.compile_mode = {t.compile_mode!r} needs training.compile = true")
    if cfg.world > 1 and t.compile_mode in CUDA_GRAPH_MODES:
        yield (("training.compile_mode", "distributed.nproc", "distributed.nnodes"),
               cuda_graphs_need_one_process(t.compile_mode, f"distributed.nproc = {d.nproc}, nnodes = {d.nnodes}"))
    if t.auto_micro_batch and cfg.world > 1:
        yield (("training.auto_micro_batch", "distributed.nproc", "distributed.nnodes"),
               f"training.auto_micro_batch = true needs a single process (distributed.nproc = {d.nproc}, "
               f"nnodes = {d.nnodes}): every rank must use the same micro-batch; set "
               "training.micro_batch_size (lmcockpit presets shows what fits)")
    # Each process takes the GPU of its local rank: one named GPU cannot serve several.
    dev = cfg.hardware.device
    if d.nproc > 1 and dev.startswith("cuda:"):
        yield (("hardware.device", "distributed.nproc"),
               f"hardware.device = {shown(dev)} names one GPU, but distributed.nproc = {d.nproc} processes each "
               "take their own (process i uses GPU i); use \"auto\" or \"cuda\", and CUDA_VISIBLE_DEVICES to "
               "choose GPUs")



def _data_rules(cfg: Config) -> Iterator[tuple[tuple[str, ...], str]]:
    """_between_keys's rules of the data and its tokenizer."""
    # 256 bytes and the 5 special tokens a BPE reserves (data/chat_template.py's RESERVED)
    if cfg.tokenizer.kind == "bpe" and cfg.tokenizer.vocab_size < 261:
        yield (("tokenizer.vocab_size", "tokenizer.kind"),
               f"tokenizer.vocab_size = {cfg.tokenizer.vocab_size} must be at least 261 (256 bytes + 5 special tokens)")
    default = DataConfig()
    if cfg.data.sources and (cfg.data.source, cfg.data.text_field) != (default.source, default.text_field):
        yield (("data.sources", "data.source", "data.text_field"),
               "data.source and data.text_field name one source; with [[data.sources]] each part names its own")
    for i, part in enumerate(cfg.data.sources):
        if not part.source:  # required in a part; the field's default only stands in for it
            yield ("data.sources",), f"data.sources[{i}].source is missing: each part names its source"
    if cfg.data.val_source and cfg.data.format != "tokens":
        yield (("data.val_source", "data.format"),
               f'data.val_source = {cfg.data.val_source!r} is a .bin token shard: it needs data.format = "tokens"')
    if cfg.data.val_tokens and not cfg.data.val_source:
        yield (("data.val_tokens", "data.val_source"),
               f"data.val_tokens = {cfg.data.val_tokens} counts tokens of data.val_source, which is not set")
    if cfg.data.format == "tokens" and (cfg.data.sources or cfg.tokenizer.kind == "bpe"):
        yield (("data.format", "tokenizer.kind"),
               'data.format = "tokens" reads ids made by a pretrained tokenizer (tokenizer.kind = hf:OWNER/NAME or a '
               "folder), from one data.source, not a mixture")
    if cfg.data.format == "chat" and cfg.data.sources:
        yield (("data.format", "data.sources"),
               'data.format = "chat" reads one conversation source (data.source), not a mixture ([[data.sources]])')

# --------------------------------------------------------------------------------------------
# What the declarations tell the rest: resume, completion, `lmcockpit help config`


def keys() -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(section.key, its field, its type) of every key, in the order of the sections and their
    fields; a mixture part's keys follow data.sources as data.sources[].KEY."""
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield f"{section}.{f.name}", f, hints[f.name]
            if (table := table_of(hints[f.name])) is not None:
                inner = typing.get_type_hints(table)
                for g in dataclasses.fields(table):
                    yield f"{section}.{f.name}[].{g.name}", g, inner[g.name]


def field_of(key: str) -> tuple[dataclasses.Field, Any]:
    """The field of `section.key` and its type; a ConfigError naming the key when there is none."""
    found = {name: (f, hint) for name, f, hint in keys()}
    if key not in found:
        raise ConfigError(f"no config key {key}{_closest(key, found)}")
    return found[key]


def choices_of(key: str) -> tuple[Any, ...]:
    """The values a choice key can take, as its Literal type declares them:
    choices_of("training.on_spike") == ("warn", "skip", "rollback", "stop"); () for a key that is
    no choice."""
    _, hint = field_of(key)
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def safe_on_resume() -> frozenset[str]:
    """The keys that `--resume --set` may change: those declared on_resume="safe"."""
    return frozenset(name for name, f, _ in keys() if "[]" not in name and rules_of(f).on_resume == "safe")


@dataclass(frozen=True)
class KeyHelp:
    """One key as `lmcockpit help config` and `--set`'s completion describe it."""
    key: str
    type: str  # int, list[str], "warn" | "skip", with its bounds: int > 0, float in [0, 1)
    default: str  # in TOML, as --set takes it
    help: str
    safe_on_resume: bool


def key_help() -> list[KeyHelp]:
    rows = []
    for name, f, hint in keys():
        rules = rules_of(f)
        default = default_of(f)
        rows.append(KeyHelp(name, " ".join(filter(None, (type_name(hint), rules.bounds()))),
                            "" if table_of(hint) else toml_value(default), rules.help,
                            rules.on_resume == "safe"))
    return rows


def toml_value(value) -> str:
    """A value as `--set` takes it, on one line (tomli_w spreads a list over several, which a
    table row and the edit box cannot show)."""
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # a mixture's part: an inline table, as --set data.sources=[{...}] takes it
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return tomli_w.dumps({"v": value}).strip()[4:]


def _closest(word: str, choices, prefix: str = "") -> str:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{match[0]}?)" if match else ""


def _toml_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


def _article(hint: type) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]
