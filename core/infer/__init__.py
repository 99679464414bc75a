"""A trained model outside training: loaded for sampling, served to a chat, exported, scored.

A checkpoint loaded for sampling (`load`), the chat engine process and its front-end handle
(`chat_engine`), whether a run or checkpoint is a chat model (`chat_model`), the Hugging Face export (`export`), and a checkpoint scored on downstream tasks
(`task_eval`, what `lmcockpit eval` runs; `harness`, the same by lm-evaluation-harness, which finds
lm-eval's own tasks by name through `harness_index`).

Torch: never at import; `load`, `export`, `task_eval` and `harness` import it when called. The front-end imports
`chat_engine` and `chat_model` and calls `export`."""
