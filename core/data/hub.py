"""`hf:OWNER/NAME[/PATH]`: a dataset on the Hugging Face Hub, fetched with `huggingface_hub` into
its own cache (downloads resume; HF_TOKEN and HF_HUB_OFFLINE are honoured), then read as a local
folder. Only its data files under PATH are fetched. Offline, or the Hub out of reach, with nothing
fetched yet: a ConfigError that gives the command to download it elsewhere and the `--set` that
trains on the result.
"""

from __future__ import annotations

from pathlib import Path

from ..config import ConfigError

DATA_PATTERNS = ("*.parquet", "*.jsonl", "*.jsonl.gz", "*.jsonl.zst", "*.json", "*.arrow", "*.txt")


def parse(spec: str) -> tuple[str, str]:
    """("OWNER/NAME", "PATH" or "") from "hf:OWNER/NAME[/PATH]"."""
    parts = [p for p in spec[len("hf:"):].strip("/").split("/") if p]
    if len(parts) < 2:
        raise ConfigError(f"data.source = {spec!r}: expected hf:OWNER/NAME or hf:OWNER/NAME/PATH "
                          "(e.g. hf:HuggingFaceFW/fineweb-edu/sample/10BT)")
    return "/".join(parts[:2]), "/".join(parts[2:])


def download_command(repo: str, path: str) -> str:
    include = f" --include '{path}/*'" if path else ""
    return f"hf download {repo} --repo-type dataset{include} --local-dir DIR"


def local_folder(spec: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    repo, path = parse(spec)
    prefix = f"{path}/" if path else ""
    offline = constants.HF_HUB_OFFLINE
    try:
        folder = snapshot_download(repo, repo_type="dataset", local_files_only=offline,
                                   allow_patterns=[prefix + p for p in DATA_PATTERNS] + [prefix + "**/" + p
                                                                                         for p in DATA_PATTERNS])
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError) as e:
        why = "HF_HUB_OFFLINE is set" if offline else f"the Hub could not be reached ({type(e).__name__})"
        raise ConfigError(
            f"data.source = {spec!r}: not downloaded yet, and {why}. Download it on a machine with a network:\n"
            f"  {download_command(repo, path)}\n"
            f"then train on it with --set data.source='\"{'DIR/' + path if path else 'DIR'}\"'") from None
    return Path(folder) / path
