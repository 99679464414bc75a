"""`data.source = "hf:..."` against a Hub on 127.0.0.1 (fake_hub.py): the real `huggingface_hub`
lists and downloads over real HTTP, pointed there by HF_ENDPOINT, which it reads when imported; so
the code under test runs in a process of its own, started with that environment."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmcockpit.core.config import load_config
from lmcockpit.core.data.hub import FILE_BYTES_PER_TOKEN, choose_files

from .fake_hub import FakeHub
from .helpers import hub_env

REPO, PATH = "owner/name", "sample/10BT"
SHARDS = [f"{PATH}/{i:03d}_00000.parquet" for i in range(4)]
SMALL = ["tokenizer.vocab_size=300", "tokenizer.train_bytes=20_000", "data.workers=1", "data.max_bytes=0",
         "data.val_fraction=0.1", "data.shard_bytes=50_000"]


def prepare(env: dict[str, str], cache_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    flags = [a for s in [f'data.source="hf:{REPO}/{PATH}"', f'data.cache_dir="{cache_dir}"', *SMALL, *overrides]
             for a in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", "data", "prepare", "debug", *flags],
                          capture_output=True, text=True, env=env, timeout=120)


def fetch(env: dict[str, str], spec: str, budget_tokens: int = 0) -> subprocess.CompletedProcess:
    """hub.local_folder alone, in a process of its own: the fetch without the build after it."""
    code = ("import sys; from lmcockpit.core.data.hub import local_folder; "
            "print(local_folder(sys.argv[1], int(sys.argv[2])))")
    return subprocess.run([sys.executable, "-c", code, spec, str(budget_tokens)], capture_output=True, text=True,
                          env=env, timeout=120)


def texts(shard: int) -> list[str]:
    rng = random.Random(shard)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(300)]
    return [f"shard {shard} document {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(20, 40)))
            for i in range(120)]


def make_repo(root: Path) -> Path:
    """A dataset laid out as FineWeb-Edu is: Parquet shards under sample/10BT, READMEs beside them,
    and another sample the source does not name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i, name in enumerate(SHARDS):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": texts(i), "id": list(range(120))}), root / name)
    (root / "sample/100BT").mkdir(parents=True)
    pq.write_table(pa.table({"text": texts(99)}), root / "sample/100BT/000_00000.parquet")
    (root / "README.md").write_text("---\nlicense: odc-by\n---\n# a fake FineWeb\n")
    (root / PATH / "README.md").write_text("the 10BT sample\n")
    return root


def steps_for_two_shards(repo: Path) -> int:
    """training.max_steps whose token budget, in file bytes, lies past the first shard and within
    the second: exactly two of the four are needed."""
    tokens_per_step = load_config("debug", [])[0].tokens_per_step
    first, second = ((repo / n).stat().st_size for n in SHARDS[:2])
    steps = round((first + second / 2) / (tokens_per_step * FILE_BYTES_PER_TOKEN))
    assert first < steps * tokens_per_step * FILE_BYTES_PER_TOKEN <= first + second, (first, second)
    return steps


def meta_of(cache_dir: Path) -> tuple[Path, dict]:
    (meta,) = cache_dir.glob("*/meta.json")
    return meta.parent, json.loads(meta.read_text())


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    """One fake Hub for the module, and a first `data prepare` that fetched from it."""
    tmp = tmp_path_factory.mktemp("hub")
    repo = make_repo(tmp / "repo")
    steps = steps_for_two_shards(repo)
    with FakeHub({REPO: repo}) as hub:
        env = hub_env(tmp / "hf", hub.url)
        proc = prepare(env, tmp / "tokens", f"training.max_steps={steps}")
        yield hub, env, tmp, steps, proc


def test_every_format_a_build_reads_is_fetched_and_a_readme_is_not():
    listing = [("README.md", 10), (".gitattributes", 10), ("en/c4-train.00000-of-01024.json.gz", 10),
               ("dump/part-0.jsonl.bz2", 10), ("dump/part-1.jsonl.xz", 10), ("wiki/a.txt", 10),
               ("sample/000.parquet", 10), ("data/train.arrow", 10), ("dataset_infos.json.lock", 10)]
    assert choose_files(listing, 0) == sorted(["en/c4-train.00000-of-01024.json.gz", "dump/part-0.jsonl.bz2",
                                               "dump/part-1.jsonl.xz", "wiki/a.txt", "sample/000.parquet",
                                               "data/train.arrow"])


@pytest.mark.slow
def test_prepare_fetches_only_the_shards_its_budget_needs(fetched):
    hub, env, tmp, steps, proc = fetched
    assert proc.returncode == 0, proc.stderr
    assert sorted(hub.got(REPO)) == SHARDS[:2]  # not the later shards, the READMEs nor the other sample
    resolved = [r for r in hub.requests if r.file]
    assert resolved and all(hub.commit(REPO) in r.path for r in resolved)  # one commit, the one listed
    assert not any("authorization" in r.headers for r in hub.requests)  # no token was given
    # The cache holds the documents of those two shards, every one, and nothing else.
    _, meta = meta_of(tmp / "tokens")
    docs = texts(0) + texts(1)
    assert meta["documents"]["train"] + meta["documents"]["val"] == len(docs)
    assert meta["bytes"] == sum(len(t.encode()) for t in docs)
    # In the Hub's own cache, as huggingface_hub keeps it.
    snapshot = tmp / "hf/hub/datasets--owner--name/snapshots" / hub.commit(REPO) / PATH
    assert sorted(p.name for p in snapshot.iterdir()) == [Path(n).name for n in SHARDS[:2]]


@pytest.mark.slow
def test_offline_the_files_fetched_before_serve(fetched):
    hub, env, tmp, steps, first = fetched
    assert first.returncode == 0, first.stderr
    cache, _ = meta_of(tmp / "tokens")
    blobs = sorted((tmp / "hf/hub/datasets--owner--name/blobs").iterdir())
    seen = len(hub.requests)
    proc = prepare({**env, "HF_HUB_OFFLINE": "1"}, tmp / "tokens", f"training.max_steps={steps}")
    assert proc.returncode == 0, proc.stderr
    assert len(hub.requests) == seen  # nothing asked of the Hub
    # The same files, same sizes and times, so the same token cache: the Hub cache served them.
    assert f"data: reusing token cache {cache}" in proc.stdout
    assert sorted((tmp / "hf/hub/datasets--owner--name/blobs").iterdir()) == blobs
    # A cache made afresh offline reads those files themselves: the same documents.
    again = prepare({**env, "HF_HUB_OFFLINE": "1"}, tmp / "tokens-offline", f"training.max_steps={steps}")
    assert again.returncode == 0, again.stderr
    assert meta_of(tmp / "tokens-offline")[1]["documents"] == meta_of(tmp / "tokens")[1]["documents"]
    assert len(hub.requests) == seen


@pytest.mark.slow
def test_online_again_only_what_the_budget_lacks_is_fetched(fetched, tmp_path):
    hub, env, tmp, steps, first = fetched
    assert first.returncode == 0, first.stderr
    home = tmp_path / "hf"  # a copy: the module's Hub cache stays as the first fetch left it
    shutil.copytree(tmp / "hf", home, symlinks=True)
    env = {**env, "HF_HOME": str(home)}
    tokens_per_step = load_config("debug", [])[0].tokens_per_step
    before = len(hub.got(REPO))
    same = fetch(env, f"hf:{REPO}/{PATH}", steps * tokens_per_step)
    assert same.returncode == 0, same.stderr
    assert hub.got(REPO)[before:] == []  # the same budget: nothing downloaded again
    sizes = [(tmp / "repo" / n).stat().st_size for n in SHARDS]
    more = fetch(env, f"hf:{REPO}/{PATH}", int((sum(sizes[:2]) + sizes[2] // 2) / FILE_BYTES_PER_TOKEN))
    assert more.returncode == 0, more.stderr
    assert hub.got(REPO)[before:] == [SHARDS[2]]  # a larger one: the third shard, and only it
    assert sorted(p.name for p in Path(more.stdout.strip()).iterdir()) == [Path(n).name for n in SHARDS[:3]]


@pytest.mark.slow
def test_out_of_reach_the_files_fetched_before_serve(fetched, closed_port):
    hub, env, tmp, steps, first = fetched
    assert first.returncode == 0, first.stderr
    cache, _ = meta_of(tmp / "tokens")
    proc = prepare({**env, "HF_ENDPOINT": closed_port}, tmp / "tokens", f"training.max_steps={steps}")
    assert proc.returncode == 0, proc.stderr
    assert f"data: reusing token cache {cache}" in proc.stdout
    assert "Retrying" not in proc.stderr  # a refused connection is not waited on (1+2+4+8+8 s of backoff)


@pytest.mark.slow
def test_out_of_reach_with_nothing_fetched_exits_2_with_the_download_command(tmp_path, closed_port):
    proc = prepare(hub_env(tmp_path / "hf", closed_port), tmp_path / "tokens")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "not downloaded yet, and the Hub could not be reached (ConnectError)" in proc.stderr
    assert f"hf download {REPO} --repo-type dataset --include '{PATH}/*' --local-dir DIR" in proc.stderr
    assert f"data.source='\"DIR/{PATH}\"'" in proc.stderr
    assert "Retrying" not in proc.stderr
    assert not (tmp_path / "tokens").exists()


@pytest.mark.slow
def test_hf_token_reaches_the_hub_as_a_bearer_header(tmp_path):
    with FakeHub({REPO: make_repo(tmp_path / "repo")}) as hub:
        proc = fetch(hub_env(tmp_path / "hf", hub.url, HF_TOKEN="hf_test_token"), f"hf:{REPO}/{PATH}")
    assert proc.returncode == 0, proc.stderr
    assert sorted(hub.got(REPO)) == SHARDS  # no budget: every data file
    asked = [r for r in hub.requests if r.path.startswith(("/api/datasets/", "/datasets/"))]
    assert {(r.method, r.headers.get("authorization")) for r in asked} == {("GET", "Bearer hf_test_token"),
                                                                           ("HEAD", "Bearer hf_test_token")}


@pytest.mark.slow
def test_a_download_cut_midway_resumes_where_it_stopped(tmp_path):
    from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE

    # huggingface_hub writes what it receives in chunks of DOWNLOAD_CHUNK_SIZE and resumes after
    # the last one written; what came after it is asked for again. So the file is longer than a
    # chunk and the connection is cut past the first.
    payload = random.Random(0).randbytes(DOWNLOAD_CHUNK_SIZE // 2 + 100_000).hex().encode()
    (tmp_path / "big/data").mkdir(parents=True)
    (tmp_path / "big/data/000.txt").write_bytes(payload)
    cut = DOWNLOAD_CHUNK_SIZE + 50_000
    with FakeHub({"owner/big": tmp_path / "big"}, drop_once={"owner/big:data/000.txt": cut}) as hub:
        proc = fetch(hub_env(tmp_path / "hf", hub.url), "hf:owner/big/data")
    assert proc.returncode == 0, proc.stderr
    assert (Path(proc.stdout.strip()) / "000.txt").read_bytes() == payload
    gets = [r for r in hub.requests if r.method == "GET" and r.file == "owner/big:data/000.txt"]
    assert len(gets) == 2 and "range" not in gets[0].headers
    resumed = re.fullmatch(r"bytes=(\d+)-", gets[1].headers.get("range", ""))
    assert resumed and 0 < int(resumed[1]) <= cut, gets[1].headers  # not from the start, nor past the cut


@pytest.mark.slow
@pytest.mark.parametrize("token", ["", "hf_secret"])
def test_a_dataset_the_hub_does_not_have_is_named_with_what_to_do(tmp_path, token):
    with FakeHub({REPO: make_repo(tmp_path / "repo")}) as hub:
        env = hub_env(tmp_path / "hf", hub.url, **({"HF_TOKEN": token} if token else {}))
        proc = subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", "data", "prepare", "debug", "--set",
                               'data.source="hf:owner/nmae/sample/10BT"', "--set", f'data.cache_dir="{tmp_path}"'],
                              capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "the Hub has no dataset owner/nmae that this machine may read (a typo in the name?" in proc.stderr
    assert ("this machine's token cannot read it" if token else "set HF_TOKEN to a token that can") in proc.stderr
    assert "not downloaded yet" not in proc.stderr
