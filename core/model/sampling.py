"""Sampling text from the model: a KV-cache decoder, the usual filters, and text streamed by row.

* One prefill of the prompt, then one token per step for every row at once; the rows share the
  prompt's cache but each draws its own tokens, the first one included.
* The random generator is private, so a seed reproduces its text and sampling between training
  steps leaves training's random state untouched.
* When the context fills, the model keeps seeing the newest half of it: the cache is rebuilt from
  those tokens (positions restart at 0, as in training), which costs one prefill every half context.
* A chat model's turn (a request with `messages`) is the conversation in the chat template, then
  <|assistant_start|>; a row ends at <|assistant_end|> (a `stop` token) as at end-of-text.
* `use_cache=False` recomputes the visible context for every token with the training forward: the
  reference that tests and the decode benchmark compare the cache against.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, Iterator

import torch

from .. import protocol as P
from ..config import ConfigError
from ..data import chat_template
from .gpt import GPT, KVCache


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Float logits (B, V) tempered, then cut to the top k, then to the smallest set holding top_p of
    the probability; cut tokens get -inf. top_k 0 and top_p 1 leave the distribution whole."""
    logits = logits / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # A token is cut when the tokens ranked above it already hold top_p: the first always stays.
        cut = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.zeros_like(cut).scatter(-1, order, cut), float("-inf"))
    return logits


@torch.no_grad()
def generate(model: GPT, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, greedy: bool = False, num_samples: int = 1, seed: int = 0,
             eos_id: int | None = None, use_cache: bool = True,
             agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
             stop: tuple[int, ...] = ()) -> Iterator[list[int | None]]:
    """Each step's new token of every row, None for rows that already met end-of-text or a `stop`
    token (neither is yielded); stops when all rows have. Greedy (or temperature 0) takes the most likely token and draws nothing.
    `agree` makes the processes of a sharded model take the same tokens (rank 0's): each of their
    decode steps gathers shards with the others, so one that stopped early would hang them all."""
    device = model.embed_tokens.weight.device
    ctx = model.shape.max_seq_len
    gen = torch.Generator(device=device).manual_seed(seed)
    seq = torch.tensor([prompt_ids or [eos_id if eos_id is not None else 0]], device=device)
    start = max(0, seq.size(1) - ctx)  # the model sees seq[:, start:]
    greedy = greedy or temperature == 0
    cache: KVCache | None = None
    ends = {eos_id, *stop} - {None}

    def see_context() -> torch.Tensor:
        nonlocal cache
        if not use_cache:
            return model(seq[:, start:])[:, -1].float()
        cache = KVCache(model.shape.n_layer, ctx)
        return model.decode(seq[:, start:], cache)

    logits = see_context()
    # The prompt was seen once, for one row; the rows part ways from their first draw on.
    seq, logits = seq.repeat(num_samples, 1), logits.repeat(num_samples, 1)
    if cache is not None:
        cache.repeat_rows(num_samples)
    finished = [False] * num_samples
    for _ in range(max_new_tokens):
        if greedy:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p), -1)
            nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
        if agree is not None:
            nxt = agree(nxt)
        tokens = nxt.tolist()
        yield [None if done or t in ends else t for t, done in zip(tokens, finished)]
        finished = [done or t in ends for t, done in zip(tokens, finished)]
        if all(finished):
            return
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        full = seq.size(1) - start > ctx
        if full:
            start = seq.size(1) - max(1, ctx // 2)
        logits = model.decode(nxt[:, None], cache) if use_cache and not full else see_context()


class TextStream:
    """One row's text as its tokens arrive, without broken characters: a piece whose last character
    is still missing bytes waits for the next token. Decodes a short window of recent tokens, not
    the whole row, and takes the difference, so tokenizers that drop a leading space stay exact."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # window start: the text before it is already out
        self.read = 0  # the window's tokens up to here are already out

    def push(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is still held back, at the end of the row."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        shown = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        if len(text) <= len(shown) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(shown):]


def answer(model: GPT, tokenizer, eos_id: int | None, request: P.Sample, step: int, emit: Callable[[object], None],
           log: Callable[[str], None], autocast: AbstractContextManager,
           agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[str] | None:
    """Answer one request: every row's text streamed as `SampleText` pieces, then one `done` marker
    (also for a request refused for its settings, which is logged and returns None). Runs in eval
    mode without gradients, in the caller's autocast, and restores the model's mode. Returns each
    row's continuation."""
    try:
        P.check_sample(request)
        ids, stop = prompt_of(request, tokenizer, eos_id)
    except ConfigError as e:
        log(f"sample request {request.request_id!r} refused: {e}")
        emit(P.SampleText(request.request_id, step, request.prompt, "", done=True))
        return None
    streams = [TextStream(tokenizer.decode) for _ in range(request.num_samples)]
    texts = [""] * request.num_samples

    def out(row: int, piece: str) -> None:
        if piece:
            texts[row] += piece
            emit(P.SampleText(request.request_id, step, request.prompt, piece, row=row))

    was_training = model.training
    model.eval()
    try:
        with autocast:
            for tokens in generate(model, ids, request.max_new_tokens, temperature=request.temperature,
                                   top_k=request.top_k, top_p=request.top_p, greedy=request.greedy,
                                   num_samples=request.num_samples, seed=request.seed, eos_id=eos_id,
                                   agree=agree, stop=stop):
                for row, token in enumerate(tokens):
                    if token is not None:
                        out(row, streams[row].push(token))
    finally:
        model.train(was_training)
    for row, stream in enumerate(streams):
        out(row, stream.flush())
    emit(P.SampleText(request.request_id, step, request.prompt, "", done=True))
    return texts


def prompt_of(request: P.Sample, tokenizer, eos_id: int | None) -> tuple[list[int], tuple[int, ...]]:
    """(the ids generation starts from, its stop tokens): the prompt's text for a completion; for a
    chat turn, the conversation in the template, stopping at <|assistant_end|>. A ConfigError when
    the tokenizer lacks the template's tokens."""
    if not request.messages:
        return tokenizer.encode(request.prompt, add_special_tokens=False).ids, ()
    start = tokenizer.id_to_token(eos_id) if eos_id is not None else chat_template.END_OF_TEXT
    messages = [{"role": role, "content": text} for role, text in request.messages]
    ids = chat_template.prompt_ids(messages, tokenizer, start)
    return ids, (chat_template.chat_ids(tokenizer, start).assistant_end,)
