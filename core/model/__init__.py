"""The model: the GPT (`gpt`), its loss and mask parts, Muon (`muon`) and the sampling decoder (`sampling`).

The GPT's loss, a block of rows at a time with the logit soft-cap, is in `head_loss`; its
sliding-window attention masks in `attention_masks`.

Torch: every module, at import. Only engine-side processes load this package."""
