"""Training: the Trainer and its step, optimizer groups and schedule, checkpoints written and
loaded, the NaN report, the micro-batch that fits memory, the process group (DDP, FSDP2), and the
loggers that copy the metrics to TensorBoard and Weights & Biases.

Torch: every module, at import (loggers only when TensorBoard's starts). Only engine-side processes
load this package."""
