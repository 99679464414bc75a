"""modded-nanogpt's .bin token shards (data.format = "tokens", data.val_source) and BOS-aligned rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lmcockpit.core.config import ConfigError, load_config
from lmcockpit.core.data import aligned_rows, batches, token_shards

EOT = 50256


def write_shard(path: Path, tokens, magic: int = token_shards.MAGIC, claimed: int | None = None) -> Path:
    """A shard as modded-nanogpt's data/fineweb.py writes one: 256 int32 of header, uint16 ids."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, token_shards.VERSION, len(tokens) if claimed is None else claimed
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype=np.uint16).tobytes())
    return path


def test_a_shard_s_tokens_are_read_after_its_header_and_cut_at_the_limit(tmp_path):
    a = write_shard(tmp_path / "fineweb_train_000001.bin", range(100))
    b = write_shard(tmp_path / "fineweb_train_000002.bin", range(100, 150))
    assert token_shards.shard_tokens(a) == 100
    stream = token_shards.open_tokens([a, b])
    assert len(stream) == 150 and list(stream[95:105]) == list(range(95, 105))
    first = token_shards.open_tokens([a, b], limit=120)
    assert len(first) == 120 and int(first[119:120][0]) == 119


def test_a_bad_header_or_a_short_file_is_one_error_naming_the_file(tmp_path):
    bad = write_shard(tmp_path / "bad.bin", range(10), magic=1234)
    with pytest.raises(ConfigError, match=r"bad\.bin: not a \.bin token shard: its header starts 1234, 1; "
                                          r"expected the magic number 20240520"):
        token_shards.shard_tokens(bad)
    short = write_shard(tmp_path / "short.bin", range(10), claimed=20)
    with pytest.raises(ConfigError, match=r"short\.bin: 1,044 bytes, but its header says 20 tokens, which take 1,064"):
        token_shards.shard_tokens(short)
    (tmp_path / "tiny.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ConfigError, match="shorter than a .bin token shard's header"):
        token_shards.shard_tokens(tmp_path / "tiny.bin")
    with pytest.raises(ConfigError, match=r"data.val_tokens = 50: data.val_source holds 10 tokens"):
        token_shards.open_tokens([write_shard(tmp_path / "v.bin", range(10))], 50, key="data.val_source")


def test_a_folder_s_training_shards_leave_its_validation_shard_out(tmp_path):
    for name in ("fineweb_val_000000.bin", "fineweb_train_000002.bin", "fineweb_train_000001.bin"):
        write_shard(tmp_path / name, range(4))
    assert [p.name for p in token_shards.local_train_files(tmp_path)] == ["fineweb_train_000001.bin",
                                                                         "fineweb_train_000002.bin"]


def test_the_speedrun_preset_plans_its_shards_by_its_token_budget():
    cfg = load_config("gpt2-speedrun")[0]
    planned = token_shards.planned_fetch(cfg)
    run_tokens = cfg.training.max_steps * cfg.tokens_per_step
    train = [name for name, _ in planned if "train" in name]
    assert len(train) == -(-run_tokens // token_shards.SHARD_TOKENS) and train[0] == "fineweb_train_000001.bin"
    assert planned[-1][0] == "fineweb_val_000000.bin"


def stream_with_documents(lengths: list[int]) -> np.ndarray:
    """Documents of the given lengths, each after an end-of-text token, as the shards hold them."""
    out = []
    for i, n in enumerate(lengths):
        out += [EOT] + [(i * 7 + j) % 1000 for j in range(n)]
    return np.asarray(out, dtype=np.uint16)


def test_aligned_rows_start_at_a_separator_and_are_a_pure_function_of_seed_and_index():
    tokens = aligned_rows.AlignedTokens(stream_with_documents([5, 30, 3, 50, 12, 8, 40, 2, 25]), EOT)
    separators = set(np.flatnonzero(tokens.stream == EOT).tolist())
    seq_len = 16
    seen = set()
    for g in range(50):
        x, y = batches.get_batch(tokens, 7, g, 8, seq_len)
        assert x.shape == y.shape == (8, seq_len) and (x[:, 0] == EOT).all()
        assert (x[:, 1:] == y[:, :-1]).all()
        starts = aligned_rows.aligned_starts(tokens, 7, g, 8, seq_len)
        assert set(starts.tolist()) <= separators and (starts + seq_len + 1 <= len(tokens)).all()
        seen |= set(starts.tolist())
        again = aligned_rows.AlignedTokens(tokens.stream, EOT)  # a resumed process: found afresh, same rows
        assert (batches.get_batch(again, 7, g, 8, seq_len)[0] == x).all()
    # every separator with a whole window after it is drawn, and none without one
    assert seen == {s for s in separators if s + seq_len + 1 <= len(tokens)}


def test_aligned_rows_find_separators_in_every_shard_of_a_stream(tmp_path):
    a = write_shard(tmp_path / "a.bin", stream_with_documents([10, 10]))
    b = write_shard(tmp_path / "b.bin", stream_with_documents([20, 10]))
    tokens = aligned_rows.AlignedTokens(token_shards.open_tokens([a, b]), EOT)
    assert tokens.starts().tolist() == [0, 11, 22, 43]


def test_a_stream_without_a_separator_is_refused_by_name():
    tokens = aligned_rows.AlignedTokens(np.arange(100, dtype=np.uint16), EOT)
    with pytest.raises(ConfigError, match="data.bos_aligned: no document separator"):
        batches.get_batch(tokens, 0, 0, 2, 8)


# The preset at the debug preset's sizes, on shards written here (no network): its data format, its
# validation shard's first tokens, BOS-aligned rows and everything else as shipped.
SMALL = ["model.n_layer=2", "model.value_embeds=1", "model.d_model=64", "model.n_head=4", "model.n_kv_head=4",
         "model.max_seq_len=64",
         "training.seq_len=64", "training.micro_batch_size=8", "training.grad_accum_steps=1",
         "training.max_steps=10", "training.compile=false", "training.log_every=5", "optimizer.warmup_steps=3",
         "eval.every=5", "eval.batches=4", "checkpoint.every=0", "checkpoint.keep=1", 'hardware.device="cpu"',
         "tokenizer.vocab_size=64"]


@pytest.fixture(scope="module")
def speedrun_files(tmp_path_factory):
    """A GPT-2-shaped tokenizer (a word-level one, <|endoftext|> its last id, as GPT-2's 50256) and
    shards of its ids, each document after its <|endoftext|>, as modded-nanogpt's data/fineweb.py
    writes them."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers

    tmp = tmp_path_factory.mktemp("speedrun")
    words = ("the of and to in is was for on that with as by at from his her they which this were had have an "
             "are not but be or one their has all city river north village school music people").split()
    vocab = {w: i for i, w in enumerate(["[UNK]", *words, "<|endoftext|>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model = tmp / "gpt2"
    model.mkdir()
    tok.save(str(model / "tokenizer.json"))
    eot = vocab["<|endoftext|>"]

    def ids(shard: int) -> list[int]:
        rng = random.Random(shard)  # documents that repeat pairs of words: something for the loss to learn
        docs = [" ".join(rng.choice(words[:10]) + " " + words[10 + i % 20] for _ in range(rng.randint(20, 60)))
                for i in range(80)]
        return [t for doc in docs for t in [eot, *tok.encode(doc).ids]]

    (tmp / "data").mkdir()
    for i in (1, 2):
        write_shard(tmp / "data" / f"fineweb_train_{i:06d}.bin", ids(i))
    val = write_shard(tmp / "data" / "fineweb_val_000000.bin", ids(0))
    return tmp, model, val, eot


@pytest.mark.slow
def test_the_preset_trains_on_cpu_on_local_shards_validating_on_the_first_tokens(speedrun_files):
    from .helpers import NO_GPU, as_flags, cli

    tmp, model, val, eot = speedrun_files
    out = tmp / "run"
    proc = cli("--run", "gpt2-speedrun", "--out", str(out), *as_flags([
        *SMALL, f'data.source="{tmp / "data"}"', f'data.val_source="{val}"', "data.val_tokens=4000",
        f'tokenizer.kind="{model}"', f'data.cache_dir="{tmp / "cache"}"']), env=NO_GPU)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    train = sum(token_shards.shard_tokens(p) for p in token_shards.local_train_files(tmp / "data"))
    assert f"data: {train:,} training tokens in 2 shards, 4,000 validation tokens ({val})" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [5, 10] and evals[-1]["val_loss"] < evals[0]["val_loss"], evals
    assert (out / "tokenizer" / "tokenizer.json").is_file()  # the run folder's own, for chat and export


def test_the_presets_command_and_data_info_say_its_data_budget_target_and_times():
    from lmcockpit.tui.commands.data import shards_lines
    from lmcockpit.tui.commands.presets import target_lines

    (line,) = [x for x in target_lines(["cpu", "gpt2-speedrun"])]
    assert line.startswith("gpt2-speedrun: hf:kjj0/fineweb10B-gpt2 (.bin token shards, validated on 10,485,760 "
                           "tokens of hf:kjj0/fineweb10B-gpt2/fineweb_val_000000.bin), 0.996B tokens, target val "
                           "loss 3.28 (stops there); its steps take h100 ~")
    assert all(card in line for card in ("h200 ~", "4090 ~", "3090 ~"))
    lines = shards_lines(load_config("gpt2-speedrun")[0], "gpt2-speedrun")
    assert lines[-1].startswith("a run fetches, where they are not here, 11 shards of kjj0/fineweb10B-gpt2, 2.20 GB: "
                                "fineweb_train_000001.bin,")


@pytest.mark.slow
def test_a_hub_source_fetches_the_training_shards_the_budget_needs_and_the_validation_shard(speedrun_files):
    """Against a Hub on 127.0.0.1 serving the preset's very repos: 10 steps of 512 tokens need two
    of three 3,000-token shards; offline afterwards, `data info` finds them in the Hub's cache."""
    from .fake_hub import FakeHub
    from .helpers import as_flags, cli, hub_env

    tmp, model, _, eot = speedrun_files
    dataset = tmp / "hub-dataset"
    dataset.mkdir()
    for i in (1, 2, 3):
        write_shard(dataset / f"fineweb_train_{i:06d}.bin", [eot, *[(i + j) % 30 + 1 for j in range(2_999)]])
    write_shard(dataset / "fineweb_val_000000.bin", [eot, *[j % 30 + 1 for j in range(4_999)]])
    sets = as_flags([*SMALL, f'data.cache_dir="{tmp / "hub-cache"}"', "data.val_tokens=4000"])
    with FakeHub({token_shards.SPEEDRUN_DATASET: dataset}, models={"openai-community/gpt2": model}) as hub:
        # cli() adds to this worker's environment, where test_export.py sets the Hub offline for good
        env = hub_env(tmp / "hf", hub.url, HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0")
        proc = cli("data", "prepare", "gpt2-speedrun", *sets, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert sorted(hub.got(token_shards.SPEEDRUN_DATASET)) == ["fineweb_train_000001.bin",
                                                                  "fineweb_train_000002.bin", "fineweb_val_000000.bin"]
        assert "data: 6,000 training tokens in 2 shards, 4,000 validation tokens" in proc.stdout
    info = cli("data", "info", "gpt2-speedrun", *sets, env={**env, "HF_HUB_OFFLINE": "1"})
    assert info.returncode == 0, info.stdout + info.stderr
    assert "data.source: 2 shards here" in info.stdout and "data.val_source: 1 shard here" in info.stdout


def test_validation_ids_past_the_vocabulary_are_one_error_before_training(speedrun_files, tmp_path):
    from lmcockpit.core.data.prepare import prepare

    tmp, model, _, eot = speedrun_files
    val = write_shard(tmp_path / "fineweb_val_000000.bin", [eot, *range(1, 30), 50_000, *range(1, 100)])
    cfg = load_config("gpt2-speedrun", [*SMALL, f'data.source="{tmp / "data"}"', f'data.val_source="{val}"',
                                        f'tokenizer.kind="{model}"', f'data.cache_dir="{tmp_path / "cache"}"',
                                        "data.val_tokens=0"])[0]
    with pytest.raises(ConfigError, match=r"data.val_source: token id 50000 in .*, past tokenizer.vocab_size = 64"):
        prepare(cfg, lambda line: None, lambda *a: None)


def test_val_tokens_without_a_val_source_is_refused():
    with pytest.raises(ConfigError, match="data.val_tokens = 100 counts tokens of data.val_source, which is not set"):
        load_config("cpu", ["data.val_tokens=100"])
