#!/usr/bin/env bash
# bench/gpu_check.py on a lent GPU machine, which has torch but not all of lmcockpit's dependencies
# and reaches no network. Two halves:
#
#   bash bench/gpu_lease.sh prepare          # here: lmcockpit's wheel and the missing dependencies
#                                            # (textual, tomli-w, zstandard, ...) into .whl/
#   bash bench/gpu_lease.sh prepare speedrun # the same, and the speedrun part's data into .whl/speedrun:
#                                            # modded-nanogpt's validation shard's first 10,485,760 tokens,
#                                            # the first 12M of its first training shard, GPT-2's tokenizer
#                                            # (bench/speedrun.py --prepare; ~47 MB of the call's 64 MiB)
#   bash bench/gpu_lease.sh run PART...      # there (the device tool's command, `carry: [".whl"]`):
#                                            # installs .whl/ into /tmp/site and runs the parts given,
#                                            # most fatal first, each recorded as it ends
#
# The parts' results land in bench/RESULTS.md there; this script copies what they added, the log,
# the glance part's screens and nvidia-smi into $OUT, which the device tool brings back. RUN_SECONDS
# (default 540) bounds the parts, leaving the copy time inside a 10-minute call. First lease
# (2026-11-27, H100): doctor, h100 (100 steps), nvml, glance and memory (h100, 3090, 4070ti) took
# 9 minutes in one call, the machine's start not counted; attention, inference, muon and allocator
# 38 s; resume, ddp and tasks 79 s.
set -u
WHEELS=.whl
case "${1:-}" in
prepare)
    # The machine's Python is 3.12 (the device tool's KINDS.md); pure-Python wheels, and zstandard's
    # manylinux build for it. Versions: what this checkout's environment has, so both sides agree.
    mkdir -p "$WHEELS" .git/info || exit 1
    grep -qx "/$WHEELS/" .git/info/exclude 2>/dev/null || echo "/$WHEELS/" >> .git/info/exclude
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
        platforms+=(--platform "$p")
    done
    wanted=()
    for name in textual textual-plotext plotext tomli_w zstandard argcomplete platformdirs linkify-it-py uc-micro-py \
                mdit-py-plugins markdown-it-py textual-serve aiohttp-jinja2 rich; do
        version=$(python3 -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
        wanted+=("$name${version:+==$version}")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$WHEELS" "${wanted[@]}" || exit 1
    python3 -m pip wheel -q --no-deps --no-build-isolation . -w "$WHEELS" || exit 1
    if [ "${2:-}" = speedrun ]; then
        # The lent machine reaches no network: the shards travel with the wheels (`carry: [".whl"]`).
        [ -f "$WHEELS/speedrun/val/fineweb_val_000000.bin" ] || python3 bench/speedrun.py --prepare "$WHEELS/speedrun" \
            || exit 1
    fi
    ls "$WHEELS"
    # What travels: the device tool takes 64 MiB in all (the checkout's tracked files too).
    du -sh "$WHEELS"
    ;;
run)
    shift
    [ $# -gt 0 ] || set -- doctor h100 nvml glance
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    repo=$PWD
    out=${OUT:-/tmp/gpu_lease}
    mkdir -p "$out"
    nvidia-smi > "$out/nvidia-smi.txt" 2>&1
    cp bench/RESULTS.md /tmp/RESULTS.before
    # Run from elsewhere: the checkout's bare top folder lmcockpit/ would shadow the installed package.
    cd /tmp || exit 1
    timeout -s INT "${RUN_SECONDS:-540}" python3 "$repo/bench/gpu_check.py" --part "$@" --steps "${STEPS:-100}" \
        --out /tmp/gpu_check 2>&1 | tee -a "$out/gpu_check.log" | grep '^gpu_check: '
    diff /tmp/RESULTS.before "$repo/bench/RESULTS.md" | sed -n 's/^> //p' > "$out/RESULTS.new.md"
    cp /tmp/gpu_check/glance-*.svg "$out/" 2>/dev/null
    grep -c '^## gpu_check' "$out/RESULTS.new.md"
    ;;
*)
    echo "usage: bash bench/gpu_lease.sh prepare [speedrun] | run PART..." >&2
    exit 2
    ;;
esac
