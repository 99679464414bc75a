"""A task's items, the token sequences each is scored by, and what the scores add up to.

Three kinds, as CORE (DCLM's benchmark, which nanochat scores) has them:
* multiple choice: one context, several continuations (HellaSwag, ARC); the continuation with the
  lowest mean loss over its own tokens wins, or, when the item names a `neutral` context, the one
  whose summed loss the real context lowers most below its loss after the neutral one;
* schema: several contexts, one continuation (Winograd); the context after which the
  continuation's mean loss is lowest wins;
* language modelling: one context, one continuation (LAMBADA), right when every continuation
  token is the model's greedy argmax.

An option is a context and a continuation. Its tokens are the end-of-text token (a document's
start, as training sees one), the few-shot examples, the context, and then what the continuation
adds: the tokens of the whole text past those of the text without it, nothing prepended to the
continuation. Few-shot examples come from the task's other items, drawn by a seed fixed per item
(nanochat's `random.Random(1234 + index)`), so every run and rank shows the model the same prompts.
Torch: never.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..config import ConfigError

MULTIPLE_CHOICE, SCHEMA, LANGUAGE_MODELING = "multiple_choice", "schema", "language_modeling"
KINDS = (MULTIPLE_CHOICE, SCHEMA, LANGUAGE_MODELING)
FEWSHOT_SEED = 1234  # nanochat's: the same examples for the same item list
FEWSHOT_SEPARATOR = "\n\n"
CORE_GROUP = "core"  # Task.group of the CORE tasks, whose centred accuracies CORE averages

Encode = Callable[[list[str]], list[list[int]]]  # texts to token ids, nothing special added


@dataclass(frozen=True)
class Item:
    """One question. Multiple choice: `contexts` holds one, `continuations` the choices; schema:
    `contexts` the choices, `continuations` one; language modelling: one of each (gold 0)."""
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    gold: int = 0
    neutral: str = ""  # multiple choice only: the context each choice's loss is measured against

    def options(self) -> list[tuple[str, str]]:
        if len(self.contexts) > 1:
            return [(c, self.continuations[0]) for c in self.contexts]
        return [(self.contexts[0], c) for c in self.continuations]

    def example(self, delimiter: str) -> str:
        """The item answered, as a few-shot example shows it."""
        context, continuation = self.options()[self.gold]
        return context + delimiter + continuation


@dataclass(frozen=True)
class Task:
    name: str
    kind: str
    items: tuple[Item, ...]
    fewshot: int = 0
    delimiter: str = ""  # between context and continuation: CORE's tasks use " "
    chance: float | None = None  # None: 1 / choices, averaged over the items (0 for language modelling)
    group: str = ""  # CORE_GROUP for a CORE task
    special: tuple[str, ...] = ()  # special tokens' strings its texts hold: each must encode as one token

    def chance_level(self) -> float:
        if self.chance is not None:
            return self.chance
        if self.kind == LANGUAGE_MODELING or not self.items:
            return 0.0
        return sum(1 / len(item.options()) for item in self.items) / len(self.items)


@dataclass(frozen=True)
class Tokens:
    """One option in tokens: `tokens[start:]` are the continuation's."""
    ids: list[int]
    start: int


@dataclass
class Scored:
    """What the model made of one option: its continuation tokens' summed loss, their count, and
    whether each was the greedy argmax."""
    loss_sum: float
    count: int
    all_argmax: bool

    @property
    def mean(self) -> float:
        return self.loss_sum / self.count


@dataclass
class Result:
    accuracy: float
    centered: float
    items: int
    predictions: list[int] = field(default_factory=list)

    def row(self) -> dict[str, float]:
        return {"accuracy": self.accuracy, "centered": self.centered, "items": self.items}


def subset(n: int, at_most: int) -> list[int]:
    """Which of `n` items a task scores when it may score `at_most` (0: all): a spread drawn by a
    fixed seed, in the items' order, the same at every evaluation."""
    if not at_most or at_most >= n:
        return list(range(n))
    return sorted(random.Random(FEWSHOT_SEED).sample(range(n), at_most))


def fewshot_prefix(task: Task, index: int) -> str:
    """The examples item `index` is shown before its own context: `task.fewshot` other items,
    answered, drawn by the item's fixed seed."""
    if not task.fewshot:
        return ""
    others = [i for i in range(len(task.items)) if i != index]
    chosen = random.Random(FEWSHOT_SEED + index).sample(others, min(task.fewshot, len(others)))
    return "".join(task.items[i].example(task.delimiter) + FEWSHOT_SEPARATOR for i in chosen)


def option_texts(task: Task, index: int) -> list[tuple[str, str]]:
    """Each option as (the text before its continuation, the continuation), and for a multiple
    choice item with a neutral context, the same continuations after it, following."""
    item, prefix = task.items[index], fewshot_prefix(task, index)
    texts = [(prefix + context + task.delimiter, continuation) for context, continuation in item.options()]
    if item.neutral:
        texts += [(prefix + item.neutral + task.delimiter, continuation) for _, continuation in item.options()]
    return texts


def sequences(texts: list[tuple[str, str]], encode: Encode, eos: int | None, max_len: int) -> list[Tokens]:
    """The options in tokens, each at most `max_len` long (its start cut off, never its
    continuation's last tokens, as a context window would)."""
    encoded = encode([before for before, _ in texts] + [before + after for before, after in texts])
    out = []
    for before, whole in zip(encoded[:len(texts)], encoded[len(texts):]):
        start = common_prefix(before, whole)
        head = [] if eos is None else [eos]  # a tokenizer with no end-of-text token: nothing marks the start
        ids = head + whole
        cut = max(0, len(ids) - max_len)
        out.append(Tokens(ids[cut:], max(1, start + len(head) - cut)))
    return out


def check_special(task: Task, encode: Encode) -> None:
    """Refuse a task whose texts hold special tokens the tokenizer lacks: it would read their
    strings as text, and score options the model never sees in use."""
    lacking = [s for s, ids in zip(task.special, encode(list(task.special))) if len(ids) != 1]
    if lacking:
        raise ConfigError(f"eval.tasks: {task.name} needs a tokenizer holding the chat template's turn tokens; "
                          f"this one has no {', '.join(lacking)} (a tokenizer made before lmcockpit reserved "
                          f"them: fine-tune the run on conversations, which adds them, or take {task.name} out "
                          "of eval.tasks)")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def choose(task: Task, item: Item, scored: list[Scored]) -> int:
    """The option the model picks, from its options' scores (in option_texts' order)."""
    if task.kind == LANGUAGE_MODELING:
        return 0 if scored[0].all_argmax else -1
    n = len(item.options())
    if item.neutral:
        lowered = [scored[i].loss_sum - scored[n + i].loss_sum for i in range(n)]
        return min(range(n), key=lowered.__getitem__)
    return min(range(n), key=lambda i: scored[i].mean)


def result_of(task: Task, chosen: list[int], predictions: list[int]) -> Result:
    """The score of the items `chosen` (indices into task.items), given the option picked for each."""
    right = sum(p == task.items[i].gold for i, p in zip(chosen, predictions))
    accuracy = right / len(predictions) if predictions else 0.0
    return Result(accuracy, centered(accuracy, task.chance_level()), len(predictions), predictions)


def centered(accuracy: float, chance: float) -> float:
    """CORE's centring: 0 at chance, 1 at every item right."""
    return (accuracy - chance) / (1 - chance)


class Digest(str):
    """A rank's tasks as `digest` gives them; any other answer a rank gives is why it read none."""


def digest(tasks: list[Task]) -> str:
    """What ranks compare before sharing tasks' items out: the same names, settings and items in
    the same order give the same digest on any machine."""
    import hashlib

    return hashlib.sha256(repr([(t.name, t.kind, t.fewshot, t.delimiter, t.chance, t.group, t.items)
                                for t in tasks]).encode()).hexdigest()[:16]


def agree(answers: list[str]) -> None:
    """Refuse, on every rank alike, tasks that are not the same on every rank: each rank's answer
    (by rank) is its `Digest`, or the reason it could not read them. Items that differ between
    machines would have the ranks sum choices made on different items, or hang the sum when the
    counts differ: python-functions is made from each machine's own standard library, and a task
    file may differ from node to node."""
    for rank, answer in enumerate(answers):
        if not isinstance(answer, Digest):
            raise ConfigError(f"rank {rank}: {answer}")
    apart = [rank for rank, answer in enumerate(answers) if answer != answers[0]]
    if apart:
        raise ConfigError(f"eval.tasks: the ranks read different items (rank 0 and rank{'s' * (len(apart) > 1)} "
                          f"{', '.join(map(str, apart))} differ): every machine must hold the same task files, and "
                          f"python-functions, made from each machine's Python standard library, needs the same "
                          f"Python version everywhere")


def core_score(results: dict[str, Result], tasks: Sequence[Task]) -> float | None:
    """CORE: the mean centred accuracy of the CORE tasks, when there are some and every one of
    them was scored."""
    core = [task.name for task in tasks if task.group == CORE_GROUP]
    if not core or any(name not in results for name in core):
        return None
    return sum(results[name].centered for name in core) / len(core)
