"""A compressed file whose text the estimate undershoots: its pieces at two SLACKs, side by side.

A compressed file's text is estimated from its first readers.ESTIMATE_OUTPUT bytes (8 MB)
before it is cut into pieces (sources.plan_pieces). A dump whose first records compress worse
than the rest holds more text than that estimate. Text past the planned pieces all goes to the
last piece, and one worker reads it alone. The file made here has 16,000 records drawn from
50,000 words, then `--tail` records drawn from 40 words, which compress far better.

Measured, for each SLACK in alternating rounds: pieces planned, pieces left empty, the largest
piece's text over the pieces' target, and `prepare`'s wall time (in this process, with the
default workers).

    python bench/slack.py [--tail 90000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import record

SLACKS = (1.25, 2.0)  # before and since 2026-11-26
SHARD_BYTES = 1_000_000


def skewed(path: Path, tail: int) -> int:
    """The file; returns its text's size."""
    import zstandard

    rng = random.Random(0)
    many, few = [f"w{i}" for i in range(50_000)], [f"w{i}" for i in range(40)]
    text = 0
    with open(path, "wb") as raw, zstandard.ZstdCompressor(level=3).stream_writer(raw) as out:
        for words, n in ((many, 16_000), (few, tail)):
            for _ in range(n):
                line = (json.dumps({"text": " ".join(rng.choices(words, k=150))}) + "\n").encode()
                out.write(line)
                text += len(line)
    return text


def pieces_at(slack: float, cfg, text: int) -> tuple[int, int, float]:
    """(pieces planned, pieces past the text's end, the largest piece's text over the target)."""
    from lmcockpit.core.data import build, sources

    sources.SLACK = slack
    planned = build.plan(cfg.data, sources.list_source(cfg.data))
    target = SHARD_BYTES / planned.keep
    starts = [p.start for p in planned.pieces]
    ends = [p.end if p.end >= 0 else text for p in planned.pieces]
    sizes = [max(0, min(e, text) - min(s, text)) for s, e in zip(starts, ends)]
    return len(sizes), sum(1 for n in sizes if n == 0), max(sizes) / target


def prepared_in(slack: float, cfg) -> float:
    from lmcockpit.core.data import prepare, sources

    sources.SLACK = slack
    t0 = time.perf_counter()
    prepare.prepare(cfg, lambda line: None, lambda *a: None)
    return time.perf_counter() - t0


def main() -> None:
    from lmcockpit.core.config import load_config
    from lmcockpit.core.data import readers, sources

    ap = argparse.ArgumentParser()
    ap.add_argument("--tail", type=int, default=90_000, help="records of the well-compressing kind after the rest")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "skewed.jsonl.zst")
        text = skewed(source, args.tail)
        packed = source.stat().st_size

        def config(cache: str):
            return load_config("cpu", [f'data.source="{source}"', f'data.cache_dir="{cache}"',
                                       f"data.shard_bytes={SHARD_BYTES}", "tokenizer.train_bytes=1_000_000",
                                       "tokenizer.vocab_size=2048", "data.max_bytes=0"])[0]

        estimate = readers.text_bytes(sources.list_source(config(tmp).data).files[0], "text")
        plans = {s: pieces_at(s, config(tmp), text) for s in SLACKS}
        times: dict[float, list[float]] = {s: [] for s in SLACKS}
        for _ in range(args.rounds):
            for s in SLACKS:
                with tempfile.TemporaryDirectory() as cache:
                    times[s].append(prepared_in(s, config(cache)))
    lines = [f"A `.jsonl.zst` of {packed / 1e6:.1f} MB holding {text / 1e6:.1f} MB of text; the "
             f"estimate from its first 8 MB says {estimate / 1e6:.1f} MB ({text / estimate:.2f}× short). Pieces of "
             f"{SHARD_BYTES / 1e6:g} MB; prepare's time is the median of {args.rounds} alternating rounds.", "",
             "| SLACK | pieces planned | empty | largest piece / target | prepare, median | against 1.25 |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = statistics.median(times[SLACKS[0]])
    for s in SLACKS:
        n, empty, largest = plans[s]
        t = statistics.median(times[s])
        lines.append(f"| {s:g} | {n} | {empty} | {largest:.1f}× | {t:.2f} s | {t / base:.2f}× |")
    record("Data preparation: a compressed file that holds more text than its estimate", lines)


if __name__ == "__main__":
    main()
