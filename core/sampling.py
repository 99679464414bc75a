"""Sampling text from the model: temperature and top-k, with a generator of its own.

The generator is private so that sampling between training steps leaves training's random state
untouched, and a given seed reproduces its text. This first version recomputes the context for
each token; the KV-cache decoder replaces it with the chat issue.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from .gpt import GPT


@torch.no_grad()
def generate_ids(model: GPT, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_k: int,
                 seed: int, eos_id: int | None, device: torch.device) -> Iterator[int]:
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt_ids or ([eos_id] if eos_id is not None else [0])], device=device)
    ctx = model.shape.max_seq_len
    for _ in range(max_new_tokens):
        logits = model(ids[:, -ctx:])[:, -1, :].float()
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        token = int(nxt)
        if token == eos_id:
            return
        yield token
        ids = torch.cat([ids, nxt], dim=1)


def stream_text(ids: Iterator[int], decode: Callable[[list[int]], str]) -> Iterator[str]:
    """Pieces of text as tokens arrive, holding back an incomplete UTF-8 character until whole."""
    out: list[int] = []
    shown = ""
    for token in ids:
        out.append(token)
        text = decode(out)
        if text.endswith("\ufffd"):
            continue
        yield text[len(shown):]
        shown = text
    text = decode(out)
    if text != shown:
        yield text[len(shown):]
