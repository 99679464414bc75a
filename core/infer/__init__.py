"""A trained model outside training: loaded for sampling, served to a chat, exported.

A checkpoint loaded for sampling (`load`), the chat engine process and its front-end handle
(`chat_engine`), and the Hugging Face export (`export`).

Torch: never at import; `load` and `export` import it when called. The front-end imports
`chat_engine` and calls `export`."""
