"""Long runs (issue #43): the cockpit's memory, first frame and redraws against how long the run has gone on.

    python bench/history.py [--sizes 10000,100000,1000000] [--reference 1000] [--watch 30]
                            [--churn-seconds 3600] [--skip compare,churn] [--keep] [--no-record]

Everything goes through the product's command line, as a user meets it, so the figures mean the
same before and after a change to how the cockpit holds a run's history. For the reference size
(a short history) and then each of `--sizes`, in one run, side by side:

* a run folder of N steps in the engine's own row format: a tiny real run is trained once
  (`lmcockpit --run debug --set ...`), then copied with a synthetic history of N steps written as
  the trainer writes it (protocol events through core/run/rows.py: a step row every step,
  with MFU and allocator memory as a GPU run has them; an evaluation every 250 steps; a checkpoint
  row every 1,000; a few loss spikes; a loss curve with noise) and its checkpoint renamed to step N,
  so that `lmcockpit --resume RUN --detach` continues it from step N in the background: the run
  host that serves the attach, and the run training beside every measurement (it takes what the
  two cores give it, as a CPU run does);
* attach to first frame: `lmcockpit attach RUN` in a tmux pane of 120x40, the pane captured
  every 0.2 s until the top bar shows a live step (past N, so past the history) and the loss
  chart is drawn over the whole history (its x axis from at most 5 % of N to at least 95 % of
  it); seconds from the launch. Twice: the first attach finds the folder as written here, its
  history in metrics.jsonl alone (as a run from before a change of what the product keeps beside
  it); the second finds whatever the first left (a summary a reader writes, say), as a run the
  product trained itself would have it;
* the viewer's RSS: its peak (the kernel's high-water mark, VmHWM, of the attach process), at
  each attach; and, for the second, its steady figure (psutil every 0.2 s, the median over the
  watching period);
* the viewer's CPU while watching: its user+system time over `--watch` seconds after the second
  attach's first frame, as a share of one core; the step on the screen must have moved meanwhile,
  and the live run's own pace then (from its metrics.jsonl) is printed beside it;
* `lmcockpit compare` of ten such runs (each its own noise and learning rate) on a terminal (a
  pseudo-terminal, so it prints its table), first and again (as for attach), then with `--png`
  (piped): wall time and peak RSS (the child's own rusage, wait4);
* churn: against the run host of the largest size (`--churn-size`), attach and detach for
  `--churn-seconds` (the product's API in a child process, as `lmcockpit attach` does it: a
  RunViewer, its first event, close); the host's RSS and open descriptors (/proc/PID/fd) at start
  and end, and the cycles done.

Each figure is printed for each size, with its ratio to the reference's. Targets from the issue, at
1M steps on 2 cores with a run training: first frame <= 3 s, viewer < 150 MB, watching <= 5 % of a
core, compare of 10 runs <= 10 s and <= 500 MB. Run folders go in a temporary folder, removed at
the end unless --keep; every host started here is stopped (SIGTERM: it checkpoints and ends, as the
host is made to; SIGKILL of its process group past a grace), Ctrl-C included. The token cache and
the registry of live runs are this benchmark's own (XDG_CACHE_HOME, XDG_STATE_HOME in the folder).
The results go into bench/RESULTS.md unless --no-record.

The commands run whichever lmcockpit `python -m lmcockpit.tui.cli` imports from a neutral folder:
this checkout's, or a copy of another version put first on PYTHONPATH. The "before" of a change:

    mkdir -p /tmp/before && git archive --prefix=lmcockpit/ COMMIT core tui presets | tar -x -C /tmp/before
    git show COMMIT:lmcockpit/__init__.py > /tmp/before/lmcockpit/__init__.py
    PYTHONPATH=/tmp/before python bench/history.py ...
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import pty
import random
import re
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import tomllib
from pathlib import Path

import psutil
import tomli_w

from lmcockpit.core import protocol as P
from lmcockpit.core.run.rows import line_of

sys.path.insert(0, str(Path(__file__).resolve().parent))  # absolute: main() changes folder
from machine import record

CLI = [sys.executable, "-m", "lmcockpit.tui.cli"]
# The tiny real run every folder is made from: the debug preset, a larger batch so that the live
# run takes a step in tens of milliseconds, precision pinned (no probe), no tasks, no samples.
TEMPLATE_STEPS = 12
TEMPLATE = [f"training.max_steps={TEMPLATE_STEPS}", "training.micro_batch_size=32", "eval.every=250",
            "eval.batches=2", "sample.prompts=[]", "checkpoint.keep=1", 'hardware.device="cpu"', "eval.tasks=[]",
            'training.precision="fp32"']
EVAL_EVERY, CHECKPOINT_EVERY, SPIKES = 250, 1000, 5
PANE = (120, 40)
STEP_IN_TOP_BAR = re.compile(r"step (\d+)/(\d+)")
SETTLE = 2.0  # seconds after a first frame at which an attach that is not watched has its peak RSS read


def flags(overrides: list[str]) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


# ------------------------------------------------------------------------------ run folders
def train_template(out: Path) -> Path:
    proc = subprocess.run([*CLI, "--run", "debug", *flags(TEMPLATE), "--out", str(out)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.exit(f"the template run failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return out


def history_rows(n: int, tokens_per_step: int, run_dir: Path, seed: int, first: float, last: float):
    """The lines of a metrics.jsonl of `n` steps, as the trainer writes them: protocol events
    through core/run/rows.py, each dated on the run's own clock."""
    rng = random.Random(seed)
    k = max(50.0, n / 200)
    span = 1 - (1 + n / k) ** -0.5
    peak_lr, warmup = 0.01, min(2000, n // 20 + 1)
    dt0 = 0.25  # seconds a step: a GPU run's pace, for the rows' time, dt, tokens/s and MFU
    t = time.time() - 600 - n * dt0 * 1.03 - 2.0 * (n // EVAL_EVERY) - n // CHECKPOINT_EVERY
    spikes = set(rng.sample(range(n // 10, n), SPIKES)) if n >= 10 * SPIKES else set()
    mem0 = 9_000_000_000
    for step in range(1, n + 1):
        base = last + (first - last) * (1 - (1 - (1 + step / k) ** -0.5) / span)
        loss = base * (1 + rng.gauss(0, 0.02))
        lr = peak_lr * (step / warmup if step <= warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / n)))
        dt = dt0 * (1 + abs(rng.gauss(0, 0.03)))
        t += dt
        grad_norm = abs(rng.gauss(0.4, 0.08))
        if step in spikes:
            yield line_of(P.SpikeSeen(step, loss * 3, "warn", base, rng.uniform(6, 9), grad_norm * 5,
                                      rng.uniform(6, 9)), t)
            loss, grad_norm = loss * 3, grad_norm * 5
        mem = {"allocated": mem0 + rng.randrange(1 << 20), "reserved": mem0 + (1 << 30), "peak": mem0 + (1 << 29)}
        yield line_of(P.StepMetrics(step, loss, lr, grad_norm, tokens_per_step / dt, 0.42 * dt0 / dt, dt,
                                    step * tokens_per_step, mem), t)
        if step % EVAL_EVERY == 0 or step == n:
            t += 2.0
            val = base * 1.02 + rng.gauss(0, 0.005)
            yield line_of(P.EvalMetrics(step, val, val / math.log(2) / 1.86), t)
        if step % CHECKPOINT_EVERY == 0 or step == n:
            t += 1.0
            yield line_of(P.CheckpointWritten(step, str(run_dir / "checkpoints" / f"step_{step:06d}")), t)


def make_run(template: Path, dest: Path, n: int, seed: int = 0, lr_scale: float = 1.0) -> Path:
    """A copy of the template run that has trained `n` steps: its history written afresh, its
    checkpoint renamed to step `n` (state.json's step and tokens with it), its config's budget `n`.
    `lr_scale`: the learning rate it says it ran with (compare shows the settings runs differ in)."""
    dest.mkdir(parents=True)
    for name in ("config.toml", "tokenizer"):
        src = template / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dest / name)
    config = tomllib.loads((template / "config.toml").read_text())
    config["training"]["max_steps"] = n
    config["optimizer"]["lr"] *= lr_scale
    (dest / "config.toml").write_text("# resolved lmcockpit config\n" + tomli_w.dumps(config))
    tokens_per_step = config["training"]["micro_batch_size"] * config["training"]["grad_accum_steps"] * \
        config["training"]["seq_len"]
    (src_ckpt,) = (template / "checkpoints").glob("step_*")
    ckpt = dest / "checkpoints" / f"step_{n:06d}"
    shutil.copytree(src_ckpt, ckpt)
    state = json.loads((ckpt / "state.json").read_text())
    state.update(step=n, tokens_seen=n * tokens_per_step)
    (ckpt / "state.json").write_text(json.dumps(state, indent=1))
    (dest / "checkpoints" / "latest").write_text(ckpt.name)
    rows = [json.loads(line) for line in (template / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["kind"] == "step"]
    with open(dest / "metrics.jsonl", "wb") as fh:
        fh.writelines(history_rows(n, tokens_per_step, dest.resolve(), seed, losses[0], losses[-1]))
    with open(dest / "train.log", "w", encoding="utf-8") as fh:
        fh.write((template / "train.log").read_text())
        fh.writelines(f"checkpoint: step {s} written to {dest.resolve()}/checkpoints/step_{s:06d}\n"
                      for s in range(CHECKPOINT_EVERY, n + 1, CHECKPOINT_EVERY))
    return dest


# ------------------------------------------------------------------------------ the live run
class LiveRun:
    """A run folder continued in the background (`lmcockpit --resume RUN --detach`) until `stop`."""

    def __init__(self, run: Path, n: int):
        self.run, self.n, self.host = run, n, None
        try:
            proc = subprocess.run([*CLI, "--resume", str(run), "--detach", "--set",
                                   f"training.max_steps={n + 10_000_000}"], capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"--resume --detach failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
            self.find_host()
            if self.host is None:
                raise RuntimeError(f"{run}: no live.json after --resume --detach")
        except BaseException:  # interrupted while it waited: the host may serve already, and is stopped
            self.find_host()
            self.stop()
            raise

    def find_host(self) -> None:
        """The host's process, from the live.json it writes once it serves."""
        with contextlib.suppress(OSError, ValueError, KeyError, psutil.Error):
            self.host = psutil.Process(int(json.loads((self.run / "live.json").read_text())["pid"]))

    def last_step(self) -> int:
        """The last step the live run wrote to its metrics.jsonl (read from the file's end)."""
        with open(self.run / "metrics.jsonl", "rb") as fh:
            fh.seek(max(0, fh.seek(0, 2) - 8192))
            steps = re.findall(rb'"kind": "step", "time": [0-9.]+, "step": (\d+)', fh.read())
        return int(steps[-1]) if steps else 0

    def stop(self) -> None:
        """SIGTERM, as the host is made to be stopped (a checkpoint, then it ends); its whole
        session killed if it has not ended within a minute."""
        if self.host is None:
            return
        try:
            family = [self.host, *self.host.children(recursive=True)]
            self.host.terminate()
        except psutil.NoSuchProcess:
            return
        _, alive = psutil.wait_procs(family, timeout=60)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        if alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.host.pid, signal.SIGKILL)  # the host leads a session of its own
        self.host = None


# ------------------------------------------------------------------------------ attach
class Pane:
    """`lmcockpit attach RUN` in a tmux pane of its own server (its socket beside the run folder,
    gone with it), PANE columns by rows."""

    def __init__(self, run: Path):
        self.tmux = ["tmux", "-S", str(run.parent / "tmux.sock")]
        self.proc: psutil.Process | None = None
        env = [a for k in ("XDG_CACHE_HOME", "XDG_STATE_HOME", "PYTHONPATH") if k in os.environ
               for a in ("-e", f"{k}={os.environ[k]}")]
        self.t0 = time.perf_counter()
        try:
            subprocess.run([*self.tmux, "-f", "/dev/null", "new-session", "-d", "-s", "bench", "-x", str(PANE[0]),
                            "-y", str(PANE[1]), "-c", os.getcwd(), *env, f"exec {shlex.join([*CLI, 'attach', str(run)])}"],
                           check=True)
            pid = subprocess.run([*self.tmux, "display", "-p", "-t", "bench", "#{pane_pid}"], capture_output=True,
                                 text=True, check=True).stdout
            self.proc = psutil.Process(int(pid))
        except BaseException:
            self.close()
            raise

    def screen(self) -> str:
        return subprocess.run([*self.tmux, "capture-pane", "-p", "-t", "bench"], capture_output=True,
                              text=True).stdout

    def family(self) -> list[psutil.Process]:
        return [self.proc, *self.proc.children(recursive=True)]

    def rss(self) -> int:
        return sum(p.memory_info().rss for p in self.family())

    def cpu(self) -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in self.family()))

    def peak_rss(self) -> int:
        """The kernel's high-water mark of the viewer's RSS (VmHWM), its children's added."""
        total = 0
        for p in self.family():
            status = Path(f"/proc/{p.pid}/status").read_text()
            total += int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) * 1024
        return total

    def close(self) -> None:
        """`d` (detach: the run goes on), then the server goes, whatever is left in it."""
        with contextlib.suppress(psutil.Error, subprocess.SubprocessError, OSError):
            if self.proc is not None and self.proc.is_running():
                subprocess.run([*self.tmux, "send-keys", "-t", "bench", "d"], capture_output=True, timeout=10)
                self.proc.wait(10)
        with contextlib.suppress(psutil.Error):
            if self.proc is not None and self.proc.is_running():
                self.proc.kill()
        subprocess.run([*self.tmux, "kill-server"], capture_output=True)


SUFFIX = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def axis_numbers(text: str) -> list[float]:
    """The numbers of an axis's tick labels: 250000, 250000.0, 2.5e5, 250k and 0.25M alike."""
    return [float(num) * SUFFIX[suffix]
            for num, suffix in re.findall(r"(?<![\w.])(\d+(?:\.\d+)?(?:e[+-]?\d+)?)([kKMBGT]?)(?![\w.])", text)]


def first_frame(screen: str, n: int) -> tuple[int | None, bool]:
    """(the step the top bar shows, whether the loss chart spans the whole history of `n` steps).

    The chart is the one box drawn with square corners; the line under its bottom edge holds its
    x axis's tick labels. Spanning: the ticks, widened by one tick spacing at each end, reach from
    5 % of `n` or less to 95 % of it or more. Ticks may be spread evenly over the data (75187.5) or
    sit on round values inside it (200k ... 1M, where the data start at step 1): the one spacing
    of slack takes both."""
    lines = screen.splitlines()
    shown = next((int(m[1]) for line in lines[:3] if (m := STEP_IN_TOP_BAR.search(line))), None)
    for i, line in enumerate(lines[:-1]):
        start, end = line.find("└"), line.find("┘")
        if start < 0 or end <= start or line[start + 1:end].strip("─┬┴"):
            continue  # not a box's bottom edge
        ticks = sorted(axis_numbers(lines[i + 1][:end + 1]))
        if len(ticks) >= 2:
            spacing = statistics.median(b - a for a, b in zip(ticks, ticks[1:]))
            if ticks[0] - spacing <= 0.05 * n and ticks[-1] + spacing >= 0.95 * n:
                return shown, True
    return shown, False


def attach_once(live: LiveRun, watch: float, timeout: float) -> dict:
    """One `lmcockpit attach`: seconds from its launch to its first frame with the run on it, the
    viewer's peak RSS; with `watch`, also its steady RSS and CPU over that many seconds after the
    first frame (else its peak is read SETTLE seconds after the first frame)."""
    pane = Pane(live.run)
    out: dict = {}
    try:
        screen, frame = "", None
        while time.perf_counter() - pane.t0 < timeout and pane.proc.is_running():
            screen = pane.screen()
            shown, chart = first_frame(screen, live.n)
            if shown is not None and shown > live.n and chart:
                frame = time.perf_counter() - pane.t0
                out.update(first_frame=frame, step_at_frame=shown, screen=screen)
                break
            time.sleep(0.2)
        if frame is None:
            ended = not pane.proc.is_running()
            print(f"no first frame {'(the viewer ended)' if ended else f'within {timeout:.0f} s'}; the pane showed:"
                  f"\n{screen}", file=sys.stderr)
            out.update(first_frame=None, peak_rss=None if ended else pane.peak_rss())
            return out
        if not watch:
            time.sleep(SETTLE)
            out.update(peak_rss=pane.peak_rss())
            return out
        try:
            cpu0, t0, steady = pane.cpu(), time.perf_counter(), []
            step0 = live.last_step()
            while time.perf_counter() - t0 < watch:
                time.sleep(0.2)
                steady.append(pane.rss())
            cpu = pane.cpu() - cpu0
            seconds = time.perf_counter() - t0
            shown, _ = first_frame(pane.screen(), live.n)
        except psutil.NoSuchProcess:
            print("the viewer ended while it was watched", file=sys.stderr)
            return out | {"peak_rss": None}
        out.update(cpu=100 * cpu / seconds, steady_rss=statistics.median(steady or [pane.rss()]), peak_rss=pane.peak_rss(),
                   live_steps_per_s=(live.last_step() - step0) / seconds, redrawn=(shown or 0) > out["step_at_frame"])
        return out
    finally:
        pane.close()


def measure_attach(live: LiveRun, watch: float, timeout: float) -> dict:
    """The first attach to a folder that holds its history as metrics.jsonl alone (a run from
    before a change of what the product keeps beside it, or one whose summary no longer fits),
    then an attach again, with whatever the first left behind, watched for `watch` seconds."""
    return {"first": attach_once(live, 0, timeout), "again": attach_once(live, watch, timeout)}


# ------------------------------------------------------------------------------ compare
def measure_command(cmd: list[str], terminal: bool) -> tuple[float, int, int]:
    """(wall seconds, peak RSS in bytes, exit code) of `cmd`, on a pseudo-terminal of PANE's size
    (the form a person reads) or piped; its peak from its own rusage (wait4)."""
    if terminal:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", PANE[1], PANE[0], 0, 0))
        out = slave
    else:
        master, out = None, subprocess.PIPE
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    if master is not None:
        os.close(slave)
        reader = threading.Thread(target=lambda: _drain_fd(master), daemon=True)
    else:
        reader = threading.Thread(target=proc.stdout.read, daemon=True)
    reader.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:  # interrupted: the command goes too
        proc.kill()
        proc.wait()
        raise
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(10)
    if master is not None:
        os.close(master)
    return wall, usage.ru_maxrss * 1024, proc.returncode


def _drain_fd(fd: int) -> None:
    with contextlib.suppress(OSError):  # EIO once the child has closed the terminal
        while os.read(fd, 65536):
            pass


def measure_compare(runs: list[Path], png: Path) -> dict:
    """`lmcockpit compare` of `runs` on a terminal: first (the folders as written: metrics.jsonl
    alone), again (with whatever the first left behind), then with --png (piped, as a script runs
    it). Each: (wall seconds or None where it failed, peak RSS)."""
    paths = [str(r) for r in runs]
    out = {}
    for form, cmd, terminal in (("first", [*CLI, "compare", *paths], True),
                                ("again", [*CLI, "compare", *paths], True),
                                ("png", [*CLI, "compare", *paths, "--png", str(png)], False)):
        wall, peak, code = measure_command(cmd, terminal)
        out[form] = (wall if code == 0 else None, peak)
        if code != 0:
            print(f"compare ({form}) exited {code}", file=sys.stderr)
    return out


# ------------------------------------------------------------------------------ churn
CHURN = """
import json, sys, time
from pathlib import Path
from lmcockpit.core.process.viewer import NotLive, RunViewer
run, end = Path(sys.argv[1]), time.monotonic() + float(sys.argv[2])
cycles, failures = 0, {}
while time.monotonic() < end:
    try:
        viewer = RunViewer(run)
    except NotLive as e:
        failures[str(e)] = failures.get(str(e), 0) + 1
        time.sleep(0.1)
        continue
    deadline = time.monotonic() + 120
    while viewer.poll(0.2) is None and time.monotonic() < deadline:
        pass  # the first event: the catch-up (history, snapshot) reached this viewer
    viewer.close()
    cycles += 1
print(json.dumps({"cycles": cycles, "failures": failures}))
"""


def host_figures(live: LiveRun) -> tuple[int, int]:
    """The host's RSS and its open descriptors (/proc/PID/fd)."""
    return live.host.memory_info().rss, len(os.listdir(f"/proc/{live.host.pid}/fd"))


def measure_churn(live: LiveRun, seconds: float) -> dict:
    """Attach and detach against `live`'s host for `seconds`: its RSS and descriptors before and after."""
    rss0, fds0 = host_figures(live)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHURN, str(live.run), str(seconds)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the churn failed ({proc.returncode}): {proc.stderr[-2000:]}")
    time.sleep(2)  # the host's threads notice the last viewer's going
    rss1, fds1 = host_figures(live)
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"seconds": wall, "cycles": done["cycles"], "failures": done["failures"], "rss": (rss0, rss1),
            "fds": (fds0, fds1)}


# ------------------------------------------------------------------------------ one size, all sizes
def measure_size(tmp: Path, template: Path, n: int, args, live_runs: list[LiveRun], churn: bool) -> dict:
    """Every figure at a history of `n` steps, with that run training beside them."""
    folder = tmp / f"steps-{n}"
    t0 = time.perf_counter()
    run = make_run(template, folder / "live", n)
    compared = [] if "compare" in args.skip else [
        make_run(template, folder / f"compare-{i}", n, seed=i, lr_scale=1 + 0.05 * i) for i in range(1, 11)]
    print(f"{n:,} steps: {1 + len(compared)} run folder(s) written in {time.perf_counter() - t0:.1f} s", flush=True)
    live = LiveRun(run, n)
    live_runs.append(live)
    out: dict = {}
    try:
        if "attach" not in args.skip:
            out["attach"] = measure_attach(live, args.watch, args.timeout)
            for which, a in out["attach"].items():
                screen = a.pop("screen", "")
                print(f"  attach ({which}): {a}" + (f"\n{screen}" if args.show_screens else ""), flush=True)
        if compared:
            out["compare"] = measure_compare(compared, folder / "compare.png")
            print(f"  compare: {out['compare']}", flush=True)
        if churn:
            out["churn"] = measure_churn(live, args.churn_seconds)
            print(f"  churn: {out['churn']}", flush=True)
    finally:
        live.stop()
        live_runs.remove(live)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return out


def mb(n: float | None) -> str:
    return "–" if n is None else f"{n / 2**20:,.0f} MB"


def ratio(x: float | None, ref: float | None) -> str:
    return "–" if x is None or not ref else f"{x / ref:.2f}×"


def seconds(x: float | None, limit: float | None = None) -> str:
    return f"> {limit:.0f} s" if x is None and limit else "–" if x is None else f"{x:.2f} s"


def tables(results: dict[int, dict], reference: int, args) -> list[str]:
    sizes = sorted(results)
    ref = results[reference]
    lines = []
    if all("attach" in results[n] for n in sizes):
        r1, r2 = ref["attach"]["first"], ref["attach"]["again"]
        lines += ["| steps | first attach: first frame | × ref | its peak RSS | × ref | attach again: first frame "
                  "| × ref | its peak RSS | × ref |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for n in sizes:
            a1, a2 = results[n]["attach"]["first"], results[n]["attach"]["again"]
            lines.append(f"| {n:,} | " + " | ".join(
                cell for a, r in ((a1, r1), (a2, r2)) for cell in (
                    seconds(a["first_frame"], args.timeout), ratio(a["first_frame"], r["first_frame"]),
                    mb(a["peak_rss"]), ratio(a["peak_rss"], r["peak_rss"]))) + " |")
        lines += ["", f"| steps | watching {args.watch:.0f} s (attached again): viewer steady RSS | × ref "
                  "| viewer CPU, % of a core | × ref | the live run meanwhile | step on screen moved on |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for n in sizes:
            a = results[n]["attach"]["again"]
            cpu = a.get("cpu")
            lines.append(f"| {n:,} | {mb(a.get('steady_rss'))} | {ratio(a.get('steady_rss'), r2.get('steady_rss'))} "
                         f"| {'–' if cpu is None else f'{cpu:.1f} %'} | {ratio(cpu, r2.get('cpu'))} "
                         f"| {a.get('live_steps_per_s', 0):.1f} steps/s | {'yes' if a.get('redrawn') else 'NO'} |")
    if all("compare" in results[n] for n in sizes):
        r = ref["compare"]
        lines += ["", "| steps, 10 runs | `compare`, first | × ref | peak RSS | × ref | `compare` again | × ref "
                  "| peak RSS | × ref | `compare --png` | × ref | peak RSS | × ref |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for n in sizes:
            c = results[n]["compare"]
            cells = []
            for form in ("first", "again", "png"):
                (wall, peak), (rwall, rpeak) = c[form], r[form]
                cells += [seconds(wall), ratio(wall, rwall), mb(peak), ratio(peak, rpeak)]
            lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    for n in sizes:
        if "churn" in results[n]:
            c = results[n]["churn"]
            failed = sum(c["failures"].values())
            lines += ["", f"| attach/detach churn, history of {n:,} steps | seconds | cycles | failed attaches "
                      "| host RSS start → end | host descriptors start → end |", "| --- | ---: | ---: | ---: | --- | --- |",
                      f"| RunViewer, its first event, close | {c['seconds']:.0f} | {c['cycles']:,} | {failed} "
                      f"| {mb(c['rss'][0])} → {mb(c['rss'][1])} | {c['fds'][0]} → {c['fds'][1]} |"]
            lines += [f"* {count}×: {message}" for message, count in c["failures"].items()]
    lines += ["", *verdicts(results[sizes[-1]], sizes[-1])]
    return lines


def verdicts(res: dict, n: int) -> list[str]:
    """The issue's targets (set at 1M steps), against the largest size measured."""
    checks = []
    if a := res.get("attach"):
        first, again = a["first"], a["again"]
        checks += [("first attach: first frame ≤ 3 s", first["first_frame"], 3.0, seconds),
                   ("first attach: viewer < 150 MB (peak)", first["peak_rss"], 150 * 2**20, mb),
                   ("attach again: first frame ≤ 3 s", again["first_frame"], 3.0, seconds),
                   ("attach again: viewer < 150 MB (peak)", again["peak_rss"], 150 * 2**20, mb),
                   ("watching ≤ 5 % of a core", again.get("cpu"), 5.0, lambda x: f"{x:.1f} %")]
    if c := res.get("compare"):
        for form, what in (("first", "compare of 10 runs, first"), ("again", "compare of 10 runs, again"),
                           ("png", "compare --png of 10 runs")):
            checks += [(f"{what} ≤ 10 s", c[form][0], 10.0, seconds), (f"{what} ≤ 500 MB", c[form][1], 500 * 2**20, mb)]
    at = "" if n >= 1_000_000 else f" (set for 1M steps; measured here at {n:,})"
    return [f"Targets of issue #43{at}:", ""] + [
        f"* {what}: {'–' if x is None else show(x)}, {'met' if x is not None and x <= limit else 'MISSED'}"
        for what, x, limit, show in checks]


def code_version() -> str:
    """Which lmcockpit the commands run (PYTHONPATH may name a copy of another version), and, where
    that is this repository, its commit and whether the tree differs from it (read-only git)."""
    core = subprocess.run([sys.executable, "-c", "import lmcockpit.core; print(lmcockpit.core.__file__)"],
                          capture_output=True, text=True).stdout.strip()
    root = Path(core).resolve().parent.parent
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return f"lmcockpit from {root}"
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    return f"lmcockpit from {root} at {head.stdout.strip()}" + (" with local changes" if dirty.stdout.strip() else "")


def interrupted(signum, frame):
    raise KeyboardInterrupt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000", help="history lengths in steps, comma-separated")
    ap.add_argument("--reference", type=int, default=1000, help="the short history every figure is compared to")
    ap.add_argument("--watch", type=float, default=30.0, help="seconds of watching after the first frame")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for a first frame")
    ap.add_argument("--churn-seconds", type=float, default=3600.0, help="seconds of attach/detach churn")
    ap.add_argument("--churn-size", type=int, help="the history the churned host serves (default: the largest size)")
    ap.add_argument("--skip", default="", help="parts to leave out, comma-separated: attach, compare, churn")
    ap.add_argument("--keep", action="store_true", help="keep the run folders (their path is printed)")
    ap.add_argument("--show-screens", action="store_true", help="print each first frame as the pane showed it")
    ap.add_argument("--no-record", action="store_true", help="print the results only, not into bench/RESULTS.md")
    args = ap.parse_args()
    args.skip = {s for s in args.skip.split(",") if s}
    sizes = sorted({args.reference, *(int(s.replace("_", "")) for s in args.sizes.split(","))})
    churn_size = args.churn_size or sizes[-1]
    if "churn" not in args.skip and churn_size not in sizes:
        ap.error(f"--churn-size {churn_size}: not among the sizes measured ({', '.join(map(str, sizes))})")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: a shell may start us ignoring it
        signal.signal(sig, interrupted)
    tmp = Path(tempfile.mkdtemp(prefix="lmcockpit-history-"))
    os.environ["XDG_CACHE_HOME"], os.environ["XDG_STATE_HOME"] = str(tmp / "cache"), str(tmp / "state")
    home = os.getcwd()
    os.chdir(tmp)  # python -m puts the working folder first: a checkout's lmcockpit/ there would be the one run
    code = code_version()
    print(f"measuring {code}", flush=True)
    live_runs: list[LiveRun] = []
    results: dict[int, dict] = {}
    try:
        t0 = time.perf_counter()
        template = train_template(tmp / "template")
        print(f"template run trained in {time.perf_counter() - t0:.1f} s: {template}", flush=True)
        # The first attach would pay for a cold file cache: the cockpit's modules read once before.
        subprocess.run([sys.executable, "-c", "import lmcockpit.tui.app"], check=True)
        for n in sizes:
            results[n] = measure_size(tmp, template, n, args, live_runs, churn="churn" not in args.skip
                                      and n == churn_size)
    except KeyboardInterrupt:
        print("interrupted: stopping what was started", file=sys.stderr)
    finally:
        for live in live_runs:
            live.stop()
        os.chdir(home)
        if args.keep:
            print(f"run folders kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.reference not in results or not any(n != args.reference for n in results):
        sys.exit(1)
    lines = [f"Code: {code}. Run folders of N steps (rows as the engine writes them, a GPU run's MFU and "
             f"memory in each step row), each continued in the background from step N (a {TEMPLATE_STEPS}-step "
             f"debug-preset run's checkpoint: {', '.join(TEMPLATE)}), training on the CPU beside every "
             f"measurement; `lmcockpit attach` in a {PANE[0]}x{PANE[1]} tmux pane; ratios against the "
             f"{args.reference:,}-step history measured in the same run.", "", *tables(results, args.reference, args)]
    title = "Long runs: attach, viewer memory and CPU, compare, against the history's length (#43)"
    if args.no_record:
        print("\n".join(lines))
    else:
        record(title, lines)


if __name__ == "__main__":
    main()
