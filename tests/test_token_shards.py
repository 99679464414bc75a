"""modded-nanogpt's .bin token shards (data.format = "tokens", data.val_source) and BOS-aligned rows."""

from __future__ import annotations

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
