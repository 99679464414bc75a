"""Data: where text comes from and what training reads of it.

    `sources` (files listed, pieces planned) → `readers` (documents streamed) → `split` (by id
    hash) → `build` (a cache folder: tokenizer, worker processes, resumable shards) → `prepare`
    (found or built, under a lock; a mixture's per part) → `cache` (token streams) → `batches`
    (seed, g)

Beside them: `tokenizer` (train a BPE, its end token, bytes per token), `encoder` (a corpus's ids
by tiktoken where it gives the tokenizer's own, checked), `children` (the build's processes: how
many, Ctrl-C, dying with it), `store` (where caches are, their keys, listing and removing),
`budget` (what a run's steps make of its source), `hub` (hf: sources), `pretrained` (a pretrained
tokenizer: a local folder, or an hf: model repo's tokenizer files fetched), `formats` (the files a
source holds, by suffix: read, skipped as not text, or refused) and `spool` (a large compressed
file's pieces, decompressed once into plain files).

Conversations, for fine-tuning to chat: `chat_template` (the template's special tokens, which every
BPE reserves; a conversation rendered to ids and a loss mask; its Jinja form for transformers).

Torch: never. numpy and tokenizers at import in `cache`, `tokenizer`, `encoder`, `batches`,
`build` and `prepare`; `chat_template`, `sources`, `readers`, `split`, `children`, `store`, `budget`, `hub`,
`pretrained`, `formats` and `spool` import neither, and the front-end reads them."""
