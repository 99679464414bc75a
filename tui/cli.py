"""The `lmcockpit` command.

Exit codes everywhere: 0 done, 1 the run failed, 2 usage or input error (one clear message, no
traceback), 130 interrupted. This module never imports torch: the engine process does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.text import Text

from lmcockpit import __version__
from lmcockpit.core.config import ConfigError, load_config
from lmcockpit.core.resume import plan_resume
from lmcockpit.core.runfolder import create_run_dir


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """argparse whose mistakes become our one-line `error:` and exit 2, for every subcommand."""

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="lmcockpit", description="Pretrain language models from scratch, from a terminal cockpit.",
                epilog="Shipped presets: run `lmcockpit --run cpu` to train the embedded default.")
    p.add_argument("preset", nargs="?", help="open the cockpit and start this preset at once (path or shipped name)")
    p.add_argument("--run", metavar="PRESET", nargs="?", const="",
                   help="train headless: a preset TOML path or a shipped preset name (none with --resume)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, VALUE in TOML syntax (repeatable): --set training.max_steps=200")
    p.add_argument("--out", metavar="DIR", help="run folder (default: runs/<preset>-<timestamp>)")
    p.add_argument("--resume", metavar="PATH",
                   help="continue a run folder in place (from its latest checkpoint), or a checkpoint folder "
                        "into a new run folder")
    p.add_argument("--gpu", metavar="N", type=int, help="train on GPU N (same as --set hardware.device=\"cuda:N\")")
    p.add_argument("--version", action="version", version=f"lmcockpit {__version__}")
    return p


def error(message: str) -> int:
    Console(stderr=True, highlight=False, soft_wrap=True).print(Text(f"error: {message}"), style="bold red")
    return 2


def overrides_of(args: argparse.Namespace) -> list[str]:
    if args.gpu is None:
        return args.overrides
    if args.gpu < 0:
        raise UsageError(f"--gpu {args.gpu}: expected a GPU index, 0 or more")
    return [*args.overrides, f'hardware.device="cuda:{args.gpu}"']


def plan_run(args: argparse.Namespace, preset: str | None):
    """(config, run folder, checkpoint to resume from or None, title) from the run options."""
    if args.resume:
        if preset:
            raise UsageError("--resume continues with the checkpoint's own config: drop the preset "
                             "(change the step budget or cadence with --set)")
        plan = plan_resume(args.resume, overrides_of(args), args.out)
        return plan.cfg, plan.run_dir, plan.checkpoint, plan.run_dir.name
    if not preset:
        raise UsageError("--run needs a preset (a TOML path or a shipped name such as `cpu`)")
    cfg, path = load_config(preset, overrides_of(args))
    return cfg, create_run_dir(cfg, Path(path).stem, args.out), None, Path(path).stem


def cmd_run(args: argparse.Namespace) -> int:
    from lmcockpit.core.runner import EngineProcess
    from lmcockpit.tui.headless import Headless

    cfg, run_dir, resume_from, _ = plan_run(args, args.run or args.preset)
    return Headless(EngineProcess(cfg, run_dir, resume_from), cfg.training.log_every).run()


def cmd_cockpit(args: argparse.Namespace) -> int:
    from lmcockpit.tui.app import CockpitApp, RunRequest

    start = None
    if args.preset or args.resume:
        start = RunRequest(*plan_run(args, args.preset))
    app = CockpitApp(start)
    try:
        app.run()
    finally:
        app.stop_engines()
    return app.return_code or 0


# Subcommands live in modules of their own, each with `main(argv) -> int` and the same exit codes.
SUBCOMMANDS = {"chat": "lmcockpit.tui.chat", "export": "lmcockpit.tui.export",
               "presets": "lmcockpit.tui.presets", "doctor": "lmcockpit.tui.doctor"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        try:
            module = importlib.import_module(SUBCOMMANDS[argv[0]])
        except ModuleNotFoundError:
            return error(f"`lmcockpit {argv[0]}` is not built yet")
        return module.main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
        if args.run and args.preset:
            raise UsageError(f"give the preset once: either `lmcockpit {args.preset}` or `--run {args.run}`")
        if args.run is not None:
            return cmd_run(args)
        return cmd_cockpit(args)
    except (UsageError, ConfigError) as e:
        return error(str(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
