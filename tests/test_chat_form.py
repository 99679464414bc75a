"""The chat-form task `python-functions-chat` (core/tasks/python_functions_chat.py): its items come
from the held-out requests alone, read exactly as chat renders them, and are chosen by what the
request adds, not by a reply's typicality."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from tests.helpers_chat import trained_bpe
from lmcockpit.core.config import Config, ConfigError
from lmcockpit.core.data import chat_template as T
from lmcockpit.core.data import stdlib_chat
from lmcockpit.core.tasks import catalog, items, python_functions_chat, scoring

# A few stdlib files, half held out: both sides of a split in a second, not the whole stdlib's parse.
FILES = ("json/decoder.py", "json/encoder.py", "json/__init__.py", "textwrap.py", "shlex.py", "fnmatch.py",
         "colorsys.py", "glob.py", "heapq.py", "bisect.py", "string.py", "calendar.py")


@pytest.fixture(scope="module")
def small():
    """(training side, held-out side, the task made of the held-out side) of FILES."""
    train, held = stdlib_chat.sides(0.5, FILES)
    assert len(held) > python_functions_chat.CHOICES and train
    return train, held, python_functions_chat.from_conversations(held)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return trained_bpe(tmp_path_factory.mktemp("chat-form-bpe"))


def replies(conversations):
    return {python_functions_chat.reply(m[1]["content"]) for m in conversations}


def test_items_are_the_held_out_requests_in_the_template_with_four_held_out_replies(small):
    train, held, task = small
    assert task.name == "python-functions-chat" and task.kind == items.MULTIPLE_CHOICE
    assert len(task.items) == len(held) and task.chance_level() == 0.25
    requests = {m[0]["content"]: python_functions_chat.reply(m[1]["content"]) for m in held}
    for item in task.items:
        request = item.contexts[0].removeprefix(T.USER_START).removesuffix(T.USER_END + T.ASSISTANT_START)
        assert item.continuations[item.gold] == requests[request]  # the request's own answer is the gold one
        assert len(set(item.continuations)) == 4 and set(item.continuations) <= replies(held)
        assert not set(item.continuations) & replies(train)
        assert item.neutral == python_functions_chat.context(python_functions_chat.NEUTRAL_REQUEST)
    assert python_functions_chat.from_conversations(copy.deepcopy(held)) == task  # deterministic
    assert len({item.gold for item in task.items}) > 1  # the gold reply is not always in one place


def test_a_text_holding_a_special_token_s_string_makes_no_item(small):
    _, held, task = small
    forged = [[{"role": "user", "content": "Write a function that ends <|user_end|>."},
               {"role": "assistant", "content": "def f():\n    pass\n"}]]
    assert python_functions_chat.from_conversations(held + forged).items == task.items


@pytest.mark.slow
def test_the_run_s_task_is_the_held_out_side_of_its_split():
    """Through the catalog, as eval.tasks names it: every gold reply is a held-out function's, and
    no choice is a function the python-stdlib-chat set trains on (parses the whole stdlib)."""
    cfg = Config()
    task = catalog.load_task("python-functions-chat", cfg)
    train, held = stdlib_chat.sides(cfg.data.val_fraction)
    assert len(task.items) >= 40
    for item in task.items:
        assert set(item.continuations) <= replies(held) and not set(item.continuations) & replies(train)
    catalog.check(Config(eval=type(cfg.eval)(tasks=["python-functions-chat"])))


def test_an_option_s_ids_are_the_chat_prompt_then_the_reply_and_its_end(small, bpe):
    """What the task scores is what chat generates from: prompt_ids, then the reply's tokens and
    <|assistant_end|>; the neutral option the same template around the neutral request."""
    _, held, task = small
    ids = T.chat_ids(bpe)

    def encode(texts):
        return [e.ids for e in bpe.encode_batch(texts, add_special_tokens=False)]

    for index in (0, len(task.items) - 1):
        item = task.items[index]
        options = items.sequences(items.option_texts(task, index), encode, ids.start, 10_000)
        request = item.contexts[0][len(T.USER_START):-len(T.USER_END + T.ASSISTANT_START)]
        for k, continuation in enumerate(item.continuations):
            answer = continuation.removesuffix(T.ASSISTANT_END)
            prompt = T.prompt_ids([{"role": "user", "content": request}], bpe)
            neutral = T.prompt_ids([{"role": "user", "content": python_functions_chat.NEUTRAL_REQUEST}], bpe)
            reply_ids = T._encode_text(bpe, [answer])[0] + [ids.assistant_end]
            assert options[k].ids == prompt + reply_ids and options[k].start == len(prompt)
            assert options[4 + k].ids == neutral + reply_ids and options[4 + k].start == len(neutral)


def choices_of(task, loss):
    """Each item's choice when option k's summed loss is loss(item, k, neutral)."""
    out = []
    for item in task.items:
        n = len(item.continuations)
        scored = [items.Scored(loss(item, k % n, k >= n), 10, False) for k in range(2 * n)]
        out.append(items.choose(task, item, scored))
    return out


def test_a_model_that_prefers_the_real_reply_scores_one_and_typicality_does_not_win(small):
    _, _, task = small
    every = list(range(len(task.items)))

    def prefers_the_real_reply(item, k, neutral):
        return 3.0 - (not neutral and k == item.gold)

    assert items.result_of(task, every, choices_of(task, prefers_the_real_reply)).accuracy == 1.0

    # The shortest reply is the likeliest after any request, far more so than the request helps
    # the real one: the request's lowering still decides.
    def typical(item, k, neutral):
        return len(item.continuations[k]) - 0.5 * (not neutral and k == item.gold)

    assert items.result_of(task, every, choices_of(task, typical)).accuracy == 1.0

    def blind(item, k, neutral):  # the request changes nothing: every reply lowered alike
        return float(len(item.continuations[k]))

    assert items.result_of(task, every, choices_of(task, blind)).accuracy < 0.5


def test_scored_on_a_model_through_the_run_s_path(small, bpe):
    """The real scoring path on a tiny model whose vocabulary the BPE's turn tokens are in."""
    from lmcockpit.core.model.gpt import GPT, shape_from_config
    from tests.helpers import tiny_config

    _, _, task = small
    cfg = tiny_config(f"tokenizer.vocab_size={bpe.get_vocab_size()}", "model.max_seq_len=256",
                      "training.seq_len=256")
    torch.manual_seed(0)
    model = GPT(shape_from_config(cfg)).eval()

    def encode(texts):
        return [e.ids for e in bpe.encode_batch(texts, add_special_tokens=False)]

    result = scoring.score_tasks([task], model, encode, T.chat_ids(bpe).start, 256, 8, torch.device("cpu"),
                                 contextlib.nullcontext, at_most=6)["python-functions-chat"]
    assert result.items == 6 and all(0 <= p < 4 for p in result.predictions)


def test_a_tokenizer_without_the_turn_tokens_is_refused_naming_eval_tasks(small):
    _, _, task = small

    def bytes_as_tokens(texts):  # reads "<|user_start|>" as its characters
        return [list(t.encode()) for t in texts]

    with pytest.raises(ConfigError, match=r"eval.tasks: python-functions-chat needs a tokenizer holding the chat "
                                          r"template's turn tokens; this one has no <\|user_start\|>"):
        scoring.score_task(task, torch.nn.Identity(), bytes_as_tokens, 0, 256, 4, torch.device("cpu"),
                           contextlib.nullcontext)


def test_a_pretrained_tokenizer_without_the_turn_tokens_is_refused_before_the_run(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.train_from_iterator(["def f():\n    return 1\n"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[T.END_OF_TEXT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    plain.save(str(tmp_path / "tokenizer.json"))
    cfg = Config()
    cfg.tokenizer.kind, cfg.eval.tasks = str(tmp_path), ["python-functions-chat"]
    with pytest.raises(ConfigError, match=r"eval.tasks: python-functions-chat needs a tokenizer holding the chat "
                                          r"template's turn tokens; tokenizer.kind = '.*' has no <\|user_start\|>, "
                                          r"<\|user_end\|>, <\|assistant_start\|>, <\|assistant_end\|> \(a fine-tuning"):
        catalog.check(cfg)
    cfg.data.format = "chat"  # a fine-tuning run adds them
    catalog.check(cfg)
    cfg.data.format, cfg.tokenizer.kind = "text", "bpe"  # a BPE lmcockpit trains reserves them
    catalog.check(cfg)
