"""The GPT-2 reference preset (gpt2-fineweb) and `tokenizer.kind = "hf:OWNER/NAME"`, against a Hub
on 127.0.0.1 (fake_hub.py) that serves the very repos the preset names: a FineWeb-shaped dataset
of Parquet shards and a GPT-2-shaped model repo, whose tokenizer is a small byte-level BPE made
here with <|endoftext|> as its last id, as GPT-2's is. The preset runs as shipped but for its
sizes; the real `huggingface_hub` fetches over real HTTP, in a process of its own (it reads
HF_ENDPOINT when imported), through the real `lmcockpit` command."""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from lmcockpit.core.config import ConfigError, load_config
from lmcockpit.core.hardware import memory_estimate

from .fake_hub import FakeHub
from .helpers import cli, hub_env

PRESET = "gpt2-fineweb"
DATASET, SAMPLE = "HuggingFaceFW/fineweb", "sample/10BT"
MODEL = "openai-community/gpt2"
SHARDS = [f"{SAMPLE}/000_0000{i}.parquet" for i in range(2)]
# The preset at the debug preset's sizes (on the CPU, in seconds); its data, tokenizer and
# everything else as shipped. 30 steps: warmup cut to fit them.
SMALL = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=4", "model.max_seq_len=64",
         "training.seq_len=64", "training.micro_batch_size=8", "training.grad_accum_steps=1",
         "training.max_steps=30", "training.compile=false", "training.log_every=5", "optimizer.warmup_steps=3",
         "eval.every=10", "eval.batches=4", "checkpoint.every=0", "checkpoint.keep=1", "sample.every=0",
         "sample.prompts=[]", 'hardware.device="cpu"', "data.val_fraction=0.1", "data.workers=1",
         "tokenizer.vocab_size=384"]
WORDS = ("the of and to in is was for on that with as by at from his her they which this were had have an are "
         "not but be or one their has all city river north village school music people would first two years "
         "after new time world war team game church house film family station season album song").split()


def documents(shard: int, n: int = 60) -> list[str]:
    """Prose-like documents (some with non-ASCII text, one that quotes the end-of-text token as
    text): a little structure for the loss to learn, and the cases decoding must give back."""
    rng = random.Random(shard)
    docs = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(40, 90))]
        docs.append(f"Document {shard}.{i}: " + " ".join(words).capitalize() + ".")
    docs[3] += " Café, naïve, 東京 — “quoted”."
    docs[5] += " A page that quotes <|endoftext|> as text."
    return docs


def make_dataset(root: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i, name in enumerate(SHARDS):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": documents(i), "id": [f"<urn:{i}:{j}>" for j in range(60)]}), root / name)
    (root / "README.md").write_text("# a fake FineWeb\n")
    return root


def make_model_repo(root: Path) -> Path:
    """GPT-2's files by name: the tokenizer's (tokenizer.json, a tokenizer_config.json naming no end
    token, as GPT-2's names none), the slow tokenizer's and the weights, which must not be fetched."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(documents(100, 200), trainer=trainer)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])  # the last id, as GPT-2's 50256
    root.mkdir(parents=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    (root / "vocab.json").write_text(json.dumps(tok.get_vocab()))
    (root / "merges.txt").write_text("#version: 0.2\n")
    (root / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": tok.get_vocab_size()}))
    (root / "model.safetensors").write_bytes(random.Random(0).randbytes(300_000))
    return root


def flags(*overrides: str) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


def run(env: dict[str, str], out: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    return cli("--run", PRESET, "--out", str(out), *flags(*SMALL, f'data.cache_dir="{cache}"', *overrides),
               environ=env, timeout=600)


def prepare(env: dict[str, str], cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    return cli("data", "prepare", PRESET, *flags(*SMALL, f'data.cache_dir="{cache}"', *overrides), environ=env)


def metrics(run_dir: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def the_cache(cache_dir: Path) -> tuple[Path, dict]:
    (meta,) = cache_dir.glob("*/meta.json")
    return meta.parent, json.loads(meta.read_text())


def tokens(cache: Path, meta: dict, split: str) -> np.ndarray:
    return np.concatenate([np.fromfile(cache / "shards" / f"{s['name']}.{split}.bin", dtype=meta["dtype"])
                           for s in meta["shards"]])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One fake Hub for the module, and a first run of the preset that fetched from it."""
    tmp = tmp_path_factory.mktemp("gpt2")
    dataset, model = make_dataset(tmp / "dataset"), make_model_repo(tmp / "model")
    with FakeHub({DATASET: dataset}, models={MODEL: model}) as hub:
        env = hub_env(tmp / "hf", hub.url)
        proc = run(env, tmp / "run", tmp / "tokens")
        yield hub, env, tmp, proc


@pytest.mark.slow
def test_the_preset_trains_with_gpt2s_tokenizer_fetched_by_its_hub_id(trained):
    hub, env, tmp, proc = trained
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Of the model repo, its tokenizer's files and nothing else: not the weights, not the slow tokenizer.
    assert sorted(hub.got(MODEL)) == ["tokenizer.json", "tokenizer_config.json"]
    assert not any("authorization" in r.headers for r in hub.requests)  # no token was given
    snapshot = tmp / "hf/hub/models--openai-community--gpt2/snapshots" / hub.commit(MODEL)
    assert f"data: tokenizer hf:{MODEL} from {snapshot}" in proc.stdout
    steps, evals = metrics(tmp / "run", "step"), metrics(tmp / "run", "eval")
    assert len(steps) == 30 and [e["step"] for e in evals] == [10, 20, 30]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.3, evals
    assert np.mean([s["loss"] for s in steps[-5:]]) < steps[0]["loss"] - 1.0, [s["loss"] for s in steps]


@pytest.mark.slow
def test_the_tokens_are_the_pretrained_tokenizers_one_document_after_another(trained):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hub, env, tmp, proc = trained
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pretrained = Tokenizer.from_file(str(tmp / "model" / "tokenizer.json"))
    eos = pretrained.token_to_id("<|endoftext|>")
    assert eos == pretrained.get_vocab_size() - 1  # GPT-2's place for it: the last id
    cache, meta = the_cache(tmp / "tokens")
    assert meta["eos_id"] == eos and meta["vocab_size"] == 384 and meta["dtype"] == "uint16"
    # Every document of the shards fetched, each once, followed by the end-of-text id; decoded
    # with the Hub's tokenizer, each is its text exactly (the one quoting <|endoftext|> included).
    fetched = [d for path in hub.got(DATASET) for d in documents(SHARDS.index(path))]
    decoded = []
    for split in ("train", "val"):
        ids = tokens(cache, meta, split)
        assert ids[-1] == eos and ids.max() < pretrained.get_vocab_size()
        cuts = np.flatnonzero(ids == eos)
        decoded += [pretrained.decode(ids[a + 1:b].tolist(), skip_special_tokens=False)
                    for a, b in zip([-1, *cuts[:-1]], cuts)]
    assert sorted(decoded) == sorted(fetched) and meta["documents"]["val"] > 0
    # The run's tokenizer folder is the Hub's tokenizer, saved for transformers with its end token.
    saved = AutoTokenizer.from_pretrained(str(tmp / "run" / "tokenizer"))
    assert saved.eos_token == "<|endoftext|>" and saved.eos_token_id == eos
    assert saved.get_vocab() == pretrained.get_vocab(with_added_tokens=True)
    # The model's embedding has tokenizer.vocab_size rows: the tokenizer's, padded.
    from safetensors import safe_open

    (weights,) = (tmp / "run" / "checkpoints").glob("step_*/model.safetensors")
    with safe_open(str(weights), "np") as f:
        assert f.get_slice("embed_tokens.weight").get_shape() == [384, 64]


@pytest.mark.slow
def test_offline_a_second_run_reuses_the_fetched_tokenizer(trained, tmp_path):
    hub, env, tmp, first = trained
    assert first.returncode == 0, first.stdout + first.stderr
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    seen = len(hub.requests)
    again = run(offline, tmp_path / "run", tmp / "tokens")
    assert again.returncode == 0, again.stdout + again.stderr
    cache, _ = the_cache(tmp / "tokens")
    assert f"data: reusing token cache {cache}" in again.stdout  # the same tokenizer: the same key
    # A token cache made afresh, offline, from the Hub cache's tokenizer and data: the same tokens.
    fresh = prepare(offline, tmp_path / "tokens")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    other, meta = the_cache(tmp_path / "tokens")
    assert other.name == cache.name
    for split in ("train", "val"):
        assert np.array_equal(tokens(other, meta, split), tokens(cache, meta, split))
    assert len(hub.requests) == seen  # nothing was asked of the Hub


@pytest.mark.slow
def test_the_presets_command_lists_it_without_the_network(trained):
    hub, env, tmp, first = trained
    seen = len(hub.requests)
    proc = cli("presets", environ=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (row,) = [line for line in proc.stdout.splitlines() if line.split() and line.split()[0] == PRESET]
    assert "H100" in row and "123.6M" in row and "524,288" in row and row.rstrip().endswith("fits")
    assert len(hub.requests) == seen


@pytest.mark.slow
@pytest.mark.parametrize("how", ["offline", "out of reach"])
def test_with_nothing_fetched_it_exits_2_naming_tokenizer_kind(tmp_path, how, closed_port):
    env = hub_env(tmp_path / "hf", closed_port, **({"HF_HUB_OFFLINE": "1"} if how == "offline" else {}))
    proc = run(env, tmp_path / "run", tmp_path / "tokens")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "Retrying" not in proc.stderr
    reason = "HF_HUB_OFFLINE is set" if how == "offline" else "the Hub could not be reached (ConnectError)"
    lines = proc.stderr.splitlines()
    assert lines[0] == (f"error: tokenizer.kind = 'hf:{MODEL}': the tokenizer of {MODEL} is not downloaded yet, "
                        f"and {reason}. Download it on a machine with a network:"), proc.stderr
    assert lines[1].strip() == f"hf download {MODEL} tokenizer.json tokenizer_config.json special_tokens_map.json " \
                               "--local-dir DIR"
    assert "--set tokenizer.kind='\"DIR\"'" in lines[2]
    assert not (tmp_path / "tokens").exists()


@pytest.mark.slow
@pytest.mark.parametrize("repo, message", [
    ("owner/slow-only", "the Hub's model owner/slow-only has no tokenizer.json (it has merges.txt, vocab.json)"),
    ("owner/nmae", "the Hub has no model owner/nmae that this machine may read (a typo in the name?"),
])
def test_a_model_repo_without_a_tokenizer_json_is_said_clearly(tmp_path, repo, message):
    slow = tmp_path / "slow"
    slow.mkdir()
    for name in ("vocab.json", "merges.txt", "config.json"):
        (slow / name).write_text("{}")
    with FakeHub({}, models={"owner/slow-only": slow}) as hub:
        proc = prepare(hub_env(tmp_path / "hf", hub.url), tmp_path / "tokens", f'tokenizer.kind="hf:{repo}"')
        assert hub.got("owner/slow-only") == []  # said before anything is downloaded
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"error: tokenizer.kind = 'hf:{repo}': {message}"), proc.stderr


@pytest.mark.slow
def test_a_vocab_size_below_the_tokenizers_says_what_to_set(trained, tmp_path):
    from tokenizers import Tokenizer

    hub, env, tmp, first = trained
    size = Tokenizer.from_file(str(tmp / "model" / "tokenizer.json")).get_vocab_size()
    assert 256 < size <= 384
    proc = prepare({**env, "HF_HUB_OFFLINE": "1"}, tmp_path / "tokens", "tokenizer.vocab_size=256")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (f"tokenizer.vocab_size = 256 is smaller than the tokenizer's {size} tokens: set it to {size} or more, "
            "e.g. 384") in proc.stderr


def test_the_shipped_preset_is_gpt2_small_on_fineweb_for_an_h100():
    cfg, path = load_config(PRESET)
    m, t = cfg.model, cfg.training
    assert (m.n_layer, m.d_model, m.n_head, m.n_kv_head, cfg.head_dim) == (12, 768, 12, 12, 64)
    assert t.seq_len == cfg.max_seq_len == 1024 and cfg.tokens_per_step == 524_288  # llm.c's batch
    assert 9.5e9 < t.max_steps * cfg.tokens_per_step < 10.5e9  # llm.c's 10B-token budget
    assert cfg.data.source == "hf:HuggingFaceFW/fineweb/sample/10BT" and cfg.tokenizer.kind == f"hf:{MODEL}"
    assert cfg.tokenizer.vocab_size >= 50_257 and cfg.tokenizer.vocab_size % 128 == 0
    assert 120e6 < memory_estimate.param_counts(cfg).total < 128e6  # GPT-2 small's 124M, its embedding tied
    assert cfg.eval.every > 0 and cfg.eval.batches * t.micro_batch_size * t.seq_len >= 10_000_000
    hw = cfg.hardware
    assert (hw.gpu_class, hw.vram_gb, hw.device, t.precision, t.compile) == ("H100", 80, "auto", "auto", True)
    needed = memory_estimate.estimate(cfg, "cuda").total
    assert needed <= 0.9 * hw.vram_gb * memory_estimate.GiB and memory_estimate.judge(cfg, None)[1] == "fits"
    assert "3.28" in Path(path).read_text().split("[model]")[0]  # the header names the target


@pytest.mark.parametrize("kind", ["hf:gpt2", "hf:openai-community/gpt2/extra", "hf:/gpt2"])
def test_a_hub_tokenizer_is_named_owner_slash_name(kind):
    with pytest.raises(ConfigError, match=re.escape(f"tokenizer.kind = {kind!r}: expected hf:OWNER/NAME")):
        load_config(PRESET, [f'tokenizer.kind="{kind}"'])


def test_the_end_token_may_be_named_in_special_tokens_map(tmp_path):
    """Older transformers folders name it there, not in tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, models

    from lmcockpit.core.data.tokenizer import eos_token

    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.add_special_tokens([AddedToken("</doc>", special=True), AddedToken("</s>", special=True)])
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "</doc>"}}))
    assert eos_token(tok, tmp_path) == "</doc>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8}))  # names none
    assert eos_token(tok, tmp_path) == "</doc>"
    (tmp_path / "special_tokens_map.json").unlink()
    assert eos_token(tok, tmp_path) == "</s>"  # then a known name
