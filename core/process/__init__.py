"""The processes: the engine, torchrun's ranks, the run host, and the front-end's handles on them.

The engine (`engine`: a spawned child that runs the Trainer or torchrun's launcher), what every
engine-side process is made of (`child`), torchrun's ranks (`launcher`, `rendezvous`), and the
front-end's handle on the engine (`runner`). A detachable run: the run host that owns its engine
and outlives every front-end (`host`), where it is found and whether it still trains (`live`),
how its start went (`report`), and a front-end's handle on it (`viewer`). What the owner of an
engine (the host, or `--run`'s front-end) watches and says of it: an engine gone silent (`stall`),
and word of the run's events sent where the user is (`notify`).

Torch: never at import; the engine and the ranks import it when they start, in their own process.
The front-end imports `runner`, `rendezvous`, `host`, `live`, `report`, `viewer`, `stall` and `notify`."""
