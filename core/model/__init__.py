"""The model: the GPT (`gpt`), the Muon optimizer (`muon`), and the KV-cache sampling decoder (`sampling`).

Torch: every module, at import. Only engine-side processes load this package."""
