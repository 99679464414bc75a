"""Export a checkpoint as a Hugging Face `Qwen3ForCausalLM` folder that `transformers` loads offline.

Our model is Qwen3's math with Qwen3's parameter names (core/model/gpt.py), so the export is a renaming
(`model.` in front of every name) plus a config.json that says the same thing in Qwen3's words:

    lmcockpit            Qwen3Config
    d_model              hidden_size
    mlp_hidden           intermediate_size          (SwiGLU: hidden_act "silu"; ReLU²: "relu", below)
    n_layer              num_hidden_layers
    n_head / n_kv_head   num_attention_heads / num_key_value_heads
    head_dim             head_dim                   (explicit: Qwen3 does not derive it)
    max_seq_len          max_position_embeddings
    rope_theta           rope_parameters = {rope_type: default, rope_theta}
    norm_eps             rms_norm_eps               (the q/k norms share it, in both)
    tie_embeddings       tie_word_embeddings        (untied: `lm_head.weight` written beside `model.`)
    no biases            attention_bias = false
    window, short_window layer_types, sliding_window  (one window size: Qwen3 has one for all its
                                                       sliding layers, the others full attention)

The speedrun's options (docs/training.md) are exported where Qwen3 says the same thing: an untied
head, zero-initialised projections (only weights), sliding windows of one size (a window on every
layer, or full long layers and short windowed ones), and the ReLU² MLP: Qwen3's MLP is
down(act(gate(x)) · up(x)), and relu(u) · u = relu(u)² exactly (both 0 where u ≤ 0), so with
hidden_act "relu" and gate_proj a copy of up_proj it computes down(relu(up(x))²), at the cost of
one more matrix per layer in the file. The rest change the math Qwen3 runs: a logit soft-cap, value
embeddings, U-net skips, and long and short windows of two sizes; each is refused with one line
naming the option, before anything is read or written.

What Qwen3 cannot say is refused before anything is written, with the reason: a rotary base or
norm epsilon that is not a finite positive number (our config does not check them; Qwen3's rotary
needs a positive base), and a checkpoint whose tensors do not match the model its config
describes (missing, unexpected or mis-shaped tensors, non-float weights) or whose tokenizer has
ids beyond the embedding. Every refusal is a `ConfigError` (exit 2).

A chat model (chat_model.is_chat_model: fine-tuned on conversations) is exported ready to chat:
tokenizer_config.json gains the chat template (chat_template.JINJA, for apply_chat_template), and
generation_config.json ends generation at <|assistant_end|> as well as at end-of-text, so
`generate` stops where `lmcockpit chat` does. The tokenizer's eos_token stays end-of-text: the
template opens every conversation with it.

The folder is written under a temporary name beside OUT_DIR and renamed at the end, so an
interrupted export never leaves a half folder that `from_pretrained` would half load.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import Config, ConfigError
from ..run.checkpoint_folder import WEIGHTS, check_checkpoint, checkpoint_config, find_checkpoint, tokenizer_file
from ..run.safe_files import current_umask

PREFIX = "model."


@dataclass(frozen=True)
class Exported:
    out: Path
    checkpoint: Path
    step: int
    n_params: int


def expected_tensors(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor the model of `cfg` holds (core/model/gpt.py's state dict)."""
    m = cfg.model
    V, d, D, F = cfg.tokenizer.vocab_size, m.d_model, cfg.head_dim, cfg.mlp_hidden
    H, KV = m.n_head, m.n_kv_head
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (V, d), "norm.weight": (d,)}
    if not m.tie_embeddings:
        shapes["lm_head.weight"] = (V, d)
    for i in range(m.n_layer):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (H * D, d),
            p + "self_attn.k_proj.weight": (KV * D, d),
            p + "self_attn.v_proj.weight": (KV * D, d),
            p + "self_attn.o_proj.weight": (d, H * D),
            p + "self_attn.q_norm.weight": (D,),
            p + "self_attn.k_norm.weight": (D,),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.up_proj.weight": (F, d),
            p + "mlp.down_proj.weight": (d, F),
        })
        if m.mlp != "relu2":
            shapes[p + "mlp.gate_proj.weight"] = (F, d)
    return shapes


def inexpressible(cfg: Config) -> list[tuple[str, str]]:
    """Every option of the model that Qwen3ForCausalLM has no equivalent of, as ("model.KEY =
    VALUE", the --set that trains without it): all at once, so one retraining is enough."""
    m = cfg.model
    default = type(m)()
    found = [(f"model.{key} = {json.dumps(getattr(m, key))}", f"model.{key}={json.dumps(getattr(default, key))}")
             for key in ("logit_softcap", "value_embeds", "unet_skips") if getattr(m, key) != getattr(default, key)]
    if len(set(cfg.layer_windows) - {0}) > 1:  # one size in Qwen3
        found.append((f"model.window = {m.window} with model.short_window = {m.short_window}", "model.short_window=0"))
    return found


def qwen3_tensors(tensors: dict, cfg: Config) -> dict:
    """The export's tensors under Qwen3's names; a ReLU² MLP's up_proj also as its gate_proj."""
    out = {exported_name(k): t.contiguous() for k, t in tensors.items()}
    if cfg.model.mlp == "relu2":
        for i in range(cfg.model.n_layer):
            out[f"{PREFIX}layers.{i}.mlp.gate_proj.weight"] = out[f"{PREFIX}layers.{i}.mlp.up_proj.weight"].clone()
    return out


def exported_name(name: str) -> str:
    """A tensor's name in the export: Qwen3's model body under `model.`, its untied head beside it."""
    return name if name == "lm_head.weight" else PREFIX + name


def qwen3_config(cfg: Config, eos: int | None, dtype: str) -> dict:
    m = cfg.model
    windows = cfg.layer_windows
    window = max(windows)  # the one size `inexpressible` lets through, or 0: none
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": cfg.tokenizer.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": m.n_layer,
        "num_attention_heads": m.n_head,
        "num_key_value_heads": m.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "relu" if m.mlp == "relu2" else "silu",  # ReLU² as relu(gate) · up, gate = up
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": m.init_std,
        "rms_norm_eps": float(m.norm_eps),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rope_theta)},
        "rope_theta": float(m.rope_theta),  # where transformers 4.x reads it
        "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": bool(window),
        "sliding_window": window or None,
        "max_window_layers": m.n_layer,
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windows],
        "use_cache": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "dtype": dtype,
        "torch_dtype": dtype,  # the name before transformers 5
    }


def _read_weights(ckpt: Path, cfg: Config) -> dict:
    """The checkpoint's tensors, checked against the model its config describes."""
    import torch
    from safetensors.torch import load_file

    path = ckpt / WEIGHTS
    try:
        tensors = load_file(str(path), device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise ConfigError(f"{path}: unreadable, the checkpoint is damaged ({str(e).splitlines()[0]})") from None
    expected = expected_tensors(cfg)
    problems = []
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    if missing:
        problems.append(f"missing {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected {_few(unexpected)}")
    shaped = [f"{k} is {tuple(t.shape)}, expected {expected[k]}" for k, t in tensors.items()
              if k in expected and tuple(t.shape) != expected[k]]
    if shaped:
        problems.append(f"mis-shaped: {_few(shaped)}")
    not_float = [f"{k} ({t.dtype})" for k, t in tensors.items() if not t.is_floating_point()]
    if not_float:
        problems.append(f"not floating point: {_few(not_float)}")
    if problems:
        raise ConfigError(f"{path}: its tensors do not match the model its config describes, so it cannot be "
                          f"exported as a Qwen3ForCausalLM: {'; '.join(problems)}")
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:  # one dtype in config.json: widen a mixture to float32
        tensors = {k: t.to(torch.float32) for k, t in tensors.items()}
    return tensors


def _few(items: list[str], n: int = 4) -> str:
    shown = ", ".join(items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


def _tokenizer(ckpt: Path, cfg: Config):
    from tokenizers import Tokenizer

    from ..data.tokenizer import eos_id

    path = tokenizer_file(ckpt, cfg)
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions for bad files
        raise ConfigError(f"{path}: unreadable tokenizer ({str(e).splitlines()[0]})") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= cfg.tokenizer.vocab_size:
        raise ConfigError(f"{path}: the tokenizer has {size} tokens (ids up to {top}) but the model embeds only "
                          f"tokenizer.vocab_size = {cfg.tokenizer.vocab_size}; cannot be exported consistently")
    return path, tok, eos_id(tok, path.parent)


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out}: exists and is not a folder; give a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"{out}: exists and is not empty; give a new or empty folder (nothing was overwritten)")
    if not out.parent.is_dir():
        raise ConfigError(f"{out.parent}: no such folder to export into")


def export(spec: str, out_dir: str, log: Callable[[str], None] = lambda s: None) -> Exported:
    """Write RUN_OR_CHECKPOINT `spec` as a Qwen3ForCausalLM folder at `out_dir`; a ConfigError for
    every user mistake and every model that cannot be expressed that way."""
    out = Path(out_dir).expanduser().absolute()
    _check_out(out)
    ckpt = find_checkpoint(spec)
    step = check_checkpoint(ckpt)
    cfg = checkpoint_config(ckpt)
    if refused := inexpressible(cfg):  # the cpu preset's value embeddings and U-net skips, for one
        options, sets = ", ".join(o for o, _ in refused), " ".join(f"--set {s}" for _, s in refused)
        one = len(refused) == 1
        raise ConfigError(f"export: {options} {'has' if one else 'have'} no Qwen3ForCausalLM equivalent; a run "
                          f"trained without {'it' if one else 'them'} ({sets}) exports")
    where = str(ckpt)
    tok_path, tok, eos = _tokenizer(ckpt, cfg)
    tensors = _read_weights(ckpt, cfg)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    log(f"export: step {step} of {ckpt}")

    from safetensors.torch import save_file

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as e:  # /proc/x, a read-only mount, a folder not ours: where the user asked to write
        raise ConfigError(f"{out}: cannot write the export there: {e.strerror}") from None
    try:
        config = qwen3_config(cfg, eos, dtype)
        _validate_with_transformers(config, where)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        chat_end = _chat_end(cfg, tok_path, tok)
        ends = eos if chat_end is None else [chat_end, *([eos] if eos is not None else [])]
        generation = {"bos_token_id": eos, "eos_token_id": ends, "pad_token_id": eos, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        save_file(qwen3_tensors(tensors, cfg), str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "lmcockpit_checkpoint": str(ckpt), "lmcockpit_step": str(step)})
        _write_tokenizer(tok_path, tok, tmp, log)
        if chat_end is not None:
            _add_chat_template(tmp / "tokenizer_config.json")
        umask = current_umask()
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)  # safetensors creates its file private; the folder is for sharing
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o777 & ~umask)
        if out.is_dir():  # an empty folder the user made for it
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n_params = sum(t.numel() for t in tensors.values())
    return Exported(out, ckpt, step, n_params)


def _chat_end(cfg: Config, tok_path: Path, tok) -> int | None:
    """<|assistant_end|>'s id where the checkpoint is a chat model's; None for a base model."""
    from ..data.chat_template import ASSISTANT_END
    from .chat_model import holds_turn_tokens, trained_to_chat

    return tok.token_to_id(ASSISTANT_END) if trained_to_chat(cfg) and holds_turn_tokens(tok_path) else None


def _add_chat_template(config_path: Path) -> None:
    """The chat template written into the export's tokenizer_config.json (a file of the export's
    own: copied or written above, never a link)."""
    from ..data.chat_template import JINJA

    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = JINJA
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _validate_with_transformers(config: dict, where: str) -> None:
    """transformers' own checks of the config (strict dataclass, rope parameters), as a user error."""
    from transformers import Qwen3Config

    try:
        Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")})
    except Exception as e:  # noqa: BLE001 - strict validation raises several error types
        raise ConfigError(f"{where}: cannot be expressed as a Qwen3ForCausalLM: "
                          f"{str(e).splitlines()[0]}") from None


# What a transformers tokenizer folder holds, as save_hf_tokenizer writes it (transformers 4 adds
# special_tokens_map.json): all that is copied. A run folder's tokenizer/ may hold anything else,
# put there by whoever handed the run over; the export is a folder meant to be shared.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _write_tokenizer(tok_path: Path, tok, dest: Path, log: Callable[[str], None]) -> None:
    """The run's TOKENIZER_FILES as they are, each only if it is a regular file: a link in a run
    folder handed over (the tokenizer/ folder itself, or a file in it) could name any file of the
    user's, a token or a key, and is never followed. Each file skipped is said in the log. Where
    tokenizer.json or tokenizer_config.json was not copied (a link; a pretrained tokenizer's folder
    in the Hub's cache is all links), they are written from the tokenizer loaded: a link's target
    reaches the export only as a tokenizer, parsed and written again, never as its bytes."""
    folder = tok_path.parent
    copied = set()
    try:
        at = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        log(f"export: skipped the files of {folder}: a symbolic link, not followed; the tokenizer written "
            "from the one loaded instead")
        at = None
    try:
        for name in sorted(os.listdir(at)) if at is not None else ():
            if name not in TOKENIZER_FILES:
                if name != "config.json":  # a pretrained model's, which the export writes its own of
                    log(f"export: skipped {folder / name}: not a tokenizer file (only {', '.join(TOKENIZER_FILES)} "
                        "are copied)")
            elif _copy_regular(name, at, dest / name):
                copied.add(name)
            else:
                instead = "" if name == "special_tokens_map.json" else "; written from the tokenizer loaded instead"
                log(f"export: skipped {folder / name}: a symbolic link or not a regular file, not followed{instead}")
    finally:
        if at is not None:
            os.close(at)
    if "tokenizer_config.json" not in copied:
        from ..data.tokenizer import eos_token, save_hf_tokenizer

        save_hf_tokenizer(tok, dest, eos_token(tok, folder))
    elif "tokenizer.json" not in copied:
        tok.save(str(dest / "tokenizer.json"))


def _copy_regular(name: str, folder_fd: int, dst: Path) -> bool:
    """The file `name` in the open folder copied to `dst` if it is a regular file, opened without
    following a link (O_NOFOLLOW) and checked on the descriptor it is read from; False, with
    nothing written, if it is not (a FIFO is not waited on: O_NONBLOCK)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return False
        raise
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        with open(dst, "xb") as out:
            shutil.copyfileobj(fh, out)
    return True
