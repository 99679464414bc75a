"""Named tasks from the Hugging Face Hub (`hellaswag`, `arc_easy`, ...), fetched into the Hub's cache.

Each name is a dataset repo, the revision and files that hold its evaluation split, and how a row
becomes an item. The files are fetched with `huggingface_hub` as `hf:` data sources are
(data/hub.py: HF_TOKEN and HF_HUB_OFFLINE honoured); offline, or the Hub out of reach, what was
fetched before serves, and with nothing fetched the refusal gives the command that downloads it.
The prompts are the usual ones: HellaSwag as llm.c scores it (the context, then each ending after
a space), ARC and PIQA as the evaluation harness asks them (`Question: ...\\nAnswer:`), LAMBADA's
last word after the rest of its passage, right only when every token of it is the greedy choice.
A task's files are named by an fnmatch pattern over the repo's paths, `*` crossing `/`, as the
Hub's client chooses what to fetch: the same pattern then finds them in the fetched snapshot.
Torch: never.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from ..config import ConfigError
from .items import LANGUAGE_MODELING, MULTIPLE_CHOICE, Item, Task


@dataclass(frozen=True)
class HubTask:
    repo: str
    files: str  # the split's data files (Parquet): an fnmatch pattern over the repo's paths, see matches()
    kind: str
    item: Callable[[dict], Item]
    revision: str = "main"


def hellaswag(row: dict) -> Item:
    return Item((row["ctx"],), tuple(" " + ending for ending in row["endings"]), int(row["label"]))


def arc(row: dict) -> Item:
    choices = row["choices"]
    return Item((f"Question: {row['question']}\nAnswer:",), tuple(" " + text for text in choices["text"]),
                list(choices["label"]).index(row["answerKey"]))


def piqa(row: dict) -> Item:
    return Item((f"Question: {row['goal']}\nAnswer:",), (" " + row["sol1"], " " + row["sol2"]), int(row["label"]))


def lambada(row: dict) -> Item:
    context, word = row["text"].rsplit(" ", 1)
    return Item((context,), (" " + word,))


HUB: dict[str, HubTask] = {
    "hellaswag": HubTask("Rowan/hellaswag", "default/validation/*.parquet", MULTIPLE_CHOICE, hellaswag,
                         "refs/convert/parquet"),
    "arc_easy": HubTask("allenai/ai2_arc", "ARC-Easy/test-*.parquet", MULTIPLE_CHOICE, arc),
    "arc_challenge": HubTask("allenai/ai2_arc", "ARC-Challenge/test-*.parquet", MULTIPLE_CHOICE, arc),
    "lambada": HubTask("EleutherAI/lambada_openai", "default/test/*.parquet", LANGUAGE_MODELING, lambada),
    # The harness (0.4.13) scores PIQA's validation split from baber/piqa. Its files' layout is
    # not pinned here (data/validation-*.parquet, or a folder a split), so the pattern names the
    # split anywhere in the path; neither "train" nor "test" holds "validation".
    "piqa": HubTask("baber/piqa", "*validation*.parquet", MULTIPLE_CHOICE, piqa),
}


def matches(spec: HubTask, path: str) -> bool:
    """Whether the repo file at `path` (posix, relative to the repo) is one of the task's."""
    # What snapshot_download's allow_patterns does (huggingface_hub.utils._paths.filter_repo_objects):
    # fnmatch.fnmatchcase on the whole repo path, so `*` crosses `/`, unlike pathlib's glob. The
    # files found in the snapshot afterwards must be chosen by this same rule, or a pattern that
    # fetched a file would not find it.
    return fnmatchcase(path, spec.files)


def local_files(spec: HubTask, folder: Path) -> list[Path]:
    """The task's files in a fetched snapshot `folder`, in the order of their repo paths."""
    found = ((p.relative_to(folder).as_posix(), p) for p in folder.rglob("*") if p.is_file())
    return [p for path, p in sorted(found) if matches(spec, path)]


def download_command(spec: HubTask) -> str:
    revision = f" --revision {spec.revision}" if spec.revision != "main" else ""
    return f"hf download {spec.repo} --repo-type dataset{revision} --include '{spec.files}'"


def fetched_files(name: str) -> list[Path]:
    """The task's data files in the Hub's cache, fetched now if they are not there yet."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from ..data import hub

    spec = HUB[name]

    def download(**offline) -> Path:
        return Path(snapshot_download(spec.repo, repo_type="dataset", revision=spec.revision,
                                      allow_patterns=[spec.files], **offline))

    def cached() -> Path | None:
        try:
            folder = download(local_files_only=True)
        except (LocalEntryNotFoundError, OSError):
            return None
        return folder if local_files(spec, folder) else None

    folder = hub.fetch_or_cached(
        f"eval.tasks: {name}", spec.repo, "dataset", download, cached,
        lambda reason: f"eval.tasks: {name} is not downloaded yet, and {reason}. Download it into the Hub's cache "
                       f"(HF_HOME) on a machine with a network, then copy that cache here:\n  {download_command(spec)}")
    files = local_files(spec, folder)
    if not files:
        raise ConfigError(f"eval.tasks: {name}: {spec.repo} holds no {spec.files} at {spec.revision}")
    return files


def read_task(name: str) -> Task:
    import pyarrow.parquet as pq

    spec = HUB[name]
    items = []
    for path in fetched_files(name):
        for number, row in enumerate(pq.read_table(path).to_pylist()):
            try:
                items.append(spec.item(row))
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ConfigError(f"eval.tasks: {name}: {path.name} row {number} is not {name}'s shape "
                                  f"({type(e).__name__}: {e})") from None
    return Task(name, spec.kind, tuple(items))
