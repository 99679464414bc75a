"""The processes: the engine, torchrun's ranks, the run host, and the front-end's handles on them.

The engine (`engine`: a child that runs the Trainer or torchrun's launcher), what every
engine-side process is made of (`child`), torchrun's ranks (`launcher`, `rendezvous`), the
front-end's handle on the engine (`runner`), and how it starts: forked from a forkserver that has
torch imported, born with what a spawned child would have had (`warm_start`). A detachable run: the run host that owns its engine
and outlives every front-end (`host`), started apart from the front-end that starts it (`detached`), where it is found and whether it still trains (`live`),
how its start went (`report`), and a front-end's handle on it (`viewer`). What the owner of an
engine (the host, or `--run`'s front-end) watches and says of it: an engine gone silent (`stall`),
and word of the run's events sent where the user is (`notify`).

Torch: never at import; the engine's forkserver and the ranks import it, in their own processes.
The front-end imports `runner`, `warm_start`, `rendezvous`, `host`, `detached`, `live`, `report`, `viewer`, `stall` and `notify`."""
