"""The machine: device and precision, the GPU environment (NVML, allocator settings), telemetry,
the doctor's checks, and the memory arithmetic that says whether a preset fits.

Torch: `device` and `doctor` import it (the engine's and the doctor's child process); `gpu_env`,
`telemetry`, `fit` and `attention` (which kernel attention runs on) never do: they are what the
front-end reads."""
