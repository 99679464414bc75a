"""The cockpit's screens.

`launch` (hardware, presets and runs), `dashboard` (a live run), `checkpoint_chat` (chat with a past
run's checkpoint), `side_by_side` (runs compared) and `dialogs` (the modal dialogs)."""
