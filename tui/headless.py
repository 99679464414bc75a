"""The headless front-end of `lmcockpit --run`: a live progress line on a terminal, plain lines when piped.

It drives the same engine process, through the same protocol, as the cockpit."""

from __future__ import annotations

import os
import signal
import sys
import time

from rich.console import Console
from rich.live import Live
from rich.text import Text

from ..core import protocol as P
from ..core.config import NotifyConfig
from ..core.hardware.telemetry import Reading, Telemetry, find_gpu, run_gpu_indices
from ..core.process.child import eval_line
from ..core.process.notify import Announcer, Notifier
from ..core.process.runner import EngineProcess
from ..core.process.stall import StallWatch
from .formatting import DASH, bar, fmt_count, fmt_duration
from ..core.run import lineage
from ..core.run.state import RunState
from .usage import new_console

EXIT_CODES = {P.FINISHED: 0, P.ABORTED: 0, P.INTERRUPTED: 130, P.FAILED: 1}


def progress_line(v: RunState, reading: Reading | None, gpu_index: int | None = 0) -> str:
    """`gpu_index`: the NVML index of the run's (first) GPU; None for a run on the CPU."""
    if v.state == P.PREPARING or v.max_steps == 0:
        p = v.progress
        if p is None:
            return "Preparing data…"
        if p.total:
            amount = (f"{p.done / 1e6:.1f}/{p.total / 1e6:.1f} MB" if p.unit == "bytes"
                      else f"{p.done:,}/{p.total:,} {p.unit}")
            return f"Preparing data: {p.phase} [{bar(p.done / p.total)}] {100 * p.done / p.total:.0f}% ({amount})"
        return f"Preparing data: {p.phase}…"
    if v.state == P.COMPILING:
        return f"Compiling the model (torch.compile)… {fmt_duration(v.elapsed)}"
    gpu = find_gpu(reading, gpu_index) if gpu_index is not None else None
    vram = gpu is not None and gpu.mem_used is not None and gpu.mem_total is not None
    frac = v.step / v.max_steps if v.max_steps else 0.0
    head = f"step {v.step}/{v.max_steps} [{bar(frac, 10)}] {100 * frac:.0f}%"
    if v.state not in (P.RUNNING, P.COMPILING):  # paused, evaluating, ended: said up front
        head += f" {v.state.upper()}"
    # most useful first, so a narrow terminal that cuts the line keeps step, loss, ETA and tok/s;
    # the rest only when there is a value to show (a CPU run has no VRAM, GPU or MFU)
    fields = [
        head,
        f"loss {v.loss:.4f}" if v.loss is not None else f"loss {DASH}",
        f"ETA {fmt_duration(v.eta)}" if v.eta is not None else f"ETA {DASH}",
        f"{fmt_count(v.tokens_per_s)} tok/s" if v.tokens_per_s else f"{DASH} tok/s",
        f"{v.steps_per_s:.2f} step/s" if v.steps_per_s else "",
        f"VRAM {gpu.mem_used / 1e9:.1f}/{gpu.mem_total / 1e9:.1f}GB" if vram else "",
        f"GPU {gpu.util:.0f}%" if gpu and gpu.util is not None else "",
        f"MFU {100 * v.mfu:.0f}%" if v.mfu is not None else "",
    ]
    return " | ".join(f for f in fields if f)


def step_line(ev: P.StepMetrics, v: RunState) -> str:
    mfu = f"{100 * ev.mfu:.1f}%" if ev.mfu is not None else DASH
    eta = fmt_duration(v.eta) if v.eta is not None else DASH
    return (f"step {ev.step}/{v.max_steps} | loss {ev.loss:.4f} | lr {ev.lr:.2e} | grad norm {ev.grad_norm:.3f} | "
            f"{fmt_count(ev.tokens_per_s)} tok/s | {1000 * ev.dt:.0f} ms/step | MFU {mfu} | ETA {eta}")


def fmt_real(value: float | None, places: int = 4) -> str:
    return f"{value:.{places}f}" if value is not None else DASH


class Headless:
    def __init__(self, engine: EngineProcess, log_every: int, console: Console | None = None,
                 notify: NotifyConfig | None = None, run_name: str = ""):
        self.engine = engine
        self.notify = notify or NotifyConfig()
        self.view = RunState()  # the run as its events make it: what the line, the watch and the word read
        self.word = Announcer(Notifier(self.notify, run_name, log=self.say), self.view)  # run_name: its folder's
        self.console = console or new_console()
        self.errors = new_console(stderr=True)
        self.interactive = self.console.is_terminal
        self.console.on_broken_pipe = self._output_gone
        self.log_every = log_every
        self.telemetry = Telemetry()
        self.reading: Reading | None = None
        self.read_at = 0.0
        self.interrupts = 0
        self.devices: tuple[str, ...] | None = None  # this node's devices, once RunStarted names them
        self.device_uuids: tuple[str, ...] = ()  # theirs, where the engine sent them
        self._last_progress_print = 0.0
        self.eval_said = ""  # the last evaluation's line as printed here: the engine's copy follows it

    # ----------------------------------------------------------------------------- signals
    def _on_signal(self, signum, frame) -> None:
        self.interrupts += 1
        if self.interrupts == 1:
            self.engine.send(P.Abort(save=True, interrupted=True))
            if self.view.state == P.PREPARING:
                # Heard at the data's next progress tick, or once the model is built.
                self.say(f"{signal.Signals(signum).name}: stopping before the first step; the data prepared so "
                         "far is kept for the next run (Ctrl-C again to stop at once)")
            else:
                self.say(f"{signal.Signals(signum).name}: finishing this step and writing a checkpoint "
                         "(Ctrl-C again to stop at once)")
        elif signum == signal.SIGINT:
            # The checkpoint being written (if any) is in a temporary folder: killing the engine
            # now leaves the previous checkpoint untouched.
            self.engine.kill()
            self.say("stopped at once; the last complete checkpoint is intact")
            raise KeyboardInterrupt

    def say(self, text: str) -> None:
        self.console.print(Text(text))

    def _output_gone(self) -> None:
        """Rich's answer to a closed stdout (`| head`) is SystemExit(1) on the spot, leaving the engine
        to notice a vanished front-end. Treated instead as a hang-up: stop with a checkpoint, in
        order, and exit 130; what is left to say has nowhere to go."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        if self.interrupts == 0:
            self.interrupts = 1
            self.engine.send(P.Abort(save=True, interrupted=True))

    # -------------------------------------------------------------------------------- loop
    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            # Started with SIGHUP ignored (`nohup lmcockpit --run ... &`): a hang-up is to change
            # nothing, here or in the engine, which inherits the same disposition.
            if not (sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN):
                signal.signal(sig, self._on_signal)
        self.engine.start()
        try:
            if self.interactive:
                with Live(Text(""), console=self.console, refresh_per_second=4, transient=True) as live:
                    self._loop(lambda: live.update(Text(self.status_line())))
            else:
                self._loop(lambda: None)
        except KeyboardInterrupt:
            self.engine.join(timeout=10)
            return 130
        return self._finish()

    def status_line(self) -> str:
        """The live progress line: the run's own GPU's figures from the latest reading."""
        reading = self._telemetry()
        return progress_line(self.view, reading, self.gpu_index(reading))

    def gpu_index(self, reading: Reading | None) -> int | None:
        """The NVML index of the run's first GPU (the first GPU until RunStarted names it); None for
        a run on the CPU. Looked up in each reading: a device's UUID finds its GPU among NVML's."""
        if self.devices is None:
            return 0
        # the engine inherits our environment: its CUDA numbering is ours
        gpus = run_gpu_indices(self.devices, os.environ.get("CUDA_VISIBLE_DEVICES"), self.device_uuids,
                               reading.gpus if reading else [])
        return gpus[0] if gpus else None

    def _telemetry(self) -> Reading | None:
        now = time.monotonic()
        if now - self.read_at >= 1.0:
            self.reading, self.read_at = self.telemetry.read(), now
        return self.reading

    def _loop(self, redraw) -> None:
        watch = StallWatch(self.notify.stall_after, self.view)
        while not self.engine.done:
            ev = self.engine.poll(timeout=0.25)
            if ev is not None:
                if back := watch.heard():  # the state the stall hid, given back
                    self.say(back)
                    self.view.apply(P.StateChanged(watch.state))
                self.view.apply(ev)
                self._print_event(ev)
                self.word.heard(ev)
            elif stalled := watch.check():
                self.say(stalled)
                self.view.apply(P.StateChanged(P.STALLED, watch.detail))
                self.word.stalled(watch.detail)
            redraw()
        self.engine.join(timeout=30)

    def _print_event(self, ev: object) -> None:
        if isinstance(ev, P.RunStarted):
            self.devices, self.device_uuids = ev.devices or (ev.device,), ev.device_uuids
        elif isinstance(ev, P.LogLine) and not ev.text.startswith(P.FAILED_LINE):  # _finish says it once
            if ev.text == self.eval_said:  # said already, with the target's forecast
                self.eval_said = ""
            else:
                self.say(ev.text)
        elif isinstance(ev, P.StepMetrics):
            last = ev.step == self.view.max_steps
            if not self.interactive and (ev.step % self.log_every == 0 or ev.step == 1 or last):
                self.say(step_line(ev, self.view))
        elif isinstance(ev, P.EvalMetrics):
            line = self.eval_said = eval_line(ev)
            if (ev.val_loss is not None or ev.tasks) and (ahead := self.view.forecast) is not None:
                line += f" | target {ahead.short(self.view.cost_per_hour)}"
            self.say(line)
        elif isinstance(ev, P.Progress) and not self.interactive:
            now = time.monotonic()
            if now - self._last_progress_print >= 5 or (ev.total and ev.done == ev.total):
                self._last_progress_print = now
                self.say(progress_line(self.view, None))
        elif isinstance(ev, P.StateChanged) and ev.state == P.COMPILING and not self.interactive:
            self.say("compiling the model (torch.compile); the first step waits for it")

    def _finish(self) -> int:
        v, state = self.view, self.engine.final_state or P.FAILED
        failure = self.engine.failure
        self.word.ended(state, failure)  # the last word, flushed within its bound before the lines below
        if failure is not None and failure.user_error:
            self.errors.print(Text(f"error: {failure.message}"), style="bold red")
            return 2
        if failure is not None:
            self.errors.print(Text(f"run failed: {failure.message}"), style="bold red")
        elif state == P.FINISHED and v.max_steps == 0:  # never heard from rank 0: it runs on another machine
            self.say("this machine's processes finished; rank 0's machine reports the run")
        elif state == P.FINISHED:
            summary = f"finished {v.step} steps"
            if v.first_loss is not None and v.loss is not None:
                summary += f": loss {v.first_loss:.3f} → {v.loss:.3f}"
            if v.last_eval:
                summary += f", val loss {v.last_eval.val_loss:.3f} ({fmt_real(v.last_eval.val_bpb, 3)} bits/byte)"
            if (ahead := v.forecast) is not None:  # the figure a run with a target was run for
                summary += f"; target {ahead.short()}"
            if gains := lineage.gains_text(v.tasks):  # a fine-tuning run's: its base's score at step 0, then its own
                summary += f"; {gains}"
            if base := lineage.of_config(v.config):
                summary += f"; {base}"
            self.console.print(Text(summary), style="bold green")
        else:
            self.say(f"{state} at step {v.step}")
        if anatomy := v.history.anatomy.line():  # where the engine's time went (run/anatomy.py)
            self.say(f"time: {anatomy}")
        if v.run_dir:
            self.say(f"run folder: {v.run_dir}")
            if v.last_checkpoint:
                self.say(f"last checkpoint: {v.last_checkpoint}")
                self.say(f"chat with it:    lmcockpit chat {v.run_dir}")
                if state == P.INTERRUPTED:
                    self.say(f"resume with:     lmcockpit --run --resume {v.run_dir}")
        return EXIT_CODES.get(state, 1)
