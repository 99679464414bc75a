"""Talking to a trained model outside training: which checkpoint, which sampling settings, the model.

Finding the checkpoint and checking settings import no torch, so the front-end refuses bad input
at once, before any engine starts; `load` imports torch when called (in the chat engine process).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import protocol as P
from .config import Config, ConfigError, config_from_dict, read_toml
from .resume import check_checkpoint, is_run_dir
from .runfolder import CONFIG, TOKENIZER, latest_checkpoint

WEIGHTS = "model.safetensors"
STATE = "state.json"


# ------------------------------------------------------------------------------ the checkpoint
def find_checkpoint(spec: str) -> Path:
    """A run folder (its latest complete checkpoint) or a checkpoint folder; a ConfigError naming
    what is missing otherwise."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{spec}: no such run folder or checkpoint folder")
    if is_run_dir(path):
        ckpt = latest_checkpoint(path)
        if ckpt is None:
            raise ConfigError(f"{spec}: the run has no complete checkpoint yet (it stopped, or is still, before "
                              "its first one)")
    elif (path / STATE).is_file() or (path / WEIGHTS).is_file():
        ckpt = path
    else:
        raise ConfigError(f"{spec}: neither a run folder (config.toml) nor a checkpoint folder ({STATE}, {WEIGHTS})")
    check_checkpoint(ckpt)
    tokenizer_file(ckpt, checkpoint_config(ckpt))
    return ckpt


def checkpoint_config(ckpt: Path) -> Config:
    return config_from_dict(read_toml(ckpt / CONFIG), source=str(ckpt / CONFIG))


def tokenizer_file(ckpt: Path, cfg: Config) -> Path:
    """The run folder's tokenizer (a checkpoint lives in RUN/checkpoints/), else a pretrained one's."""
    candidates = [ckpt.parent.parent / TOKENIZER / "tokenizer.json"]
    if cfg.tokenizer.kind != "bpe":
        candidates.append(Path(cfg.tokenizer.kind).expanduser() / "tokenizer.json")
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(f"{ckpt}: no tokenizer found for it (looked for {', '.join(map(str, candidates))})")


# ------------------------------------------------------------------------------- the settings
@dataclass(frozen=True)
class Setting:
    kind: type
    expected: str  # said to the user when a value is refused
    ok: Callable[[Any], bool]


# The sampling settings a request carries, with their valid ranges: one place for the chat
# command's flags, its REPL and the engines that answer requests.
SAMPLE_SETTINGS: dict[str, Setting] = {
    "max_new_tokens": Setting(int, "a positive integer", lambda v: v > 0),
    "temperature": Setting(float, "a number, 0 or more (0: greedy)", lambda v: math.isfinite(v) and v >= 0),
    "top_k": Setting(int, "an integer, 0 (off) or more", lambda v: v >= 0),
    "top_p": Setting(float, "a number in (0, 1] (1: off)", lambda v: 0 < v <= 1),
    "num_samples": Setting(int, "an integer from 1 to 64", lambda v: 1 <= v <= 64),
    "seed": Setting(int, "an integer, 0 or more", lambda v: 0 <= v < 2**63),
    "greedy": Setting(bool, "on or off", lambda v: True),
}
_BOOLS = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


def parse_setting(key: str, text: str) -> Any:
    """A setting's value from text (a flag, a REPL `set`); a ConfigError saying what is expected."""
    setting = SAMPLE_SETTINGS[key]
    try:
        value = _BOOLS[text.lower()] if setting.kind is bool else setting.kind(text)
    except (KeyError, ValueError):
        value = None
    if value is None or not setting.ok(value):
        raise ConfigError(f"expected {setting.expected}, got {text!r}")
    return value


def check_sample(request: P.Sample) -> None:
    for key, setting in SAMPLE_SETTINGS.items():
        value = getattr(request, key)
        if not (_is_a(setting.kind, value) and setting.ok(value)):
            raise ConfigError(f"{key} = {value!r}: expected {setting.expected}")


def _is_a(kind: type, value: Any) -> bool:
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


# ---------------------------------------------------------------------------------- the model
@dataclass
class LoadedModel:
    model: Any  # gpt.GPT, in eval mode on `device`
    tokenizer: Any  # tokenizers.Tokenizer
    eos_id: int | None
    cfg: Config
    checkpoint: Path
    step: int
    device: Any  # torch.device
    precision: str

    def answer(self, request: P.Sample, emit: Callable[[object], None], log: Callable[[str], None]) -> list[str] | None:
        import torch

        from .device import autocast_dtype
        from .sampling import answer

        amp = autocast_dtype(self.precision)
        autocast = torch.autocast(self.device.type, dtype=amp or torch.float32, enabled=amp is not None)
        return answer(self.model, self.tokenizer, self.eos_id, request, self.step, emit, log, autocast)


def load(ckpt: Path, device: str = "auto") -> LoadedModel:
    """The checkpoint's model and tokenizer on `device`, at the precision its run trained in."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from .device import resolve_device, resolve_precision
    from .gpt import GPT, shape_from_config
    from .tokenizer import eos_id

    step = check_checkpoint(ckpt)
    cfg = checkpoint_config(ckpt)
    tok_path = tokenizer_file(ckpt, cfg)
    tokenizer = Tokenizer.from_file(str(tok_path))
    dev = resolve_device(device)
    try:
        precision = resolve_precision(cfg.training.precision, dev)
    except ConfigError:  # trained in a precision this device lacks (fp16 on a CPU): the device's own choice
        precision = resolve_precision("auto", dev)
    # Built on the CPU and then moved, as the trainer does, so the rotary tables are the same numbers.
    model = GPT(shape_from_config(cfg)).to(dev)
    try:
        model.load_state_dict(load_file(str(ckpt / WEIGHTS), device=str(dev)))
    except Exception as e:  # noqa: BLE001 - safetensors and torch each raise their own
        raise ConfigError(f"{ckpt / WEIGHTS}: does not fit the checkpoint's config or is damaged "
                          f"({str(e).splitlines()[0]})") from None
    return LoadedModel(model.eval(), tokenizer, eos_id(tokenizer, tok_path.parent), cfg, ckpt, step, dev, precision)
