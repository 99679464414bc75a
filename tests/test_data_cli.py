"""`lmcockpit data prepare/info/rm` through the real command, piped, as a script would run it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from .conftest import cli
from .test_data_scale import records, write_jsonl

SETTINGS = ["data.max_bytes=0", "data.val_fraction=0.05", "tokenizer.vocab_size=300",
            "tokenizer.train_bytes=100_000", "data.shard_bytes=60_000", "data.workers=1"]


def flags(corpus: Path, cache: Path) -> list[str]:
    overrides = [f"data.source=\"{corpus}\"", f"data.cache_dir=\"{cache}\"", *SETTINGS]
    return [a for s in overrides for a in ("--set", s)]


def test_prepare_info_and_rm_of_a_token_cache(tmp_path):
    corpus, cache = write_jsonl(tmp_path / "corpus.jsonl", records(1500)), tmp_path / "cache"
    # A build killed in its third piece: info lists it as partial, prepare resumes it.
    driver = textwrap.dedent(f"""
        import os, signal, sys
        from lmcockpit.tui import data
        from lmcockpit.core.data import build
        build_piece = build.build_piece
        def dying(job, on_bytes=lambda n: None):
            if job.piece.index == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return build_piece(job, on_bytes)
        build.build_piece = dying
        sys.exit(data.main(["prepare", "debug", *{flags(corpus, cache)!r}]))
        """)
    killed = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    partial = cli("data", "info", "--cache-dir", str(cache))
    assert partial.returncode == 0 and "partial (2/" in partial.stdout, partial.stdout

    done = cli("data", "prepare", "debug", *flags(corpus, cache))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any("resuming an interrupted preparation: 2 of" in line for line in lines), done.stdout
    assert any(line.startswith("tokenizing: 100%") for line in lines)  # plain progress lines when piped
    assert any("train /" in line and "val documents" in line for line in lines)
    [summary] = [line for line in lines if line.startswith("token cache ")]
    key = summary.split()[2].rstrip(":")
    meta = json.loads((cache / key / "meta.json").read_text())
    assert meta["documents"]["train"] + meta["documents"]["val"] == 1500

    listed = cli("data", "info", "--cache-dir", str(cache))
    [row] = [line for line in listed.stdout.splitlines() if line.startswith(key)]
    assert "complete" in row and str(corpus.name) in listed.stdout and "300" in row

    again = cli("data", "prepare", "debug", *flags(corpus, cache))
    assert again.returncode == 0 and "reusing token cache" in again.stdout

    removed = cli("data", "rm", key[:6], "--cache-dir", str(cache))
    assert removed.returncode == 0 and f"removed token cache {key}" in removed.stdout
    assert not (cache / key).exists()
    assert "no token caches" in cli("data", "info", "--cache-dir", str(cache)).stdout


def test_data_commands_refuse_bad_input_in_one_line(tmp_path):
    gone = cli("data", "rm", "0123abcd", "--cache-dir", str(tmp_path))
    assert gone.returncode == 2 and "'0123abcd': no token cache" in gone.stderr and "Traceback" not in gone.stderr
    missing = cli("data", "prepare", "debug", "--set", f"data.source=\"{tmp_path / 'nothing'}\"")
    assert missing.returncode == 2 and "no such file or folder" in missing.stderr
    assert cli("data").returncode == 2
