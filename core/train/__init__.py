"""Training: the Trainer and everything its steps use.

The Trainer's loop and step (`trainer`) and its parts: what it does when a step goes wrong
(`recovery`), what it measures between steps (`evaluation`) and its checkpoints (`checkpointing`),
a step's time split at its boundaries (`step_clock`), what a step takes under the batch and
sequence-length schedules (`step_plan`), a profile of a few steps asked for from
a front-end (`profiling`), each block's gradient norm and update ratio on demand (`layer_stats`),
and a fine-tuning run's data, starting weights and step 0 (`finetune`);
optimizer groups and schedule (`optim`), checkpoint files written and loaded (`checkpoint_io`), the NaN report (`nan_debug`), the micro-batch that fits memory
and an out-of-memory error explained (`memory_probe`), the process group, DDP or FSDP2 (`group`), loss spikes told from noise (`spikes`),
and the loggers that copy the metrics to TensorBoard and Weights & Biases (`loggers`).

Torch: every module, at import (loggers only when TensorBoard's starts; spikes never). Only engine-side processes
load this package."""
