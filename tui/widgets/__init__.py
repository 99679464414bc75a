"""The cockpit's widgets.

`charts` (the loss chart), `compare_chart` (several runs' losses on one plot), `glance` (the
dashboard's one-line readings), `panels` (the dashboard's number panels), `task_panel` (its task
scores over steps), `anatomy_panel` (where its steps' time goes, and the MFU), `layer_panel` (each
block's gradient norm or update ratio over the last records, a heatmap), `chat_pane` (the chat pane) and `log_pane` (a log that wraps again to its width)."""
