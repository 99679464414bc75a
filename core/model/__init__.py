"""The model: the GPT (`gpt`), its loss a block of rows at a time with the logit soft-cap
(`head_loss`), its sliding-window attention masks (`attention_masks`), the Muon optimizer (`muon`),
and the KV-cache sampling decoder (`sampling`).

Torch: every module, at import. Only engine-side processes load this package."""
