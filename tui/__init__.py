"""Front-ends: the `lmcockpit` command, the Textual cockpit and the headless console.

The command: `cli` (its entry), `commands` (every command, in one list), `help`, `usage` (bad
input: one red `error:` line), `completers` and `completion` (tab completion), and `runplan`
(what starting a run needs). Its commands, one module each: `attach`, `chat`, `compare`, `data`,
`detach`, `doctor`, `export`, `presets`, `ps` and `serve` (with `serve_session`, one browser tab's
cockpit, and `webserver`, textual-serve's server). The front-ends: `app` (the cockpit, with its
screens/ and widgets/), `headless` (`lmcockpit --run`), `bridge` (engine events into Textual) and
`runview` (what a front-end knows of a run).

Never imports torch."""
