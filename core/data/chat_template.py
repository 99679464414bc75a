"""The chat template in one place: its special tokens, ids with a loss mask, the prompt, its Jinja form.

`render` gives a conversation's ids and loss mask, `prompt_ids` what a chat model answers, and
`JINJA` the same template for `transformers`' apply_chat_template. nanochat's shape: a conversation
opens with the start token (the tokenizer's end-of-text, which a pretrained model already reads as
"a new document begins"), then each turn between its own pair of tokens:

    <|endoftext|><|user_start|>Hi<|user_end|><|assistant_start|>Hello!<|assistant_end|>

The mask is 1 on the assistant's text and its <|assistant_end|> (what fine-tuning learns: to answer,
and to stop) and 0 elsewhere, the <|assistant_start|> included (the prompt's last token, never the
model's to produce). A system message is folded into the first user turn, "SYSTEM\\n\\nUSER", as
nanochat folds it: no token of its own, so a tokenizer without them gains four tokens, not six.

A message's text is always text: "<|user_end|>" typed by a user is encoded as its characters, never
as the token, so no content can forge a turn. The Jinja template (`JINJA`) renders a string that
`transformers` tokenises; there a literal special token's string in a message would become the token.
That edge apart, its ids equal `render`'s (tests/test_chat_template.py).
Torch, numpy: never.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError

END_OF_TEXT = "<|endoftext|>"  # tokenizer.EOS: what separates pretraining's documents, and opens a conversation
USER_START, USER_END = "<|user_start|>", "<|user_end|>"
ASSISTANT_START, ASSISTANT_END = "<|assistant_start|>", "<|assistant_end|>"
TURN_TOKENS = (USER_START, USER_END, ASSISTANT_START, ASSISTANT_END)
RESERVED = (END_OF_TEXT, *TURN_TOKENS)  # the special tokens every BPE lmcockpit trains holds, in this order
ROLES = ("system", "user", "assistant")
SYSTEM_JOIN = "\n\n"  # between a folded system message and the first user message

# What `transformers`' apply_chat_template renders: the same string `render` encodes. `eos_token` is
# the tokenizer config's (lmcockpit saves its tokenizers with <|endoftext|> there).
JINJA = (
    "{%- set ns = namespace(system='') -%}"
    "{{- eos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = message['content'] + '\\n\\n' -%}"
    "{%- elif message['role'] == 'user' -%}"
    "<|user_start|>{{- ns.system + message['content'] -}}<|user_end|>"
    "{%- set ns.system = '' -%}"
    "{%- else -%}"
    "<|assistant_start|>{{- message['content'] -}}<|assistant_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant_start|>{%- endif -%}"
)


@dataclass(frozen=True)
class ChatIds:
    """The template's token ids in one tokenizer."""
    start: int
    user_start: int
    user_end: int
    assistant_start: int
    assistant_end: int


def chat_ids(tok, start: str = END_OF_TEXT) -> ChatIds:
    """`tok`'s ids of the template's tokens; `start`: its end-of-text token's name where it is not
    ours (tokenizer.eos_token). A ConfigError names what it lacks: a tokenizer made before lmcockpit
    reserved the turn tokens gains them by tokenizer.add_chat_tokens."""
    found = {name: tok.token_to_id(name) for name in (start, *TURN_TOKENS)}
    lacking = [name for name, i in found.items() if i is None]
    if lacking:
        raise ConfigError(f"the tokenizer has no {', '.join(lacking)}: it was made before lmcockpit reserved the chat "
                          "template's tokens (tokenizer.add_chat_tokens adds them)")
    return ChatIds(*found.values())


def folded(messages: list[dict]) -> list[dict]:
    """The messages with a leading system message folded into the first user message."""
    if messages and messages[0]["role"] == "system":
        rest = [dict(m) for m in messages[1:]]
        if rest and rest[0]["role"] == "user":
            rest[0]["content"] = messages[0]["content"] + SYSTEM_JOIN + rest[0]["content"]
        return rest
    return list(messages)


def render_many(conversations: list[list[dict]], tok, start: str = END_OF_TEXT) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) of each conversation, its texts encoded in one batch. Messages are taken as
    validated (conversations.check_messages): roles from ROLES, a system message first if at all."""
    ids = chat_ids(tok, start)
    turns = [folded(messages) for messages in conversations]
    encoded = iter(_encode_text(tok, [m["content"] for messages in turns for m in messages]))
    out = []
    for messages in turns:
        tokens, mask = [ids.start], [0]
        for m in messages:
            text = next(encoded)
            if m["role"] == "user":
                tokens += [ids.user_start, *text, ids.user_end]
                mask += [0] * (len(text) + 2)
            else:
                tokens += [ids.assistant_start, *text, ids.assistant_end]
                mask += [0] + [1] * (len(text) + 1)
        out.append((tokens, mask))
    return out


def render(messages: list[dict], tok, start: str = END_OF_TEXT) -> tuple[list[int], list[int]]:
    """One conversation's ids, and its mask: 1 where a token is the assistant's to produce."""
    return render_many([messages], tok, start)[0]


def prompt_ids(messages: list[dict], tok, start: str = END_OF_TEXT) -> list[int]:
    """What a chat model is given to answer the last message, a user's: the conversation so far
    rendered, then <|assistant_start|>. Generation stops at <|assistant_end|>."""
    if not messages or messages[-1]["role"] != "user":
        last = messages[-1]["role"] if messages else "nothing"
        raise ValueError(f"a prompt ends with the user's message, not {last}")
    tokens, _ = render(messages, tok, start)
    return tokens + [chat_ids(tok, start).assistant_start]


def _encode_text(tok, texts: list[str]) -> list[list[int]]:
    """Each text's ids with special tokens' strings read as text (as a corpus is encoded: encoder.py)."""
    if not texts:
        return []
    was = tok.encode_special_tokens
    tok.encode_special_tokens = True
    try:
        return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
    finally:
        tok.encode_special_tokens = was
