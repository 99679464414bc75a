"""`lmcockpit export RUN_OR_CHECKPOINT OUT_DIR`: a Hugging Face `Qwen3ForCausalLM` folder.

The work is core/export.py's (it reads the weights with torch, imported there); this front-end
parses the arguments and turns refusals into one `error: ...` line and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from lmcockpit.core.config import ConfigError
from lmcockpit.tui.cli import Parser, UsageError, error


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="lmcockpit export", description="Write a checkpoint as a Hugging Face Qwen3ForCausalLM folder "
                "(config.json, model.safetensors, tokenizer files, generation_config.json) that transformers "
                "loads with AutoModelForCausalLM.from_pretrained, offline.")
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT", help="a run folder (its latest checkpoint) or a checkpoint folder")
    p.add_argument("out", metavar="OUT_DIR", help="the folder to create (must not exist, or be empty)")
    return p


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        from lmcockpit.core.export import export

        done = export(args.path, args.out, log=lambda s: print(s, file=sys.stderr))
    except (UsageError, ConfigError) as e:
        return error(str(e))
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        where = at_destination(e, args.out)
        if where is None:
            return failed(e)
        # a place that cannot be created or written: the user's input
        return error(f"{args.out}: cannot write the export there: {e.strerror or e} (at {where})")
    except Exception as e:  # noqa: BLE001 - a failure that is not the user's: show where
        return failed(e)
    print(f"exported step {done.step} ({done.n_params:,} parameters) as Qwen3ForCausalLM to {done.out}")
    return 0


def failed(e: Exception) -> int:
    traceback.print_exc(file=sys.stderr)
    error(f"export failed: {e}")
    return 1


def at_destination(e: OSError, out_dir: str) -> Path | None:
    """Where, at the place the user asked to write to, an OSError happened: the folder, what goes
    in it, or (named by the folder it is in) the temporary folder beside it that core/export.py
    renames into place. None for an error elsewhere: an internal failure."""
    out = Path(out_dir).expanduser().absolute()
    partial = f".{out.name}.partial-"
    for name in (e.filename, e.filename2):
        if name is None:
            continue
        path = Path(os.fsdecode(name)).expanduser().absolute()
        if path == out or path == out.parent or out in path.parents:
            return path
        top = path if path.parent == out.parent else next((p for p in path.parents if p.parent == out.parent), None)
        if top is not None and top.name.startswith(partial):
            return out.parent
    return None
