"""A fine-tuned chat run's greedy reply twice: `lmcockpit chat RUN --prompt` and `transformers`'
apply_chat_template + generate on `lmcockpit export`'s folder (issue #54's done-when: identical).
A record of the two replies, not a timing.

    python bench/chat_reply.py RUN [--prompt TEXT] [--max-new-tokens 64]

RUN: a fine-tuning run folder (`lmcockpit --run chat-cpu --from ...`), its base trained with
`--set model.value_embeds=0 --set model.unet_skips=false` (the cpu preset's value embeddings and
U-net skips have no Qwen3 equivalent, so a run with them does not export; chat-cpu then needs the
same two sets). The export goes to a
temporary folder. Appends the request, both replies, whether they are equal and whether the
model ended its turn (<|assistant_end|>) before the limit, with the machine, to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import record

PROMPT = "Write a function `add(a, b)` that returns the sum of a and b."


def lmcockpit(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "lmcockpit.tui.cli", *args], check=True, capture_output=True,
                          text=True).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    import torch
    import transformers

    n = args.max_new_tokens
    ours = lmcockpit("chat", args.run, "--prompt", args.prompt, "--temperature", "0", "--max-new-tokens", str(n))
    ours = ours.removesuffix("\n")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hf"
        lmcockpit("export", args.run, str(out))
        tok = transformers.AutoTokenizer.from_pretrained(out)
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
        with torch.no_grad():
            ids = model.generate(**prompt, max_new_tokens=n, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    ids = ids.tolist()
    end = tok.convert_tokens_to_ids("<|assistant_end|>")
    theirs = tok.decode(ids[:ids.index(end)] if end in ids else ids)
    record(f"chat: lmcockpit chat --prompt against transformers on the export, {Path(args.run).name}", [
        f"torch {torch.__version__}, transformers {transformers.__version__}; greedy, at most {n} new tokens; "
        f"request ``{args.prompt}``",
        "",
        f"* identical: {'yes' if ours == theirs else 'NO'}; the turn ended (<|assistant_end|>) before the limit: "
        f"{'yes' if end in ids else 'no'}",
        "* `lmcockpit chat RUN --prompt ... --temperature 0`:", "", "```", ours, "```", "",
        "* `apply_chat_template` + `generate(do_sample=False)` on `lmcockpit export RUN`:", "", "```", theirs, "```",
    ])


if __name__ == "__main__":
    main()
