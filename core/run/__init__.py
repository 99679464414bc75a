"""The run folder on disk: its layout, lock and metrics log (`folder`), a checkpoint folder found
and checked (`checkpoints`), what a checkpoint's pickled metadata may name, checked without running
any of it (`checkpoint_pickle`), a resume planned before any engine starts (`resume`), and the
optional packages a run's config needs, looked for before its folder is made (`extras`).

Torch: never. The front-end reads all of it."""
