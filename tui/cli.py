# PYTHON_ARGCOMPLETE_OK (argcomplete's global completion looks for this line)
"""The `lmcockpit` command.

Exit codes everywhere: 0 done, 1 the run failed, 2 usage or input error (one clear message, no
traceback), 130 interrupted. This module never imports torch: the engine process does. Its named
commands (chat, export, ...) are listed in commands.py and live in modules of their own; this
module is the bare command (the cockpit and `--run`) and the dispatch to them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .. import __version__
from ..core.config import Config, ConfigError, TrainingConfig, load_config, shipped_presets
from ..core.process import live
from ..core.process.rendezvous import Rendezvous
from ..core.run.folder import create_run_dir
from ..core.run.resume import plan_resume
from . import completers
from .commands import COMMANDS, GROUPS, nearest, similarity
from .runplan import RunPlan, check_before_start, discard_unstarted_run
from .usage import Parser, UsageError, error

# The bare command's two forms, listed in `--help` under "train" before that group's commands.
TRAIN_FORMS = {"[PRESET]": "the cockpit; with PRESET, that run starts at once",
               "PRESET --detach": "start that run in the background (lmcockpit attach)",
               "--run PRESET": "train headless: a live line, or plain lines when piped"}

EXAMPLES = """\
examples:
  lmcockpit --run cpu                            # train headless (CPU is fine)
  lmcockpit 4090 --set training.max_steps=2000   # the cockpit, starting a run
  lmcockpit chat runs/cpu-20261123-084716        # sample from what it learned

a loss spike (training.on_spike, default "{t.on_spike}": said, and training goes on):
"rollback" goes back to the last checkpoint at the learning rate times
spike_lr_factor ({t.spike_lr_factor:g}) for spike_lr_steps ({t.spike_lr_steps}) steps, cut again at each
further rollback, at most max_rollbacks ({t.max_rollbacks}); a run that then stops keeps
the checkpoint before the spike as its latest and says how to resume
(README: Spikes, stalls, and when the target is reached)""".format(t=TrainingConfig())


def overview() -> str:
    """The commands by group, each with its one line: the first thing `--help` shows."""
    rows = {group: [] for group in GROUPS}
    rows["train"] += TRAIN_FORMS.items()
    for command in COMMANDS.values():
        rows[command.group].append((command.name, command.summary))
    return "\n".join(f"{group}:\n" + "\n".join(f"  {name:<14}  {summary}" for name, summary in items)
                     for group, items in rows.items() if items)


def build_parser() -> argparse.ArgumentParser:
    # Groups in the order --help prints them: the default "options" group would come first.
    p = Parser(prog="lmcockpit", add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter,
               usage="%(prog)s [PRESET] [training flags]\n       %(prog)s --run [PRESET] [training flags]\n"
                     "       %(prog)s COMMAND [ARGS]   (lmcockpit help COMMAND: its own help)",
               description="Pretrain language models from scratch, from a terminal cockpit.\n\n" + overview(),
               epilog=EXAMPLES)
    t = p.add_argument_group("training flags (the cockpit and --run)")
    t.add_argument("preset", metavar="PRESET", nargs="?",
                   help="open the cockpit and start this preset at once (path or shipped name)"
                   ).completer = completers.commands_and_presets
    t.add_argument("--run", metavar="PRESET", nargs="?", const="",
                   help="train headless: a preset TOML path or a shipped preset name (none with --resume)"
                   ).completer = completers.presets
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, VALUE in TOML syntax (repeatable): --set training.max_steps=200"
                   ).completer = completers.config_keys
    t.add_argument("--out", metavar="DIR", help="run folder (default: runs/<preset>-<timestamp>)"
                   ).completer = completers.directories
    t.add_argument("--resume", metavar="PATH",
                   help="continue a run folder in place (from its latest checkpoint), or a checkpoint folder "
                        "into a new run folder").completer = completers.run_folders
    t.add_argument("--from", dest="from_", metavar="RUN_OR_CHECKPOINT",
                   help="fine-tune: a new run whose weights start from this run folder's latest checkpoint (or "
                        "this checkpoint folder's), with a chat preset (docs/chat.md)").completer = completers.run_folders
    t.add_argument("--gpu", metavar="N", type=int, help="train on GPU N (same as --set hardware.device=\"cuda:N\")")
    t.add_argument("--detach", action="store_true",
                   help="start the run in the background, with no cockpit: `lmcockpit attach` shows it")
    d = p.add_argument_group("several processes (torchrun)")
    d.add_argument("--nproc", metavar="N", type=int,
                   help="train with N processes on this machine, one per GPU, through torchrun (same as --set "
                        "distributed.nproc=N; 1 still goes through torchrun); --set distributed.strategy=\"fsdp\" "
                        "shards the model")
    d.add_argument("--nnodes", metavar="M", type=int, help="machines taking part (same as --set distributed.nnodes=M)")
    d.add_argument("--node-rank", metavar="K", type=int, default=0, help="this machine's rank, 0 to M-1")
    d.add_argument("--rdzv-endpoint", metavar="HOST:PORT", default="",
                   help="where the machines meet (torchrun's rendezvous; node 0's address)")
    d.add_argument("--rdzv-id", metavar="ID", default="lmcockpit", help="the run's id, the same on every machine")
    d.add_argument("--rdzv-backend", metavar="NAME", default="c10d", help="torchrun's rendezvous backend (c10d, static, etcd)")
    o = p.add_argument_group("other")
    o.add_argument("-h", "--help", action="help", help="show this help and exit")
    o.add_argument("--version", action="version", version=f"lmcockpit {__version__}")
    return p


def overrides_of(args: argparse.Namespace) -> list[str]:
    out = list(args.overrides)
    for flag, value, key in (("--gpu", args.gpu, "hardware.device"), ("--nproc", args.nproc, "distributed.nproc"),
                             ("--nnodes", args.nnodes, "distributed.nnodes")):
        if value is None:
            continue
        if value < (0 if flag == "--gpu" else 1):
            raise UsageError(f"{flag} {value}: expected {'a GPU index, 0 or more' if flag == '--gpu' else '1 or more'}")
        out.append(f'{key}="cuda:{value}"' if flag == "--gpu" else f"{key}={value}")
    return out


def rendezvous_of(args: argparse.Namespace) -> Rendezvous | None:
    """torchrun's settings when asked for by a flag; None leaves it to the config (several
    processes → torchrun, one → the engine alone)."""
    if args.nproc is None and args.nnodes is None and not args.rdzv_endpoint:
        return None
    return Rendezvous(args.rdzv_endpoint, args.node_rank, args.rdzv_id, args.rdzv_backend)


def plan_run(args: argparse.Namespace, preset: str | None) -> RunPlan:
    if args.resume:
        if preset:
            raise UsageError("--resume continues with the checkpoint's own config: drop the preset "
                             "(change the step budget or cadence with --set)")
        if args.from_:
            raise UsageError("--from starts a new fine-tuning run and --resume continues one (its base is in its "
                             "config): give one")
        plan = plan_resume(args.resume, overrides_of(args), args.out, check=check_before_start)
        cfg, run_dir, resume_from, title = plan.cfg, plan.run_dir, plan.checkpoint, plan.run_dir.name
        in_place = plan.in_place
    else:
        if not preset:
            raise UsageError("--run needs a preset (a TOML path or a shipped name such as `cpu`)")
        cfg, path = load_config(preset, overrides_of(args))
        cfg = fine_tuning(cfg, args.from_, Path(path).name)
        rendezvous = rendezvous_of(args)
        if rendezvous is not None:  # before a run folder exists for a run that cannot start
            rendezvous.check(cfg)
        run_dir = create_run_dir(cfg, Path(path).stem, args.out, check=check_before_start)
        resume_from, title = None, Path(path).stem
        in_place = False
    return RunPlan(cfg, run_dir, resume_from, title, rendezvous_of(args), in_place)


def fine_tuning(cfg: Config, from_: str | None, preset: str) -> Config:
    """A chat preset's run starts from a base model (--from, or training.from_checkpoint set); a
    pretraining preset's, from fresh weights."""
    spec = from_ or cfg.training.from_checkpoint
    if spec:
        from ..core.data.base_model import plan_from  # here: conversations' modules, which a pretraining run needs not

        return plan_from(cfg, spec)
    if cfg.data.format == "chat":
        raise UsageError(f"{preset} fine-tunes a base model on conversations: give --from RUN_OR_CHECKPOINT "
                         "(a run folder or a checkpoint folder)")
    return cfg


def cmd_run(args: argparse.Namespace) -> int:
    from ..core.process.runner import EngineProcess
    from .headless import Headless

    plan = plan_run(args, args.run or args.preset)
    live.forget(plan.run_dir)  # a run whose host died, resumed here: no longer listed as dead
    engine = EngineProcess(plan.cfg, plan.run_dir, plan.resume_from, plan.rendezvous)
    code = Headless(engine, plan.cfg.training.log_every, notify=plan.cfg.notify, run_name=plan.run_dir.name).run()
    if code == 2:
        discard_unstarted_run(plan)
    return code


def cmd_cockpit(args: argparse.Namespace) -> int:
    from .app import CockpitApp

    start = None
    if args.preset or args.resume:
        start = plan_run(args, args.preset)
    if args.detach:
        return detach_run(start)
    app = CockpitApp(start)
    app.run()  # runs left training go on: each has a host of its own
    return app.exit_code


def detach_run(plan: RunPlan | None) -> int:
    from . import detach

    if plan is None:
        raise UsageError("--detach starts a run: give a preset (or --resume RUN)")
    return detach.start_detached(plan)


def refuse_mistyped_command(word: str) -> None:
    """`lmcockpit chta` is `chat` mistyped, not a preset file that is not there. A word is taken
    for a preset when it names a shipped preset or anything on disk, or reads as a path (a
    separator, a `.toml` suffix, a leading `.` or `~`); a bare word otherwise is a mistyped
    command when some command is closer to it than any shipped preset is (a near preset gets
    the preset's own "did you mean")."""
    if word.startswith("-") or "/" in word or os.sep in word or word.endswith(".toml") or word.startswith((".", "~")):
        return
    shipped = shipped_presets()
    if word in shipped or Path(word).exists():
        return
    if word in COMMANDS:
        raise UsageError(f"{word} is a command: it goes first, as in `lmcockpit {word} --help`")
    command, preset = nearest(word), nearest(word, shipped)
    if command and not (preset and similarity(word, preset) >= similarity(word, command)):
        raise UsageError(f"lmcockpit {word}: no such command; did you mean {command}?")


def main(argv: list[str] | None = None) -> int:
    if "_ARGCOMPLETE" in os.environ:  # a shell asking for completions (see completion.py): answers and exits
        from .commands.completion import complete

        complete(build_parser)
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in COMMANDS:
            return COMMANDS[argv[0]].main(argv[1:])
        if argv:  # before parsing: `lmcockpit chta RUN` would otherwise fail on RUN
            refuse_mistyped_command(argv[0])
        args = build_parser().parse_args(argv)
        if args.preset:
            refuse_mistyped_command(args.preset)
        if args.run and args.preset:
            raise UsageError(f"give the preset once: either `lmcockpit {args.preset}` or `--run {args.run}`")
        if args.run is not None:
            if args.detach:
                raise UsageError("--run trains in this terminal and --detach in the background: give one")
            return cmd_run(args)
        return cmd_cockpit(args)
    except (UsageError, ConfigError) as e:
        return error(str(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
