"""Data: where text comes from and what training reads of it.

    sources (files listed, pieces planned) → readers (documents streamed) → split (by id hash)
    → build (a cache folder: tokenizer, one worker per core, resumable shards) → prepare (found or
    built, under a lock; a mixture's per part) → cache (token streams) → batches (seed, g)

Beside them: tokenizer (train a BPE, encode), store (where caches are, their keys, listing and
removing), budget (what a run's steps make of its source), hub (hf: sources).

Torch: never. numpy and tokenizers at import in `cache`, `tokenizer`, `batches`, `build` and
`prepare`; `sources`, `readers`, `split`, `store`, `budget` and `hub` import neither, and the
front-end reads them."""
