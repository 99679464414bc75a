"""The cockpit's costs, measured side by side in one run:

* startup: command to first cockpit frame, against the bare interpreter's start (target < 1 s);
* events: how many step events per second the dashboard absorbs (target ≥ 1,000/s);
* overhead: training tokens/s under the cockpit against the headless run (target ≤ 2% cost);
* settings: the launch screen's longest stall while it counts the tokens of a source of many files
  (a thread since 2026-11-26), against the count's time on the UI thread, where it used to run.

    python bench/cockpit.py [--pairs 3] [--files 100000] [--only settings]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import record

FIRST_FRAME = """
from lmcockpit.tui.app import CockpitApp
class FirstFrame(CockpitApp):
    def on_mount(self):
        super().on_mount()
        self.call_after_refresh(self.exit)
FirstFrame(telemetry=True).run(headless=True)
"""

UNDER_COCKPIT = """
import sys
from pathlib import Path
from lmcockpit.core.config import load_config
from lmcockpit.core.run.folder import create_run_dir
from lmcockpit.tui.app import CockpitApp
from lmcockpit.tui.runplan import RunPlan
cfg, _ = load_config("cpu", sys.argv[2:])
req = RunPlan(cfg, create_run_dir(cfg, "bench", sys.argv[1]), None, "bench")
class Watch(CockpitApp):
    def start_run(self, request):
        screen = super().start_run(request)
        screen.quit_when_done = True
        return screen
Watch(req).run(headless=True)
"""

# Enough work per step that the measurement is about training, small enough to finish quickly.
TRAIN = ["model.n_layer=4", "model.d_model=128", "model.mlp_hidden=384", "model.max_seq_len=128",
         "training.seq_len=128", "training.micro_batch_size=8", "training.max_steps=60", "training.compile=false",
         "training.log_every=10", "eval.every=0", "sample.prompts=[]", "data.max_bytes=2_000_000",
         "tokenizer.vocab_size=2048", "tokenizer.train_bytes=1_000_000", "checkpoint.every=0"]


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def startup(pairs: int) -> list[str]:
    bare, cockpit = [], []
    wall([sys.executable, "-c", FIRST_FRAME])  # warm the file cache
    for _ in range(pairs):
        bare.append(wall([sys.executable, "-c", "pass"]))
        cockpit.append(wall([sys.executable, "-c", FIRST_FRAME]))
    b, c = statistics.median(bare), statistics.median(cockpit)
    return [f"| startup | median of {pairs} | result |", "| --- | --- | --- |",
            f"| bare `python -c pass` | {b:.3f} s | |",
            f"| `lmcockpit` to first frame (whole process, exit included) | {c:.3f} s | "
            f"{'under' if c < 1 else 'OVER'} the 1 s target; {c / b:.1f}× the bare interpreter |"]


async def absorb(n_events: int, batch: int) -> float:
    from lmcockpit.core import protocol as P
    from lmcockpit.tui.app import CockpitApp
    from lmcockpit.tui.screens.dashboard import DashboardScreen, EngineEvents
    from textual.app import App

    class Fed(App):
        CSS_PATH = CockpitApp.CSS_PATH

        async def on_mount(self):
            self.dash = DashboardScreen(None, "bench", telemetry=None)
            await self.push_screen(self.dash)

    events = [P.RunStarted("runs/bench", {}, 1, "cpu", "fp32", 0, n_events, 1)]
    events += [P.StepMetrics(i, 3 + math.exp(-i / 500), 1e-3, 0.5, 1e5, None, 0.01, i, {}) for i in range(1, n_events + 1)]
    app = Fed()
    async with app.run_test(size=(120, 40)) as pilot:
        t0 = time.perf_counter()
        for i in range(0, len(events), batch):
            app.dash.post_message(EngineEvents(events[i:i + batch]))
        while app.dash.view.step < n_events:
            await pilot.pause(0.01)
        app.dash.dirty = True
        app.dash.redraw()  # the last frame with the whole history drawn
        await pilot.pause()
        return n_events / (time.perf_counter() - t0)


def events(n: int) -> list[str]:
    rates = {b: asyncio.run(absorb(n, b)) for b in (1, 50)}
    return [f"| event absorption ({n:,} step events) | events/s | result |", "| --- | --- | --- |",
            *[f"| one message per {b} event(s) | {r:,.0f} | {'meets' if r >= 1000 else 'MISSES'} the 1,000/s target |"
              for b, r in rates.items()]]


async def stall_while_counting(source: Path) -> tuple[float, float]:
    """(the launch screen's event loop's longest stall, the count's time) while its settings'
    token budget for `source` is counted, from the change of source to the budget shown."""
    from lmcockpit.tui.app import CockpitApp

    app = CockpitApp(runs_root=source.parent / "runs", telemetry=False)
    async with app.run_test(size=(120, 40)) as pilot:
        launch = app.screen
        await pilot.pause()
        launch.overrides = {"data.source": f'"{source}"'}
        t0 = last = time.perf_counter()
        launch.show_settings()
        stall = time.perf_counter() - t0
        while not launch.counted.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            stall, last = max(stall, now - last), now
        return stall, time.perf_counter() - t0


def settings(n_files: int) -> list[str]:
    from lmcockpit.core.config import load_config
    from lmcockpit.core.data import budget, readers

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "corpus")
        for i in range(n_files):  # a hundred files to a folder, as a crawl's shards are kept
            folder = source / f"{i // 100:05d}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i:07d}.txt").write_text(f"document {i}\n" * 20)
        stall, counted = asyncio.run(stall_while_counting(source))
        budget._listing.cache_clear()  # listed afresh, as the other side was
        readers.text_bytes.cache_clear()
        cfg, _ = load_config("cpu", [f'data.source="{source}"'])
        t0 = time.perf_counter()
        budget.parts(cfg)  # what the settings' redraw did on the UI thread before
        inline = time.perf_counter() - t0
    return [f"| launch screen, a source of {n_files:,} files | seconds | |", "| --- | --- | --- |",
            f"| the count, on the UI thread (before: the screen's stall) | {inline:.2f} s | |",
            f"| the count, in a thread | {counted:.2f} s | |",
            f"| the screen's longest stall meanwhile | {stall:.3f} s | {stall / inline:.3f}× the stall before |"]


def median_tokens_per_s(run: Path) -> float:
    from lmcockpit.core.run.folder import read_metrics
    return statistics.median(r["tokens_per_s"] for r in read_metrics(run, "step") if r["step"] > 5)


def cli_run(out: Path) -> list[str]:
    return [sys.executable, "-m", "lmcockpit.tui.cli", "--run", "cpu", *[a for s in TRAIN for a in ("--set", s)],
            "--out", str(out)]


def compare_training(title: str, baseline: tuple, candidate: tuple, pairs: int, max_cost: float) -> list[str]:
    """The same training two ways, alternating A B for `pairs` rounds (so drift hits both), compared
    by median tokens/s. `baseline`/`candidate`: (label, function from a run folder to a command)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    subprocess.run(cli_run(tmp / "warm") + ["--set", "training.max_steps=2"], check=True, capture_output=True)
    (base_label, base_cmd), (cand_label, cand_cmd) = baseline, candidate
    base, cand, ratios = [], [], []
    for i in range(pairs):
        for cmd, out, into in ((base_cmd, tmp / f"base{i}", base), (cand_cmd, tmp / f"cand{i}", cand)):
            subprocess.run(cmd(out), check=True, capture_output=True)
            into.append(median_tokens_per_s(out))
        ratios.append(cand[-1] / base[-1])
    r = statistics.median(ratios)
    return [f"| {title} ({pairs} pairs, alternating) | tokens/s (median) | |", "| --- | --- | --- |",
            f"| {base_label} | {statistics.median(base):,.0f} | |",
            f"| {cand_label} | {statistics.median(cand):,.0f} | |",
            f"| ratio, median of pairs | {r:.3f} | cost {100 * (1 - r):.1f}% ({'within' if r >= 1 - max_cost else 'OVER'} "
            f"the {max_cost:.0%} target); pairs: {', '.join(f'{x:.3f}' for x in ratios)} |"]


def overhead(pairs: int) -> list[str]:
    return compare_training("training under the cockpit vs headless", ("headless `--run`, piped", cli_run),
                            ("cockpit (Textual headless driver)",
                             lambda out: [sys.executable, "-c", UNDER_COCKPIT, str(out), *TRAIN]), pairs, 0.02)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--only", choices=["settings"], help="measure that alone")
    args = ap.parse_args()
    if args.only == "settings":
        record("Cockpit: the launch screen while it counts a large source", settings(args.files))
    else:
        lines = (startup(5) + [""] + events(args.events) + [""] + overhead(args.pairs) + [""]
                 + settings(args.files))
        record("Cockpit: startup, event absorption, training overhead, counting a large source", lines)
