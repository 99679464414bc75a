"""The processes: the engine (a spawned child that runs the Trainer or torchrun's launcher), what
every engine-side process is made of (`child`), torchrun's ranks (`launcher`, `rendezvous`), and
the front-end's handle on them (`runner`).

Torch: never at import; the engine and the ranks import it when they start, in their own process.
The front-end imports `runner` and `rendezvous`."""
