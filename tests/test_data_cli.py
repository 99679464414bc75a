"""`lmcockpit data prepare/info/rm` through the real command, piped, as a script would run it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lmcockpit.core.data import budget

from .helpers import cli, records, write_jsonl

SETTINGS = ["data.max_bytes=0", "data.val_fraction=0.05", "tokenizer.vocab_size=300",
            "tokenizer.train_bytes=100_000", "data.shard_bytes=60_000", "data.workers=1"]


def flags(corpus: Path, cache: Path) -> list[str]:
    overrides = [f"data.source=\"{corpus}\"", f"data.cache_dir=\"{cache}\"", *SETTINGS]
    return [a for s in overrides for a in ("--set", s)]


@pytest.mark.slow
def test_prepare_info_and_rm_of_a_token_cache(tmp_path):
    corpus, cache = write_jsonl(tmp_path / "corpus.jsonl", records(1500)), tmp_path / "cache"
    # A build killed in its third piece: info lists it as partial, prepare resumes it.
    driver = textwrap.dedent(f"""
        import os, signal, sys
        from lmcockpit.tui.commands import data
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


@pytest.mark.slow
def test_prepare_says_how_the_sizing_of_many_compressed_shards_goes(tmp_path):
    import gzip

    corpus = tmp_path / "shards"
    corpus.mkdir()
    for i in range(16):
        text = "".join(json.dumps({"text": t}) + "\n" for t in records(60, seed=i))
        (corpus / f"part-{i:02d}.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    done = cli("data", "prepare", "debug", *flags(corpus, tmp_path / "cache"))
    assert done.returncode == 0, done.stderr
    sizing = [line for line in done.stdout.splitlines() if line.startswith("sizing the files")]
    assert sizing[0] == "sizing the files: 0% of 16 files" and sizing[-1] == "sizing the files: 100% of 16 files"
    assert done.stdout.index("sizing the files") < done.stdout.index("training tokenizer")


def test_prepare_s_bar_on_a_terminal_counts_files_as_files_and_bytes_as_bytes():
    import io

    from rich.console import Console

    from lmcockpit.tui.commands.data import Progress

    screen = io.StringIO()
    progress = Progress(Console(file=screen, force_terminal=True, width=120))
    progress("sizing the files", 7, 20, "files")
    progress.bar.refresh()
    progress("tokenizing", 5_000_000, 10_000_000, "bytes")
    progress.bar.refresh()
    progress.stop()
    shown = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", screen.getvalue())
    assert "sizing the files" in shown and " 35% 7/20 files " in shown and "MB" not in shown.split("tokenizing")[0]
    assert " 50% 5.0/10.0 MB " in shown


@pytest.mark.slow
def test_data_commands_refuse_bad_input_in_one_line(tmp_path):
    gone = cli("data", "rm", "0123abcd", "--cache-dir", str(tmp_path))
    assert gone.returncode == 2 and "'0123abcd': no token cache" in gone.stderr and "Traceback" not in gone.stderr
    missing = cli("data", "prepare", "debug", "--set", f"data.source=\"{tmp_path / 'nothing'}\"")
    assert missing.returncode == 2 and "no such file or folder" in missing.stderr
    assert cli("data").returncode == 2


# ------------------------------------------------------------------- data info PRESET: the run's data
def mixture_preset(tmp_path: Path, parts: list[tuple[str, float]], max_steps: int = 600) -> Path:
    """A preset file, as a user writes one: a small model, a mixture of `parts` (source, weight)."""
    sources = "".join(f'\n[[data.sources]]\nsource = "{source}"\nweight = {weight}\n' for source, weight in parts)
    preset = tmp_path / "mix.toml"
    preset.write_text(textwrap.dedent(f"""\
        [model]
        n_layer = 2
        d_model = 64
        n_head = 4
        n_kv_head = 2

        [training]
        max_steps = {max_steps}
        micro_batch_size = 4
        seq_len = 64

        [tokenizer]
        vocab_size = 300
        train_bytes = 100_000

        [data]
        max_bytes = 0
        val_fraction = 0.05
        shard_bytes = 60_000
        workers = 1
        cache_dir = "{tmp_path / 'cache'}"
        """) + sources)
    return preset


def part_blocks(out: str) -> dict[str, list[str]]:
    """`data info PRESET`'s lines about each part, by the part's key line."""
    blocks, current = {}, None
    for line in out.split("\ntoken caches under")[0].split("\nno token caches")[0].splitlines():
        if line.startswith("data.source"):
            current = blocks.setdefault(line, [])
        elif line.startswith("  ") and current is not None:
            current.append(line.strip())
    return blocks


@pytest.mark.slow
def test_info_of_a_mixture_preset_says_each_part_s_share_tokens_and_epochs(tmp_path):
    # apples: four times the text, a quarter of the weight; zebras: a small part drawn three times as often
    apples = write_jsonl(tmp_path / "apples.jsonl", records(600, seed=1))
    zebras = write_jsonl(tmp_path / "zebras.jsonl", records(150, seed=2))
    preset = mixture_preset(tmp_path, [(apples, 1), (zebras, 3)])
    run_tokens = 600 * 4 * 64
    keys = [f'data.sources[0]: "{apples}", weight 1', f'data.sources[1]: "{zebras}", weight 3']

    before = cli("data", "info", str(preset))
    assert before.returncode == 0, before.stderr
    assert before.stdout.startswith(f"the data a run of {preset} trains on:\ntoken budget: 154k tokens (")
    blocks = part_blocks(before.stdout)
    assert list(blocks) == keys, before.stdout
    # estimates from the text's size, said as such: BYTES_PER_TOKEN bytes a token of what is kept for training
    for (key, lines), path, share in zip(blocks.items(), (apples, zebras), (0.25, 0.75)):
        tokens = int(path.stat().st_size * 0.95 / budget.BYTES_PER_TOKEN)
        assert lines[0] == (f"{share:.0%} of the tokens, {budget._count(run_tokens * share)} of its about "
                            f"{budget._count(tokens)} train tokens, about {run_tokens * share / tokens:.2g} epochs"), key
        assert lines[1] == "no token cache yet"
    assert f"`lmcockpit data prepare {preset}` prepares what is missing (so does training)" in before.stdout
    assert f"no token caches under {tmp_path / 'cache'}" in before.stdout

    assert cli("data", "prepare", str(preset)).returncode == 0
    after = cli("data", "info", str(preset))
    blocks = part_blocks(after.stdout)
    assert list(blocks) == keys, after.stdout
    caches = {json.loads(meta.read_text())["source"]: meta.parent.name for meta in (tmp_path / "cache").glob("*/meta.json")}
    epochs = []
    for (key, lines), path, share in zip(blocks.items(), (apples, zebras), (0.25, 0.75)):
        cache = caches[str(path)]
        tokens = json.loads((tmp_path / "cache" / cache / "meta.json").read_text())["train_tokens"]
        epochs.append(run_tokens * share / tokens)
        assert lines[0] == (f"{share:.0%} of the tokens, {budget._count(run_tokens * share)} of its "
                            f"{budget._count(tokens)} train tokens, {epochs[-1]:.2g} epochs"), key
        assert lines[1] == f"token cache {cache} (complete)"
    assert epochs[0] < budget.MANY_EPOCHS < epochs[1]  # the small, heavy part repeats past the warning; the other not
    assert len(blocks[keys[0]]) == 2 and blocks[keys[1]][2].startswith(f"warning: {epochs[1]:.0f} epochs over the same")
    assert "(data.sources[1].source, or a lower data.sources[1].weight)" in blocks[keys[1]][2]
    assert "prepares what is missing" not in after.stdout
    # then the caches, as `data info` alone lists them (a second later, maybe: ages aside)
    listed = cli("data", "info", "--cache-dir", str(tmp_path / "cache")).stdout
    assert ageless(after.stdout.split("\n\n", 1)[1]) == ageless(listed)


def ageless(listing: str) -> str:
    return re.sub(r", \d+ \w+ old: ", ", AGE old: ", listing)


@pytest.mark.slow
def test_info_of_a_preset_reads_a_hub_source_from_the_hub_s_cache_and_never_the_network(tmp_path):
    # What an earlier run fetched, in the Hub cache's own layout; and a dataset never fetched.
    snapshot = tmp_path / "hub" / "datasets--someone--fetched" / "snapshots" / "0123abcd"
    write_jsonl((snapshot / "sample").mkdir(parents=True) or snapshot / "sample" / "part-0.jsonl", records(300))
    (tmp_path / "hub" / "datasets--someone--fetched" / "refs").mkdir()
    (tmp_path / "hub" / "datasets--someone--fetched" / "refs" / "main").write_text("0123abcd")
    preset = mixture_preset(tmp_path, [("hf:someone/fetched/sample", 1), ("hf:someone/never-fetched", 1)])
    driver = textwrap.dedent(f"""
        import socket, sys
        from lmcockpit.tui.commands import data
        def refuse(*args, **kwargs):
            print("NETWORK ATTEMPTED", args, flush=True)
            raise OSError("the test allows no network")
        socket.socket.connect = socket.getaddrinfo = socket.create_connection = refuse
        code = data.main(["info", {str(preset)!r}])
        print("HEAVY", sorted({{"numpy", "tokenizers", "torch"}} & set(sys.modules)))
        sys.exit(code)
        """)
    proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert proc.returncode == 0 and "NETWORK ATTEMPTED" not in proc.stdout, proc.stdout + proc.stderr
    assert "HEAVY []" in proc.stdout  # the front-end's budget: no numpy, tokenizers or torch
    fetched, never = part_blocks(proc.stdout).values()
    tokens = int((snapshot / "sample" / "part-0.jsonl").stat().st_size * 0.95 / budget.BYTES_PER_TOKEN)
    assert f"of its about {budget._count(tokens)} train tokens" in fetched[0]
    assert never == ["50% of the tokens, 76.8k: not fetched yet", "no token cache yet"]
    assert f"`lmcockpit data prepare {preset}` fetches and prepares what is missing" in proc.stdout


@pytest.mark.slow
def test_info_of_a_bad_preset_is_one_error_line(tmp_path):
    for args, said in ((["nosuchpreset"], "preset 'nosuchpreset' not found"),
                       (["debug", "--set", "data.sorce=1"], "data.sorce"),
                       (["--set", "training.max_steps=5"], "name the PRESET first")):
        proc = cli("data", "info", *args)
        assert proc.returncode == 2 and proc.stdout == "", (args, proc.stdout)
        [line] = proc.stderr.splitlines()
        assert line.startswith("error: ") and said in line and "Traceback" not in proc.stderr, (args, line)
