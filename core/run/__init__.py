"""The run folder on disk, and what is known of runs before any engine starts.

Its layout, lock and metrics log (`folder`), a checkpoint folder found and checked
(`checkpoint_folder`), what a checkpoint's pickled metadata may name, checked without running any of it
(`checkpoint_pickle`), a resume planned before any engine starts (`resume`), the optional
packages a run's config needs, looked for before its folder is made (`extras`), runs read side by
side as loss curves (`curves`), when a run will reach its target loss (`target`), and files written where another account may have planted a name first
(`safe_files`).

Torch: never. The front-end reads all of it."""
