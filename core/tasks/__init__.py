"""Downstream tasks: whether the model gets smarter, scored while it trains and on any checkpoint.

`items` (the three kinds of item, their token sequences, few-shot examples, accuracy and CORE's
centring), `files` (a task read from a local JSON-lines file), `python_functions` (the built-in
task made from the held-out standard-library files), `python_functions_chat` (the same held-out
functions asked for in the chat template, `python-functions-chat`), `core_bundle` (the CORE tasks of a local
bundle, as nanochat scores them), `hub_tasks` (named tasks fetched from the Hugging Face Hub),
`catalog` (what a name in `eval.tasks`
means, checked before a run starts), `scoring` (a model's choices, batched into few shapes), and
`reading` and `bounded_yaml` (every task source read as a regular file, to a stated size, its YAML
bounded: what another account or a damaged file could hang or exhaust otherwise).

Torch: only `scoring`, at import; the rest is read by the front-end before any engine starts."""
