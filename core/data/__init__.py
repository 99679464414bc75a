"""Data: sources read as documents, the train/validation split, the tokenizer, the token cache on
disk and the batches drawn from it.

Torch: never. numpy and tokenizers at import in `cache`, `tokenizer` and `batches`; `store` (where
the caches live) imports neither, for the front-end."""
