"""What a webhook costs training: the same run with no webhook, one that refuses, one that hangs.

    python bench/notify_cost.py [--rounds N] [--record] [-- --set KEY=VALUE ...]

Runs the shrunk cpu preset (uncompiled, 200 steps, a warning spike threshold low enough that
notifications are sent through the run) three ways, alternated over `--rounds` so a busy machine
slows each alike: [notify] off; `notify.webhook` at a closed port (refused at once, retried with
back-off); at a local server that accepts and never answers (each try waits out its timeout).
The order of the ways rotates from round to round. Prints each way's median steps/s (from
metrics.jsonl's step times, steps 2 on: the first carries set-up), the CPU time of the front-end
process that holds the notifier (user + system, read until it exits: the way a notifier could take
a core from training), and wall time, with ratios to the run without a webhook. `--record` appends
them to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from machine import record  # bench/'s own helper: a script's folder is on its path

SHRUNK = ["model.n_layer=2", "model.d_model=64", "model.mlp_hidden=0", "model.max_seq_len=64", "training.seq_len=64",
          "training.micro_batch_size=8", "data.max_bytes=1_000_000", "tokenizer.vocab_size=512",
          "tokenizer.train_bytes=300_000", "training.max_steps=200", "eval.every=0", "sample.prompts=[]",
          "eval.tasks=[]", "training.compile=false", 'hardware.device="cpu"',
          # every step past the window a spike in "warn": an event a step for the notifier to carry
          "training.spike_window=10", "training.spike_zscore=0.0001"]


class Hanging(BaseHTTPRequestHandler):
    release = threading.Event()

    def do_POST(self):
        self.release.wait(600)

    def log_message(self, *args):
        pass


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(work: Path, name: str, sets: list[str], env: dict) -> tuple[float, float, float]:
    """(steps/s, the front-end's CPU seconds, wall seconds) of one run."""
    import psutil

    out = work / name
    flags = [a for s in [*SHRUNK, *sets] for a in ("--set", s)]
    t0 = time.perf_counter()
    proc = psutil.Popen([sys.executable, "-m", "lmcockpit.tui.cli", "--run", "cpu", *flags, "--out", str(out)],
                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cpu = 0.0
    while proc.poll() is None:  # its own times, not its children's (the engine): readable until it is reaped
        try:
            times = proc.cpu_times()
            cpu = times.user + times.system
        except psutil.Error:
            pass
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr.read()[-2000:]}")
    dts = [row["dt"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
           if row.get("kind") == "step" and row["step"] > 1]
    return 1 / statistics.median(dts), cpu, wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    p.add_argument("sets", nargs="*", help="--set KEY=VALUE pairs passed on (after --)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="notify-cost-"))
    env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"), "no_proxy": "*", "NO_PROXY": "*"}
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hanging)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ways = {"no webhook": [], "refusing webhook": [f'notify.webhook="http://127.0.0.1:{closed_port()}/hook"'],
            "hanging webhook": [f'notify.webhook="http://127.0.0.1:{server.server_address[1]}/hook"']}
    run(work, "warm-up", args.sets, env)  # the token cache, built once, outside the timings
    results: dict[str, list[tuple[float, float, float]]] = {way: [] for way in ways}
    names = list(ways)
    for r in range(args.rounds):
        for way in names[r % 3:] + names[:r % 3]:  # each way first in turn: no way always runs on a cold machine
            results[way].append(run(work, f"{way.split()[0]}-{r}", [*ways[way], *args.sets], env))
    Hanging.release.set()
    server.shutdown()
    def median(way: str, i: int) -> float:
        return statistics.median(r[i] for r in results[way])

    lines = [f"The shrunk cpu preset, 200 uncompiled steps with a spike event every step past the 10th "
             f"(`training.spike_zscore=0.0001`), {args.rounds} rounds, the order rotated; medians (steps/s of each "
             f"run: {', '.join(f'{w}: ' + '/'.join(f'{r[0]:.0f}' for r in results[w]) for w in ways)}). torch "
             f"{__import__('torch').__version__}.", "",
             "| webhook | steps/s | ratio | front-end CPU | wall time | ratio |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for way in ways:
        lines.append(f"| {way} | {median(way, 0):.1f} | {median(way, 0) / median('no webhook', 0):.3f} | "
                     f"{median(way, 1):.2f} s | {median(way, 2):.1f} s | {median(way, 2) / median('no webhook', 2):.3f} |")
    lines += ["", "Wall time includes the end's bounded flush (at most 5 s) where the webhook never answers."]
    if args.record:
        record("what a webhook costs training: `bench/notify_cost.py`", lines)
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
