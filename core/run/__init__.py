"""The run folder on disk: its layout, lock and metrics log (`folder`), a checkpoint folder found
and checked (`checkpoints`), and a resume planned before any engine starts (`resume`).

Torch: never. The front-end reads all of it."""
