"""A trained model outside training: a checkpoint's weights and tokenizer loaded for sampling.

Importing this imports no torch: `load` does when called (in the chat engine process). Finding
and checking the checkpoint (run.checkpoint_folder) and the sampling settings (protocol) come first, in
the front-end, so bad input is refused before any engine starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .. import protocol as P
from ..config import Config, ConfigError
from ..run.checkpoint_folder import WEIGHTS, check_checkpoint, checkpoint_config, tokenizer_file


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

        from ..hardware.device import autocast_dtype
        from ..model.sampling import answer

        amp = autocast_dtype(self.precision)
        autocast = torch.autocast(self.device.type, dtype=amp or torch.float32, enabled=amp is not None)
        return answer(self.model, self.tokenizer, self.eos_id, request, self.step, emit, log, autocast)


def load(ckpt: Path, device: str = "auto") -> LoadedModel:
    """The checkpoint's model and tokenizer on `device`, at the precision its run trained in."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from ..hardware.device import expands_kv, resolve_device, resolve_precision
    from ..model.gpt import GPT, shape_from_config
    from ..data.tokenizer import eos_id

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
    model.expand_kv = expands_kv(cfg, dev, precision)  # a prompt's prefill is the training forward's attention
    try:
        model.load_state_dict(load_file(str(ckpt / WEIGHTS), device=str(dev)))
    except Exception as e:  # noqa: BLE001 - safetensors and torch each raise their own
        raise ConfigError(f"{ckpt / WEIGHTS}: does not fit the checkpoint's config or is damaged "
                          f"({str(e).splitlines()[0]})") from None
    return LoadedModel(model.eval(), tokenizer, eos_id(tokenizer, tok_path.parent), cfg, ckpt, step, dev, precision)
