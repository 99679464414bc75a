"""Front-ends: the `lmcockpit` command, the Textual cockpit and the headless console.

The command: `cli` (its entry and the bare command's forms: the cockpit, `--run`, `--detach`),
commands/ (every `lmcockpit COMMAND`, one module each, the registry in its `__init__`), `usage`
(bad input: one red `error:` line), `completers` (what tab completion offers), `runplan` (what
starting a run needs) and `detach` (a run started in the background). The front-ends: `app` (the
cockpit, with its screens/ and widgets/), `headless` (`lmcockpit --run`), `bridge` (engine events
into Textual; what a front-end knows of a run is core/run/state.py's RunState). What both the commands and the
cockpit show: `formatting` (how a figure is written) and `rows` (the presets' and a comparison's
table rows).

Screens and widgets never import a command: what both show lives in a module both import.
Never imports torch."""
