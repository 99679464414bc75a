"""The machine: device and precision, the GPUs, the doctor's checks, and whether a preset fits.

`device` (which device and precision a run uses, its attention kernel, the peak FLOP/s for MFU),
`compute_estimate` (the cards' peaks, FLOPs per token counted without torch, how long a run should take),
`cpu_precision` (bf16 or fp32 on a CPU, by a short probe), `attention` (which kernel grouped-query
attention runs on), `gpu_env` (the GPU environment: allocator settings set before CUDA starts, and
NVML facts), `telemetry` (GPU and system readings, from NVML and psutil), `doctor` (the torch
side of `lmcockpit doctor`) and `memory_estimate` (the memory arithmetic that says whether a preset fits).

Torch: `device` and `doctor` import it (the engine's and the doctor's child process), and
`cpu_precision` when its probe runs; `gpu_env`, `telemetry`, `memory_estimate`, `compute_estimate` and `attention` never do: they
are what the front-end reads."""
