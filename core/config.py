"""Run configuration: one TOML file in sections, validated into dataclasses.

Every user mistake becomes a `ConfigError` whose message names the file, the key and what was
expected; the front-ends print it and exit 2. Unknown keys are errors (with the closest valid
name), never silently ignored. This module imports no torch: the front-end validates presets.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import hashlib
import json
import re
import sys
import tomllib
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import tomli_w


class ConfigError(ValueError):
    """A mistake in the user's input: shown as one message, exit code 2, no traceback."""


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT_RANGE = f"a 64-bit integer (from {INT64_MIN:,} to {INT64_MAX:,})"
SHOWN_CHARS = 60  # of a value in a message: a pasted file or 5,000 digits is abbreviated


def shown(value: Any) -> str:
    """`value` as a message quotes it (repr), abbreviated past SHOWN_CHARS with its length said,
    so that an error stays one line."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    size = f"{len(str(abs(value))):,} digits" if isinstance(value, int) else f"{len(str(value)):,} characters"
    return f"{text[:SHOWN_CHARS // 2]}…{text[-SHOWN_CHARS // 4:]} ({size})"


@dataclass
class ModelConfig:
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 0  # 0: d_model // n_head
    mlp_hidden: int = 0  # 0: the multiple of 64 nearest 8/3 · d_model (SwiGLU's usual width)
    max_seq_len: int = 0  # 0: training.seq_len; rotary positions beyond what it trains on are untrained
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02


@dataclass
class SourcePart:
    """One part of a mixture: `[[data.sources]]` tables, each with its own source and weight."""
    source: str = ""
    text_field: str = "text"
    weight: float = 1.0  # share of the training tokens (normalised over the parts)


@dataclass
class DataConfig:
    # "python-stdlib"; a text, JSONL (.jsonl/.json, also .gz/.zst/.xz), Parquet or Arrow file; a folder
    # of them (save_to_disk folders too); or "hf:OWNER/NAME[/PATH]", a Hub dataset's Parquet files.
    source: str = "python-stdlib"
    text_field: str = "text"  # the JSON field or Parquet/Arrow column holding the text
    val_fraction: float = 0.02  # share of documents (files) held out for validation
    max_bytes: int = 0  # 0: all of it; else a deterministic selection of about this many bytes
    cache_dir: str = ""  # "": $XDG_CACHE_HOME/lmcockpit
    workers: int = 0  # tokenizer processes preparing the cache; 0: one per core, up to about 1.5 GB in all
    shard_bytes: int = 16_000_000  # text per shard of the cache: the unit of parallel work and of resume
    # A mixture instead of one source: [[data.sources]] tables, each drawn by its weight (in place of
    # data.source and data.text_field, which then stay unset).
    sources: list[SourcePart] = field(default_factory=list)


@dataclass
class TokenizerConfig:
    # "bpe": a byte-level BPE trained on the source; a local folder holding tokenizer.json; or
    # "hf:OWNER/NAME", a model repo on the Hub whose tokenizer files are fetched (hf:openai-community/gpt2).
    kind: str = "bpe"
    # The BPE's size; with a pretrained tokenizer, the model's embedding rows: its vocabulary or more
    # (GPT-2's 50,257 padded to 50,304, a multiple of 128).
    vocab_size: int = 8192
    train_bytes: int = 8_000_000  # how much training text the BPE learns merges from


@dataclass
class TrainingConfig:
    max_steps: int = 400
    micro_batch_size: int = 16
    grad_accum_steps: int = 1
    seq_len: int = 256
    seed: int = 1337
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    compile: bool = True
    # "default" suits every card; the autotuning modes compile for minutes to win a few per cent, and
    # "reduce-overhead" / "max-autotune" add CUDA graphs (fewer kernel launches: small models gain most).
    compile_mode: Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"] = "default"
    # The largest micro-batch that fits (estimated, then confirmed by a trial step), with
    # grad_accum_steps raised so that micro_batch_size × grad_accum_steps stays the same.
    auto_micro_batch: bool = False
    # Recompute each block's activations in backward: a fraction of the memory for ~30% more compute.
    activation_checkpointing: bool = False
    grad_clip: float = 1.0  # 0: no clipping
    log_every: int = 10
    on_nan: Literal["stop", "skip"] = "stop"
    max_nan_skips: int = 10
    # A loss spike: a step's loss that many standard deviations above the mean of the last
    # spike_window steps (llm.c's test), judged once 10 are seen (against their median until the
    # window fills: train.spikes). "warn" says so; "skip" drops that update; "rollback" goes back
    # to the last checkpoint and steps past the batches since, with the learning rate times
    # spike_lr_factor for spike_lr_steps steps (each further rollback in that stretch cuts it
    # again), at most max_rollbacks times; "stop" ends the run. A run that stops on a spike keeps
    # the last checkpoint before it as its latest: the weights that spiked are not saved.
    on_spike: Literal["warn", "skip", "rollback", "stop"] = "warn"
    spike_window: int = 100
    spike_zscore: float = 6.0  # on the loss; 0: not watched
    spike_grad_zscore: float = 0.0  # on the gradient norm, the same way; 0: not watched
    spike_lr_factor: float = 0.5  # a rollback retrying at the rate that spiked meets the spike again
    spike_lr_steps: int = 100
    max_rollbacks: int = 3
    # The validation loss aimed at: its time of arrival fitted from the evaluations so far; 0: none.
    target_val_loss: float = 0.0
    # Or a task's accuracy aimed at instead: a task of eval.tasks, by the name its scores have.
    target_task: str = ""
    target_accuracy: float = 0.0
    stop_at_target: bool = False  # end the run with a checkpoint once an evaluation reaches the target


@dataclass
class OptimizerConfig:
    # "muon": Muon for the 2-D matrices inside the blocks, AdamW for the rest; "adamw": AdamW for
    # every parameter (lr, betas, weight_decay below), the baseline that shows what Muon adds.
    kind: Literal["muon", "adamw"] = "muon"
    lr: float = 3e-3  # AdamW: embedding (tied head) and norms; with kind "adamw", everything
    muon_lr: float = 0.02  # Muon: the 2-D matrices inside the blocks
    muon_momentum: float = 0.95
    weight_decay: float = 0.0  # Muon's matrices; with kind "adamw", every 2-D parameter
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    schedule: Literal["cosine", "wsd"] = "cosine"
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # the final learning rate as a share of the peak
    decay_fraction: float = 0.2  # wsd: the share of steps spent decaying at the end


@dataclass
class CheckpointConfig:
    every: int = 0  # 0: only at the end
    keep: int = 3


@dataclass
class EvalConfig:
    every: int = 100  # 0: only at the end
    batches: int = 8  # micro-batches of held-out text per evaluation
    # Downstream tasks scored while training (core/tasks): "python-functions", or a task file's path.
    tasks: list[str] = field(default_factory=list)
    tasks_every: int = 0  # steps between task scorings; 0: at every evaluation (eval.every)
    max_per_task: int = 0  # items scored of each task; 0: all of them
    # Reference models' scores the cockpit draws beside the run's: {task: {model: accuracy}}.
    references: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class SampleConfig:
    every: int = 0  # 0: never during training
    prompts: list[str] = field(default_factory=lambda: ["def fibonacci("])
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int = 50  # 0: off
    top_p: float = 1.0  # nucleus sampling; 1: off


@dataclass
class HardwareConfig:
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    gpu_class: str = "cpu"  # the card this preset was sized for
    vram_gb: float = 0.0  # its memory, for the fit verdict
    cost_per_hour: float = 0.0  # what the machine costs an hour, for the time to target in money; 0: not said


@dataclass
class DistributedConfig:
    # "ddp": every process holds the whole model; "fsdp": FSDP2 shards weights, gradients and
    # optimizer state across processes, for models that do not fit one card.
    strategy: Literal["ddp", "fsdp"] = "ddp"
    nproc: int = 1  # training processes on each machine (one per GPU); more than 1 starts torchrun
    nnodes: int = 1  # machines; the rendezvous flags (--rdzv-endpoint, --node-rank) say how they meet


@dataclass
class LoggingConfig:
    """Where else the metrics go, besides metrics.jsonl: what a team already watches."""
    tensorboard: bool = False  # event files in the run folder's tensorboard/ (needs lmcockpit[tensorboard])
    wandb: str = ""  # a Weights & Biases project to log to; "": none (needs lmcockpit[wandb])


@dataclass
class NotifyConfig:
    """Where word of a run's events goes (finished, failed, nan, spike, rollback, stalled, target),
    sent by the process that owns the engine, never in training's way."""
    terminal: bool = True  # every attached cockpit: the terminal's notification escape and the bell
    webhook: str = ""  # a URL that gets each event as a JSON POST; "env:NAME" reads it from the environment
    ntfy: str = ""  # an ntfy topic URL (https://ntfy.sh/TOPIC or a server of your own); env:NAME too
    apprise: list[str] = field(default_factory=list)  # Apprise URLs (Slack, Discord, e-mail...): lmcockpit[notify]
    stall_after: float = 600.0  # seconds without a step (and many times the run's step time) before "stalled"

    def holds_urls(self) -> bool:
        """Whether a target is written as its URL (token and all) rather than `env:NAME`: the
        files that keep the config are then the user's alone to read (0600)."""
        return any(url and not url.startswith("env:") for url in (self.webhook, self.ntfy, *self.apprise))


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

    # Derived values the rest of the code reads, so the 0-means-default rules live in one place.
    @property
    def head_dim(self) -> int:
        return self.model.head_dim or self.model.d_model // self.model.n_head

    @property
    def mlp_hidden(self) -> int:
        if self.model.mlp_hidden:
            return self.model.mlp_hidden
        return max(64, round(8 * self.model.d_model / 3 / 64) * 64)

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len or self.training.seq_len

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
        raise ConfigError(f"{spec}: is a folder, expected a preset TOML file")
    hint = _closest(name, shipped)
    raise ConfigError(
        f"preset {shown(spec)} not found: no such file, and no shipped preset of that name"
        f" (shipped: {', '.join(sorted(shipped))}){hint}"
    )


def read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text, expected a TOML file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # tomllib's message already carries "(at line L, column C)".
        raise ConfigError(f"{path}: TOML syntax error: {e}") from None
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{path}: {_beyond_parsing(e, text)}") from None


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
        raise ConfigError(f"--set {shown(item)}: expected SECTION.KEY=VALUE, e.g. --set training.max_steps=200")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        # A bare word is the common case for strings (`--set data.source=./corpus`).
        if raw.strip() and not any(c in raw for c in "\"'[]{}=\n"):
            value = raw.strip()
        else:
            raise ConfigError(
                f"--set {shown(item)}: {shown(raw.strip())} is not a TOML value"
                " (strings in quotes, numbers, true/false, [lists])"
            ) from None
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"--set {key} = {shown(raw.strip())}: {_beyond_parsing(e)}") from None
    return parts[0], parts[1], value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in overrides:
        section, key, value = parse_override(item)
        if section not in SECTIONS:  # here, where the --set item is known, so it is named and not the file
            raise ConfigError(f"--set {shown(item)}: unknown section [{section}]"
                              f"{_closest(section, SECTIONS) or ' (sections: ' + ', '.join(SECTIONS) + ')'}")
        target = out.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"--set {shown(item)}: {section!r} is not a section")
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
            raise ConfigError(f"{source}: unknown section [{name}]{_closest(name, SECTIONS)}")
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {name} must be a [{name}] section, got a {_toml_type(value)}")
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
            raise ConfigError(f"{where}: unknown key {name}.{key}{_closest(key, known, prefix=name + '.')}")
        kwargs[key] = _check_type(f"{name}.{key}", value, hints[key], where)
    return cls(**kwargs)


def _build_table(key: str, cls: type, values: dict[str, Any], source: str):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for name in values:
        if name not in known:
            raise ConfigError(f"{source}: unknown key {key}.{name}{_closest(name, known, prefix=key + '.')}")
    return cls(**{name: _check_type(f"{key}.{name}", v, hints[name], source) for name, v in values.items()})


def _check_type(key: str, value: Any, hint: Any, source: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            allowed = " | ".join(repr(c) for c in choices)
            raise ConfigError(f"{source}: {key} = {shown(value)} is not one of {allowed}")
        return value
    if origin is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
        (item,) = typing.get_args(hint)
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(f"{source}: {key} must be a list of tables ([[{key}]] entries), got {shown(value)}")
        return [_build_table(f"{key}[{i}]", item, v, source) for i, v in enumerate(value)]
    if origin is dict:
        _, inner = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a table, got {_toml_type(value)} {shown(value)}")
        return {name: _check_type(f"{key}.{name}", v, inner, source) for name, v in value.items()}
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            raise ConfigError(f"{source}: {key} must be a list of {item.__name__}, got {shown(value)}")
        return list(value)
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }[hint](value)
    if not ok:
        raise ConfigError(f"{source}: {key} must be {_article(hint)}, got {_toml_type(value)} {shown(value)}")
    # Counts, sizes and seeds end up in int64 tensors and float arithmetic (the token budget), where
    # a larger integer overflows far from the key that held it.
    if hint is int and not INT64_MIN <= value <= INT64_MAX:
        raise ConfigError(f"{source}: {key} = {shown(value)} is out of range, expected {INT_RANGE}")
    if hint is float and isinstance(value, int) and not abs(value) <= sys.float_info.max:
        raise ConfigError(f"{source}: {key} = {shown(value)} is beyond any float, expected a finite number")
    return float(value) if hint is float else value


WANDB_FORBIDDEN = ("/", "\\", "#", "?", "%", ":")  # wandb.init refuses these: said here, before a run
HUB_TOKENIZER = re.compile(r"hf:([A-Za-z0-9][\w.-]*/[\w.-]+)")  # tokenizer.kind naming a Hub model repo

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
    """Ranges and consistency between keys; each message names the key and what was expected."""
    def need(cond: bool, msg: str) -> None:
        if not cond:  # blame --set when a key the message names came from there
            named = set(re.findall(r"\b[a-z_]+\.[a-z_][a-z0-9_]*\b", msg))  # optimizer.beta1 too
            raise ConfigError(f"{'--set' if named & set(from_set) else source}: {msg}")

    m, t, o = cfg.model, cfg.training, cfg.optimizer
    # TOML reads inf and nan as floats, and every range check below lets one of them through.
    for key, value in _float_values(cfg):
        need(math.isfinite(value), f"{key} = {value} must be a finite number")
    for key, value in [
        ("model.n_layer", m.n_layer), ("model.d_model", m.d_model), ("model.n_head", m.n_head),
        ("model.n_kv_head", m.n_kv_head),
        ("training.max_steps", t.max_steps), ("training.micro_batch_size", t.micro_batch_size),
        ("training.grad_accum_steps", t.grad_accum_steps), ("training.seq_len", t.seq_len),
        ("training.log_every", t.log_every), ("tokenizer.vocab_size", cfg.tokenizer.vocab_size),
        ("checkpoint.keep", cfg.checkpoint.keep), ("eval.batches", cfg.eval.batches),
        ("sample.max_new_tokens", cfg.sample.max_new_tokens), ("distributed.nproc", cfg.distributed.nproc),
        ("distributed.nnodes", cfg.distributed.nnodes), ("data.shard_bytes", cfg.data.shard_bytes),
    ]:
        need(value > 0, f"{key} = {value} must be a positive integer")
    for key, value in [("model.head_dim", m.head_dim), ("model.mlp_hidden", m.mlp_hidden),
                       ("model.max_seq_len", m.max_seq_len),
                       ("checkpoint.every", cfg.checkpoint.every), ("eval.every", cfg.eval.every),
                       ("eval.tasks_every", cfg.eval.tasks_every), ("eval.max_per_task", cfg.eval.max_per_task),
                       ("sample.every", cfg.sample.every), ("data.max_bytes", cfg.data.max_bytes),
                       ("data.workers", cfg.data.workers),
                       ("optimizer.warmup_steps", o.warmup_steps), ("training.seed", t.seed),
                       ("training.max_nan_skips", t.max_nan_skips), ("sample.top_k", cfg.sample.top_k),
                       ("training.spike_zscore", t.spike_zscore), ("training.spike_grad_zscore", t.spike_grad_zscore),
                       ("training.spike_lr_steps", t.spike_lr_steps), ("training.max_rollbacks", t.max_rollbacks),
                       ("training.target_val_loss", t.target_val_loss), ("notify.stall_after", cfg.notify.stall_after),
                       ("hardware.cost_per_hour", cfg.hardware.cost_per_hour),
                       ("tokenizer.train_bytes", cfg.tokenizer.train_bytes)]:
        need(value >= 0, f"{key} = {value} must be 0 or more")
    need(m.n_head % m.n_kv_head == 0,
         f"model.n_kv_head = {m.n_kv_head} must divide model.n_head = {m.n_head} (grouped-query attention)")
    need(m.head_dim > 0 or m.d_model % m.n_head == 0,
         f"model.n_head = {m.n_head} must divide model.d_model = {m.d_model} (or set model.head_dim)")
    need(cfg.head_dim % 2 == 0, f"the head dimension ({cfg.head_dim}) must be even for rotary embeddings")
    need(t.seq_len <= cfg.max_seq_len,
         f"training.seq_len = {t.seq_len} is above the model's context, model.max_seq_len = {m.max_seq_len}")
    kind = cfg.tokenizer.kind
    need(not kind.startswith("hf:") or HUB_TOKENIZER.fullmatch(kind) is not None,
         f"tokenizer.kind = {shown(kind)}: expected hf:OWNER/NAME, a model repo on the Hub "
         "(e.g. hf:openai-community/gpt2)")
    need(cfg.tokenizer.vocab_size >= 260 or cfg.tokenizer.kind != "bpe",
         f"tokenizer.vocab_size = {cfg.tokenizer.vocab_size} must be at least 260 (256 bytes + specials)")
    need(0 < cfg.data.val_fraction < 1, f"data.val_fraction = {cfg.data.val_fraction} must be between 0 and 1")
    d, default = cfg.data, DataConfig()
    need(not d.sources or (d.source, d.text_field) == (default.source, default.text_field),
         "data.source and data.text_field name one source; with [[data.sources]] each part names its own")
    for i, part in enumerate(d.sources):
        need(bool(part.source), f"data.sources[{i}].source is missing: each part names its source")
        need(math.isfinite(part.weight) and part.weight > 0,
             f"data.sources[{i}].weight = {part.weight} must be a positive number")
    for key, value in [("optimizer.lr", o.lr), ("optimizer.muon_lr", o.muon_lr),
                       # AdamW divides by sqrt(v) + eps, and v is 0 for a parameter no gradient reached
                       ("optimizer.eps", o.eps),
                       ("model.init_std", m.init_std),
                       # RMSNorm divides by sqrt(mean(x²) + eps): at 0 or below a zero row is NaN
                       ("model.norm_eps", m.norm_eps),
                       ("model.rope_theta", m.rope_theta)]:
        need(value > 0, f"{key} = {value} must be positive")
    for key, value in [("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2),
                       ("optimizer.muon_momentum", o.muon_momentum)]:
        need(0 <= value < 1, f"{key} = {value} must be in [0, 1)")
    need(0 <= o.min_lr_ratio <= 1, f"optimizer.min_lr_ratio = {o.min_lr_ratio} must be in [0, 1]")
    need(0 <= o.decay_fraction <= 1, f"optimizer.decay_fraction = {o.decay_fraction} must be in [0, 1]")
    need(o.weight_decay >= 0, f"optimizer.weight_decay = {o.weight_decay} must be 0 or more")
    need(t.grad_clip >= 0, f"training.grad_clip = {t.grad_clip} must be 0 or more")
    need(t.spike_window >= 2, f"training.spike_window = {t.spike_window} must be 2 steps or more")
    need(not (t.target_task and t.target_val_loss),
         "training.target_val_loss and training.target_task: one target at a time (set the other to its default)")
    need(not t.target_task or 0 < t.target_accuracy <= 1,
         f"training.target_accuracy = {t.target_accuracy} must be in (0, 1] with training.target_task")
    need(t.target_accuracy == 0 or bool(t.target_task),
         f"training.target_accuracy = {t.target_accuracy} needs training.target_task, the task it is of")
    need(0 < t.spike_lr_factor <= 1, f"training.spike_lr_factor = {t.spike_lr_factor} must be in (0, 1]")
    need(t.compile or t.compile_mode == "default",
         f"training.compile_mode = {t.compile_mode!r} needs training.compile = true")
    need(cfg.world == 1 or t.compile_mode not in CUDA_GRAPH_MODES, cuda_graphs_need_one_process(
        t.compile_mode, f"distributed.nproc = {cfg.distributed.nproc}, nnodes = {cfg.distributed.nnodes}"))
    need(cfg.hardware.vram_gb >= 0, f"hardware.vram_gb = {cfg.hardware.vram_gb} must be 0 or more (GB)")
    need(cfg.sample.temperature >= 0, f"sample.temperature = {cfg.sample.temperature} must be 0 or more")
    need(0 < cfg.sample.top_p <= 1, f"sample.top_p = {cfg.sample.top_p} must be in (0, 1]")
    need(not t.auto_micro_batch or cfg.world == 1,
         f"training.auto_micro_batch = true needs a single process (distributed.nproc = {cfg.distributed.nproc}, "
         f"nnodes = {cfg.distributed.nnodes}): every rank must use the same micro-batch; set "
         "training.micro_batch_size (lmcockpit presets shows what fits)")
    project = cfg.logging.wandb
    need(len(project) <= 128 and not any(c in project for c in WANDB_FORBIDDEN),
         f"logging.wandb = {shown(project)} must be a W&B project name: at most 128 characters, none of "
         f"{' '.join(WANDB_FORBIDDEN)}")
    dev = cfg.hardware.device
    need(dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit()),
         f"hardware.device = {shown(dev)} must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\"")
    # Each process takes the GPU of its local rank: one named GPU cannot serve several.
    need(cfg.distributed.nproc == 1 or not dev.startswith("cuda:"),
         f"hardware.device = {shown(dev)} names one GPU, but distributed.nproc = {cfg.distributed.nproc} "
         "processes each take their own (process i uses GPU i); use \"auto\" or \"cuda\", and "
         "CUDA_VISIBLE_DEVICES to choose GPUs")
    # [notify]: a URL nothing can post to would otherwise show itself only when the run's first
    # event is lost, hours in. env:NAME is checked for its form only: the variable is read by the
    # process that sends (core/process/notify.py), whose environment this may not be.
    from urllib.parse import urlsplit

    def env_name(value: str) -> bool:
        return re.fullmatch(r"env:[A-Za-z_][A-Za-z0-9_]*", value) is not None

    def http_url(value: str) -> bool:
        try:
            parts = urlsplit(value)
            parts.port  # a port beyond 65535, or not a number, raises here rather than at send time
        except ValueError:
            return False
        # urllib refuses spaces and control characters only when it sends
        return (parts.scheme in ("http", "https") and bool(parts.hostname)
                and not any(c.isspace() or not c.isprintable() for c in value))

    n = cfg.notify
    for key, value in (("notify.webhook", n.webhook), ("notify.ntfy", n.ntfy)):
        need(value == "" or env_name(value) or http_url(value),
             f"{key} = {shown(value)} must be an http(s) URL or env:NAME")
    for i, value in enumerate(n.apprise):
        need(env_name(value) or bool(re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", value)),
             f"notify.apprise[{i}] = {shown(value)} must be an Apprise URL (SCHEME://...) or env:NAME")


def _float_values(cfg: Config):
    """(key, value) of every float in the config, the mixture's parts' included."""
    def of(prefix: str, obj):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, float):
                yield f"{prefix}.{f.name}", value
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if dataclasses.is_dataclass(item):
                        yield from of(f"{prefix}.{f.name}[{i}]", item)

    for section in dataclasses.fields(cfg):
        yield from of(section.name, getattr(cfg, section.name))


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
