"""Training: the Trainer and its step, optimizer groups and schedule, checkpoints written and
loaded, the NaN report, the micro-batch that fits memory, and the process group (DDP, FSDP2).

Torch: every module, at import. Only engine-side processes load this package."""
