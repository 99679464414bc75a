"""The cockpit's screens.

`launch` (hardware, presets and runs), `dashboard` (a live run), `chat` (chat with a past run),
`compare` (runs side by side) and `dialogs` (the modal dialogs)."""
