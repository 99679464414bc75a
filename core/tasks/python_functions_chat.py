"""The built-in task `python-functions-chat`: the held-out requests asked as a chat model is asked.

Each item is a request of the `python-stdlib-chat` set's validation side (stdlib_chat.held_out: a
function no fine-tuning on the set has answered, in a file no pretraining on `python-stdlib` has
read), in the chat template: the request as the user's turn, then <|assistant_start|> (what
chat_template.prompt_ids gives the model). The choices are four replies, each ending in
<|assistant_end|>: the real function, and the three held-out functions nearest it in length (as
python-functions picks its distractors). Chance is 0.25.

Scored as python-functions is: by how much the request lowers a reply's summed loss (its end token's
included) below its loss after a neutral request in the same template (NEUTRAL_REQUEST), not by the
lowest mean loss. A short, common function is likely after any request; what the task asks is
whether the model reads *this* request. The template stays in the neutral context too, so the
difference is the request's text alone, and the end token costs the same on both sides unless the
request makes the model expect the reply to end there.

The texts hold the template's special tokens as their strings, which the run's tokenizer reads as
the tokens (its encode does not escape them): so an option's ids are exactly prompt_ids then the
reply's (tests/test_chat_form.py). A tokenizer without them would read the strings as text: `check`
refuses a pretrained one before the run, and `SPECIAL` lets scoring refuse any other
(items.check_special), each with one error naming eval.tasks.
Torch: never.
"""

from __future__ import annotations

import random

from ..config import Config, ConfigError
from ..data import chat_template as T
from ..data import pretrained, stdlib_chat
from .items import FEWSHOT_SEED, MULTIPLE_CHOICE, Item, Task

NAME = "python-functions-chat"
CHOICES = 4
NEUTRAL_REQUEST = "Write a function."
SPECIAL = T.TURN_TOKENS  # the tokens its texts hold, each to be read as one token


def check(cfg: Config) -> None:
    """Refuse, before the run, a pretrained tokenizer on hand that lacks the turn tokens, for a run
    that will not add them (a fine-tuning run, data.format = "chat", does). A BPE lmcockpit trains
    reserves them; one whose cache predates that, or a Hub tokenizer not fetched yet, is known only
    once loaded: scoring checks it then (items.check_special)."""
    if cfg.tokenizer.kind == "bpe" or getattr(cfg.data, "format", "text") == "chat":
        return
    folder = pretrained.folder(cfg.tokenizer.kind)
    path = folder / "tokenizer.json" if folder is not None else None
    if path is None or not path.is_file():
        return  # the run's own check of tokenizer.kind says what is missing
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - tokenizers raises plain Exceptions; the run's own load says why
        return
    lacking = [name for name in SPECIAL if tok.token_to_id(name) is None]
    if lacking:
        raise ConfigError(f"eval.tasks: {NAME} needs a tokenizer holding the chat template's turn tokens; "
                          f"tokenizer.kind = {cfg.tokenizer.kind!r} has no {', '.join(lacking)} (a fine-tuning run "
                          f"on conversations adds them; otherwise take {NAME} out of eval.tasks)")


def task(cfg: Config) -> Task:
    """The task from the held-out side of the split `cfg`'s data.val_fraction makes."""
    return from_conversations(stdlib_chat.held_out(cfg.data.val_fraction))


def context(request: str) -> str:
    """The user's turn and the assistant's start, as prompt_ids renders them (the start token is
    the one every option's ids open with: items.sequences)."""
    return f"{T.USER_START}{request}{T.USER_END}{T.ASSISTANT_START}"


def reply(answer: str) -> str:
    return answer + T.ASSISTANT_END


def from_conversations(conversations: list[list[dict]]) -> Task:
    """Items of (request, answer) conversations; one whose text holds a special token's string is
    left out (it would be read as the token, and differ from what chat renders)."""
    pairs = [(m[0]["content"], m[1]["content"]) for m in conversations
             if not any(s in m[0]["content"] + m[1]["content"] for s in T.RESERVED)]
    items = tuple(_item(pairs, i) for i in range(len(pairs))) if len(pairs) > CHOICES else ()
    return Task(NAME, MULTIPLE_CHOICE, items, special=SPECIAL)


def _item(pairs: list[tuple[str, str]], index: int) -> Item:
    request, answer = pairs[index]
    nearest = sorted((abs(len(a) - len(answer)), j) for j, (_, a) in enumerate(pairs) if j != index)
    choices = [reply(pairs[j][1]) for _, j in nearest[:CHOICES - 1]]
    gold = random.Random(FEWSHOT_SEED + index).randrange(CHOICES)
    choices.insert(gold, reply(answer))
    return Item((context(request),), tuple(choices), gold, context(NEUTRAL_REQUEST))
