"""The model: the GPT (`gpt.py`), the Muon optimizer, and the KV-cache sampling decoder.

Torch: every module, at import. Only engine-side processes load this package."""
