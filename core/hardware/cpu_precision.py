"""precision = "auto" on a CPU: bf16 autocast where a short probe measures it clearly faster.

No flag tells whether bf16 pays on a CPU. Measured at the cpu preset's shape, a compiled step in
bf16 against fp32 was 2.4× faster on a Xeon with AMX-BF16, 1.5–1.6× on an AMD EPYC with
AVX512-BF16, and 0.66× (slower) on a Xeon with AVX512-BF16 but no AMX. So the first CPU run with
"auto" times forward and backward of a one-block model of its own shape in both precisions (a
second or two), takes bf16 only when it is at least MARGIN faster, and keeps the verdict in the
cache folder under the CPU model, the torch version and the probe's shape (a tiny model's verdict
can be the opposite of the cpu preset's on the same CPU): later runs of that shape, `lmcockpit
presets` and the launch screen read it without probing. A CPU without bf16 instructions is not probed (autocast
would emulate bf16, slowly).

No torch at import: the front-end reads cached verdicts (the memory estimate) without it.
"""

from __future__ import annotations

import functools
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable

from ..run.safe_files import cache_home, write_whole

MARGIN = 1.15  # bf16 must be this much faster: a closer call is within run-to-run noise
PROBE_TOKENS = 4096  # a micro-batch's tokens at most: enough to time matmuls at their real width
PROBE_SECONDS = 1.5  # the timed rounds stop once both precisions have had this long in all
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86's flags, and aarch64's Features word
CACHE_FILE = "cpu-precision.json"


@dataclass(frozen=True)
class Verdict:
    precision: str  # "bf16" or "fp32"
    speedup: float | None = None  # fp32 time over bf16 time, as measured; None: not measured
    fp32_ms: float | None = None
    bf16_ms: float | None = None
    why: str = ""  # why nothing was measured
    probe: str = ""  # the shape it was measured at, and the threads

    def note(self) -> str:
        """What the run header puts after the precision: "auto: 1.58× fp32 on this CPU"."""
        if self.speedup is None:
            return f"auto: {self.why}"
        if self.precision == "bf16":
            return f"auto: {self.speedup:.2f}× fp32 on this CPU"
        return f"auto: bf16 measured {self.speedup:.2f}× fp32 on this CPU, under {MARGIN:g}×"


def decide(fp32_s: float, bf16_s: float, probe: str = "", margin: float = MARGIN) -> Verdict:
    """bf16 when the fp32 step takes at least `margin` times as long as the bf16 one."""
    speedup = fp32_s / bf16_s
    return Verdict("bf16" if speedup >= margin else "fp32", round(speedup, 3), round(fp32_s * 1e3, 2),
                   round(bf16_s * 1e3, 2), probe=probe)


@functools.cache  # a many-core machine's /proc/cpuinfo is hundreds of KB; the CPU does not change
def cpu_model() -> str:
    for line in _cpuinfo():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


@functools.cache
def has_bf16() -> bool | None:
    """Whether the CPU has bf16 instructions; None where its flags cannot be read (not Linux)."""
    for line in _cpuinfo():
        if line.startswith(("flags", "Features")):
            return bool(BF16_FLAGS & set(line.split(":", 1)[1].split()))
    return None


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def torch_version() -> str:
    try:
        return version("torch")
    except PackageNotFoundError:
        return "unknown"


# A verdict stored for every shape of a CPU and torch (how the test suite pins fp32); a probe's
# own is kept under the shape it measured.
ANY_SHAPE = "any shape"


def cache_key(cpu: str | None = None, torch: str | None = None, shape: str = ANY_SHAPE) -> str:
    # Keyed by the probe's shape as well as the CPU: on a Xeon with AMX, bf16 measured 0.64x fp32
    # for the debug preset's 8x64 tokens of width 64 and 2.0x for the cpu preset's 16x256 of 256,
    # so a first run of a tiny model must not decide every later run's precision.
    return f"{cpu or cpu_model()} | torch {torch or torch_version()} | {shape}"


def probe_shape(cfg) -> str:
    """The shape measure() times for `cfg`: its tokens and the widths of its matrices."""
    T, B = _probe_tokens(cfg)
    m = cfg.model
    return (f"{B}×{T} tokens, d_model {m.d_model}, {m.n_head}/{m.n_kv_head} heads, {m.mlp} {cfg.mlp_hidden}, "
            f"vocab {cfg.tokenizer.vocab_size}")


def _probe_tokens(cfg) -> tuple[int, int]:
    T = min(cfg.training.seq_len, PROBE_TOKENS)
    return T, max(1, min(cfg.training.micro_batch_size, PROBE_TOKENS // T))


def cache_path() -> Path:
    """In the cache folder the token caches default to ($XDG_CACHE_HOME/lmcockpit)."""
    return cache_home() / CACHE_FILE


def cached(key: str | None = None) -> Verdict | None:
    """The verdict stored under `key` (default: this CPU's and torch's for any shape), if any; a
    damaged file counts as none."""
    try:
        entry = json.loads(cache_path().read_text())[key or cache_key()]
        return Verdict(**entry)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(verdict: Verdict, key: str | None = None) -> None:
    """Add the verdict to the cache file (written whole to a fresh temporary file, then renamed, so
    a reader never sees half of it, and no link planted at a guessable name is written through);
    a cache folder that cannot be written only costs a probe."""
    path = cache_path()
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entries[key or cache_key()] = asdict(verdict)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps(entries, indent=1) + "\n")
    except OSError:
        pass


def known(cfg) -> Verdict | None:
    """What "auto" means for `cfg`'s shape on this CPU without probing: the cached verdict (a
    measurement of this CPU model and torch at that shape, or one stored for any shape, which
    outrank its flags), fp32 on a CPU without bf16 instructions, None where it is still to be
    measured."""
    for key in (cache_key(shape=probe_shape(cfg)), cache_key()):
        if (verdict := cached(key)) is not None:
            return verdict
    if has_bf16() is False:
        return Verdict("fp32", why="no bf16 instructions in this CPU")
    return None


def choose(cfg, log: Callable[[str], None] = lambda line: None) -> Verdict:
    """`known`, or a probe at `cfg`'s shape whose verdict is cached for the next runs."""
    verdict = known(cfg)
    if verdict is None:
        log(f"precision: timing fp32 against bf16 on this CPU (once for this shape; the verdict is kept in "
            f"{cache_path()})")
        verdict = measure(cfg)
        store(verdict, cache_key(shape=probe_shape(cfg)))
    return verdict


def measure(cfg) -> Verdict:
    """Forward and backward of a one-block model of `cfg`'s shape (the head and its loss included)
    on up to PROBE_TOKENS tokens, in fp32 and in bf16 autocast, in turn; the median of each."""
    import torch

    from ..model.gpt import GPT, shape_from_config

    shape = shape_from_config(cfg)
    one_block = GPT(type(shape)(**{**asdict(shape), "n_layer": 1}))
    T, B = _probe_tokens(cfg)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, shape.vocab_size, (B, T), generator=gen) for _ in range(2))

    def step(dtype) -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = one_block(x, y)
        loss.backward()
        one_block.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    step("fp32"), step("bf16")  # warm-up: the allocator, oneDNN's kernel choice
    start = time.perf_counter()
    while len(times["fp32"]) < 3 or (time.perf_counter() - start < PROBE_SECONDS and len(times["fp32"]) < 20):
        for dtype in times:
            times[dtype].append(step(dtype))
    probe = f"1 block, {probe_shape(cfg)}, {torch.get_num_threads()} threads"
    return decide(statistics.median(times["fp32"]), statistics.median(times["bf16"]), probe)
