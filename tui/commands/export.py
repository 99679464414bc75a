"""`lmcockpit export RUN_OR_CHECKPOINT OUT_DIR`: a Hugging Face `Qwen3ForCausalLM` folder.

The work is core/infer/export.py's (it reads the weights with torch, imported there); this front-end
parses the arguments and turns refusals into one `error: ...` line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from ...core.config import ConfigError
from . import command_parser
from ..completers import directories, run_folders
from ..usage import UsageError, error


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(__name__, description="Write a checkpoint as a Hugging Face Qwen3ForCausalLM folder "
                        "(config.json, model.safetensors, tokenizer files, generation_config.json) that transformers "
                        "loads with AutoModelForCausalLM.from_pretrained, offline.")
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT", help="a run folder (its latest checkpoint) or a checkpoint folder"
                   ).completer = run_folders
    p.add_argument("out", metavar="OUT_DIR", help="the folder to create (must not exist, or be empty)"
                   ).completer = directories
    return p


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        from ...core.infer.export import export

        done = export(args.path, args.out, log=lambda s: print(s, file=sys.stderr))
    except (UsageError, ConfigError):
        raise  # the registry's: one error: line and exit 2
    except Exception as e:  # noqa: BLE001 - a failure that is not the user's: show where
        traceback.print_exc(file=sys.stderr)
        error(f"export failed: {e}")
        return 1
    print(f"exported step {done.step} ({done.n_params:,} parameters) as Qwen3ForCausalLM to {done.out}")
    return 0
