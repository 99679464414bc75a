"""The run folder on disk, what is known of runs before any engine starts, and a run as its events make it.

Its layout, lock and metrics log (`folder`), metrics.jsonl's rows written and read as protocol
events (`rows`), a checkpoint folder found and checked
(`checkpoint_folder`), what a checkpoint's pickled metadata may name, checked without running any of it
(`checkpoint_pickle`), a resume planned before any engine starts (`resume`), the optional
packages a run's config needs, looked for before its folder is made (`extras`), runs read side by
side as loss curves (`curves`), a run as its events make it, the one fold of them every view
reads (`state`), a run's history at a size that does not grow with it (`history`), where its time
went, by part of a step and by work between steps (`anatomy`), the last records of each block's
health (`layer_history`),
and its summary beside metrics.jsonl (`history_file`), where a chart's x-axis ticks go and how they
read (`ticks`), when a run will reach its target loss (`target`), what a fine-tuning run says of its base and its
gains (`lineage`), and files written where another
account may have planted a name first (`safe_files`).

Torch: never. The front-end reads all of it."""
