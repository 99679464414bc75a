"""The engine and everything it needs, by concern.

`config` (a run's configuration: one TOML file in sections, validated into dataclasses, each key
declared once with its rules through `config_keys`, and the arithmetic of its batch and
sequence-length schedules in `step_schedules`) and
`protocol` (the messages between a front-end and the engine process) are the two contracts every
package reads and import none of the packages; these stand in floors, each importing only those
below it, inside a function too (tests/test_layout.py reads this list, top floor first, and names
the lazy imports that climb still, in CLIMBS):

    infer/     a trained model outside training: loading it, the chat engine, Hugging Face export
    process/   the processes: the engine, torchrun's launcher and ranks, the front-end's handle on them
    train/     the training loop: trainer, optimizers, checkpoints, NaN report, memory fitting, process group
    model/     the GPT, Muon, the sampling decoder
    tasks/     downstream tasks: their items and files, the built-in one, scoring a model on them
    data/      sources, tokenizer, token cache, batches
    hardware/  device and precision, GPU environment, telemetry, doctor, memory arithmetic
    run/       the run folder on disk: its files, checkpoints found and checked, resume planned

Torch: each package's docstring says whether its modules import torch when imported. The
front-end (tui/) imports only modules that do not; tests/test_layout.py holds both rules."""
