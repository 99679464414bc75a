"""Front-ends: the `lmcockpit` command, the Textual cockpit and the headless console. Never imports torch."""
