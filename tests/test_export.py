"""`lmcockpit export`: a trained tiny model as a Hugging Face Qwen3ForCausalLM folder, loaded back by
transformers offline, with the same logits, the same greedy continuation and the same tokens."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import cli

# No network for transformers or the hub, in this process and in the ones it starts.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT = "def main(args):\n    return"


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory) -> tuple[Path, Path]:
    run_dir, proc = trained_run
    assert proc.returncode == 0, proc.stderr
    out = tmp_path_factory.mktemp("export") / "hf"
    r = cli("export", str(run_dir), str(out))
    assert r.returncode == 0, r.stderr
    assert "Qwen3ForCausalLM" in r.stdout
    return run_dir, out


@pytest.fixture(scope="module")
def hf(exported):
    _, out = exported
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    return model, tok


@pytest.fixture(scope="module")
def ours(exported):
    from lmcockpit.core.infer.load import load
    from lmcockpit.core.run.checkpoint_folder import find_checkpoint

    return load(find_checkpoint(str(exported[0])), "cpu")


def test_folder_is_a_qwen3_causal_lm(exported):
    run_dir, out = exported
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "a temporary folder was left behind"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["tie_word_embeddings"] is True and config["attention_bias"] is False

    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert all(k.startswith("model.") for k in keys) and "lm_head.weight" not in keys


def test_transformers_loads_it_as_qwen3_with_a_tied_head(hf, ours):
    model, tok = hf
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.eos_token_id == ours.eos_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == ours.eos_id


def test_logits_match_in_fp32(hf, ours):
    model, _ = hf
    V = ours.cfg.tokenizer.vocab_size
    ids = torch.randint(0, V, (2, ours.cfg.max_seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(ids).logits
        mine = ours.model.float()(ids)
    assert theirs.dtype == mine.dtype == torch.float32
    assert theirs.shape == mine.shape
    assert (theirs - mine).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_greedy_continuation_equals_lmcockpit_chat(exported, hf):
    run_dir, _ = exported
    model, tok = hf
    n = 24
    r = cli("chat", str(run_dir), "--greedy", "--prompt", PROMPT, "--max-new-tokens", str(n), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    ids = tok(PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))
    continuation = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert r.stdout == PROMPT + continuation + "\n"


def test_tokenizer_round_trips_identically(hf, ours):
    _, tok = hf
    text = ("import os\n\ndef f(x: int) -> str:\n    \"\"\"Döcstring — ünïcode ✓ 日本\"\"\"\n"
            "\treturn f'{x!r}'  # tabs\ttoo\n<|endoftext|>class A: pass\n")
    mine = ours.tokenizer.encode(text).ids
    theirs = tok(text, add_special_tokens=False).input_ids
    assert theirs == mine
    assert tok.decode(theirs) == ours.tokenizer.decode(mine, skip_special_tokens=False) == text


# ------------------------------------------------------------------------------------- refusals
def _refused(r, *words: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained_run[0], copy)
    return copy


def _latest(run: Path) -> Path:
    from lmcockpit.core.run.folder import latest_checkpoint

    return latest_checkpoint(run)


@pytest.mark.slow
def test_refuses_an_existing_non_empty_folder(trained_run, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _refused(cli("export", str(trained_run[0]), str(out)), "not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.slow
def test_an_empty_folder_is_filled(trained_run, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    r = cli("export", str(trained_run[0] / "checkpoints" / "step_000006"), str(out))
    assert r.returncode == 0, r.stderr
    assert "step 6" in r.stdout and (out / "model.safetensors").is_file()


@pytest.mark.slow
def test_refuses_a_missing_checkpoint(tmp_path):
    _refused(cli("export", str(tmp_path / "nowhere"), str(tmp_path / "out")), "no such run folder")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_refuses_a_damaged_checkpoint(run_copy, tmp_path):
    weights = _latest(run_copy) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    _refused(cli("export", str(run_copy), str(tmp_path / "out")), "damaged")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["run"], "a temporary folder was left behind"


@pytest.mark.slow
def test_refuses_tensors_that_do_not_match_the_config(run_copy, tmp_path):
    ckpt = _latest(run_copy)
    config = ckpt / "config.toml"
    config.write_text(config.read_text().replace("n_layer = 2", "n_layer = 3", 1))
    _refused(cli("export", str(run_copy), str(tmp_path / "out")), "do not match", "missing",
             "layers.2.self_attn.q_proj.weight")

    from safetensors.torch import load_file, save_file

    config.write_text(config.read_text().replace("n_layer = 3", "n_layer = 2", 1))
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["embed_tokens.weight"].clone()  # an untied head Qwen3 would ignore
    save_file(tensors, str(ckpt / "model.safetensors"))
    _refused(cli("export", str(run_copy), str(tmp_path / "out")), "unexpected lm_head.weight")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("key, value, expected", [("rope_theta", "-10000.0", "must be positive"),
                                                  ("norm_eps", "nan", "must be a finite number")])
def test_refuses_a_checkpoint_config_qwen3_cannot_express(run_copy, tmp_path, key, value, expected):
    """A rotary base or an RMSNorm epsilon that is not a finite positive number: the checkpoint's
    config.toml is refused as any config is, naming the file and the key."""
    config = _latest(run_copy) / "config.toml"
    lines = [f"{key} = {value}" if line.startswith(f"{key} = ") else line for line in config.read_text().splitlines()]
    config.write_text("\n".join(lines) + "\n")
    _refused(cli("export", str(run_copy), str(tmp_path / "out")), str(config), f"model.{key} = {value}", expected)


@pytest.mark.slow
def test_usage_errors_exit_2(tmp_path):
    _refused(cli("export", str(tmp_path)), "OUT_DIR")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["/proc/forbidden", "/sys/forbidden"])
def test_a_destination_that_cannot_be_written_is_a_user_error(trained_run, where):
    """An output place that cannot be created is the user's input, named with the OS's reason."""
    r = cli("export", str(trained_run[0]), where)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.splitlines()[-1]  # after the export's own progress line
    assert last.startswith(f"error: {where}: cannot write the export there: "), last
    assert any(reason in last for reason in ("No such file or directory", "Permission denied", "not permitted"))


# ----------------------------------------------------------------------- links in the run folder
SECRET = "hf_s3cr3t-token-that-must-never-leave-this-machine"


def export_leaking_nothing(run: Path, out: Path) -> str:
    """`lmcockpit export RUN OUT`, checked to have put no link and no byte of SECRET into OUT, and
    a tokenizer transformers loads; what it said on stderr."""
    r = cli("export", str(run), str(out))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert not [p for p in out.rglob("*") if p.is_symlink() or SECRET.encode() in p.read_bytes()]
    assert transformers.AutoTokenizer.from_pretrained(out)("def f():").input_ids
    return r.stderr


@pytest.mark.slow
def test_links_in_the_run_s_tokenizer_folder_are_not_followed_into_the_export(run_copy, tmp_path):
    """A run folder handed over may hold links, under any name, to a file of whoever exports it:
    the export is meant to be shared, and carries only the tokenizer's own regular files. A
    tokenizer_config.json that is a link is written from the tokenizer loaded instead."""
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    links = [run_copy / "tokenizer" / name for name in ("hf_token", "special_tokens_map.json", "tokenizer_config.json")]
    for link in links:
        link.unlink(missing_ok=True)
        link.symlink_to(secret)
    said = export_leaking_nothing(run_copy, tmp_path / "out")
    for link in links:
        assert f"export: skipped {link}: " in said, said


@pytest.mark.slow
def test_a_tokenizer_json_that_is_a_link_is_written_from_the_tokenizer_loaded(run_copy, tmp_path):
    """What the link names is read only as a tokenizer (one that is none is refused as unreadable),
    and the export's tokenizer.json is that tokenizer, written again, never the linked file copied:
    the same tokenizer either way, but the rule is one for every file, and the log says so."""
    from tokenizers import Tokenizer

    real = tmp_path / "kept-elsewhere.json"
    tokenizer_json = run_copy / "tokenizer" / "tokenizer.json"
    tokenizer_json.rename(real)
    tokenizer_json.symlink_to(real)
    out = tmp_path / "out"
    r = cli("export", str(run_copy), str(out))
    assert r.returncode == 0, r.stderr
    assert f"export: skipped {tokenizer_json}: a symbolic link" in r.stderr and "written from the tokenizer" in r.stderr
    exported = out / "tokenizer.json"
    assert not exported.is_symlink()
    assert Tokenizer.from_file(str(exported)).get_vocab() == Tokenizer.from_file(str(real)).get_vocab()


@pytest.mark.slow
def test_a_tokenizer_folder_that_is_a_link_is_not_followed_into_the_export(run_copy, tmp_path):
    """The run's tokenizer/ itself a link, to a folder holding a tokenizer and a token beside it:
    nothing is copied through it; the tokenizer is written from the one loaded."""
    elsewhere = tmp_path / "elsewhere"
    (run_copy / "tokenizer").rename(elsewhere)
    (elsewhere / "tokenizer_config.json").write_text(SECRET)  # any file a copy would take by its name
    (run_copy / "tokenizer").symlink_to(elsewhere)
    said = export_leaking_nothing(run_copy, tmp_path / "out")
    assert f"export: skipped the files of {run_copy / 'tokenizer'}: a symbolic link" in said, said


# ------------------------------------------------------------------ the speedrun's model options
def _set_model_keys(ckpt: Path, **keys: str) -> None:
    """The checkpoint's config.toml with `keys` (TOML values) set in its [model] table."""
    config = ckpt / "config.toml"
    lines = [line for line in config.read_text().splitlines() if line.split(" = ")[0] not in keys]
    at = lines.index("[model]") + 1
    config.write_text("\n".join(lines[:at] + [f"{k} = {v}" for k, v in keys.items()] + lines[at:]) + "\n")


def test_an_untied_head_zero_init_and_one_window_size_export_with_the_same_logits(run_copy, tmp_path):
    """A third layer (its weights the second's, perturbed) makes the pattern mixed: model.short_window
    on the middle layer, full attention on the outer two, as Qwen3's layer_types and sliding_window say;
    the untied head is written as lm_head.weight with tie_word_embeddings = false."""
    from safetensors.torch import load_file, save_file

    from lmcockpit.core.infer.export import export
    from lmcockpit.core.infer.load import load

    ckpt = _latest(run_copy)
    tensors = load_file(str(ckpt / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name in [k for k in tensors if k.startswith("layers.1.")]:
        t = tensors[name]
        tensors[name.replace("layers.1.", "layers.2.")] = t + 0.02 * torch.randn(t.shape, generator=g).to(t.dtype)
    tensors["lm_head.weight"] = (0.05 * torch.randn(tensors["embed_tokens.weight"].shape, generator=g)).to(
        tensors["embed_tokens.weight"].dtype)
    save_file(tensors, str(ckpt / "model.safetensors"))
    _set_model_keys(ckpt, n_layer="3", tie_embeddings="false", zero_init_proj="true", short_window="8")
    out = tmp_path / "hf"
    export(str(run_copy), str(out))

    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["sliding_window"] == 8
    assert config["layer_types"] == ["full_attention", "sliding_attention", "full_attention"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    ours = load(ckpt, "cpu")
    assert ours.model.shape.windows == (0, 8, 0) and ours.model.lm_head is not None
    ids = torch.randint(0, ours.cfg.tokenizer.vocab_size, (2, ours.cfg.max_seq_len), generator=g)
    with torch.no_grad():
        theirs, mine = model(ids).logits, ours.model.float()(ids)
    assert (theirs - mine).abs().max().item() <= 1e-4


def test_a_relu2_mlp_exports_as_relu_of_a_gate_that_is_its_up_projection(run_copy, tmp_path):
    """relu(u) · u = relu(u)²: Qwen3's gated MLP with hidden_act "relu" and gate_proj = up_proj
    computes ReLU²; the logits match ours (the trained run's weights, less its gates)."""
    from safetensors.torch import load_file, save_file

    from lmcockpit.core.infer.export import export
    from lmcockpit.core.infer.load import load

    ckpt = _latest(run_copy)
    tensors = {k: v for k, v in load_file(str(ckpt / "model.safetensors")).items() if "gate_proj" not in k}
    save_file(tensors, str(ckpt / "model.safetensors"))
    _set_model_keys(ckpt, mlp='"relu2"', mlp_hidden=str(tensors["layers.0.mlp.up_proj.weight"].shape[0]))
    out = tmp_path / "hf"
    done = export(str(run_copy), str(out))
    assert done.n_params == sum(t.numel() for t in tensors.values())  # the model's own, not the copies

    assert json.loads((out / "config.json").read_text())["hidden_act"] == "relu"
    written = load_file(str(out / "model.safetensors"))
    assert torch.equal(written["model.layers.0.mlp.gate_proj.weight"], written["model.layers.0.mlp.up_proj.weight"])
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load(ckpt, "cpu")
    assert not hasattr(ours.model.layers[0].mlp, "gate_proj")
    ids = torch.randint(0, ours.cfg.tokenizer.vocab_size, (2, ours.cfg.max_seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, mine = model(ids).logits, ours.model.float()(ids)
    assert (theirs - mine).abs().max().item() <= 1e-4


@pytest.mark.parametrize("keys, named, without", [
    ({"logit_softcap": "15.0"}, "model.logit_softcap = 15.0", "model.logit_softcap=0.0"),
    ({"value_embeds": "1"}, "model.value_embeds = 1", "model.value_embeds=0"),
    ({"unet_skips": "true"}, "model.unet_skips = true", "model.unet_skips=false"),
    ({"n_layer": "3", "window": "16", "short_window": "8"}, "model.window = 16 with model.short_window = 8",
     "model.short_window=0"),
])
def test_an_option_qwen3_cannot_express_is_refused_naming_it(run_copy, tmp_path, keys, named, without):
    from lmcockpit.core.config import ConfigError
    from lmcockpit.core.infer.export import export

    _set_model_keys(_latest(run_copy), **keys)
    with pytest.raises(ConfigError) as e:
        export(str(run_copy), str(tmp_path / "out"))
    assert str(e.value) == (f"export: {named} has no Qwen3ForCausalLM equivalent; a run trained without it "
                            f"(--set {without}) exports")
    assert [p.name for p in tmp_path.iterdir()] == ["run"], "something was written"


@pytest.mark.slow
def test_the_refusal_is_one_line_and_exit_2_naming_every_option_at_once(run_copy, tmp_path):
    _set_model_keys(_latest(run_copy), value_embeds="1", unet_skips="true")  # the cpu preset's pair
    r = cli("export", str(run_copy), str(tmp_path / "out"))
    _refused(r, "model.value_embeds = 1, model.unet_skips = true have no Qwen3ForCausalLM equivalent; a run trained "
                "without them (--set model.value_embeds=0 --set model.unet_skips=false) exports")
    assert r.stderr.count("\n") == 1, r.stderr
