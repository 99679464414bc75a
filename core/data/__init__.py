"""Data: where text comes from and what training reads of it.

    `sources` (files listed, pieces planned) → `readers` (documents streamed) → `split` (by id
    hash) → `build` (a cache folder: tokenizer, worker processes, resumable shards) → `prepare`
    (found or built, under a lock; a mixture's per part) → `cache` (token streams) → `batches`
    (seed, g; `aligned_rows`: data.bos_aligned's rows, each from a document's start)

`token_shards`: data.format = "tokens", text already tokenised in modded-nanogpt's .bin shards,
trained on without a cache, and data.val_source, a shard's first tokens to validate on.

Beside them: `tokenizer` (train a BPE, its end token, bytes per token), `encoder` (a corpus's ids
by tiktoken where it gives the tokenizer's own, checked), `children` (the build's processes: how
many, Ctrl-C, dying with it), `store` (where caches are, their keys, listing and removing),
`budget` (what a run's steps make of its source), `hub` (hf: sources), `pretrained` (a pretrained
tokenizer: a local folder, or an hf: model repo's tokenizer files fetched), `formats` (the files a
source holds, by suffix: read, skipped as not text, or refused) and `spool` (a large compressed
file's pieces, decompressed once into plain files).

Conversations, for fine-tuning to chat: `conversations` (files of them read and checked, a bad
record one error line) → `chat_template` (its special tokens, which every BPE reserves; ids and a
loss mask; its Jinja form for transformers) → `chat_rows` (packed into rows with their masks, a
cache folder of them, batches); `stdlib_chat` is the built-in set, `python-stdlib-chat`; `chat_data`
is a fine-tuning run's data (the base's tokenizer with the turn tokens, in the run folder; its rows),
`base_model` its base checkpoint found and its shape checked, before any engine starts.
`python_source` walks a Python file's documented functions, for the built-in set and the
`python-functions` task alike.

Torch: never. numpy and tokenizers at import in `cache`, `tokenizer`, `encoder`, `batches`, `aligned_rows`,
`build`, `prepare`, `chat_rows`, `chat_data` and `base_model`; `sources`, `token_shards` (numpy where it maps them),
`readers`, `split`, `children`, `store`, `budget`, `hub`, `pretrained`, `formats`, `spool`, `chat_template`,
`conversations`, `stdlib_chat` and `python_source` import
neither, and the front-end reads them."""
