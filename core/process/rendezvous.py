"""How the processes of a multi-process run find each other: torchrun's rendezvous settings.

These are launch settings, not run settings: they differ from machine to machine (each node has
its own rank) and do not change what is trained, so they travel beside the config rather than in
it. One machine needs none of them. Torch-free: the front-end builds it from the command line.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import CUDA_GRAPH_MODES, Config, ConfigError, cuda_graphs_need_one_process

BACKENDS = ("c10d", "static", "etcd", "etcd-v2")  # torch.distributed.elastic's registered rendezvous handlers


@dataclass(frozen=True)
class Rendezvous:
    endpoint: str = ""  # host:port of the rendezvous (node 0); "": this machine alone, any free port
    node_rank: int = 0  # this machine's place among distributed.nnodes
    run_id: str = "lmcockpit"  # the same on every node of one run, different between runs sharing an endpoint
    backend: str = "c10d"  # torchrun's --rdzv-backend

    def check(self, cfg: Config) -> None:
        """A ConfigError for a run these settings cannot start; `--nproc 1` included, which the
        config alone does not show."""
        nnodes, mode = cfg.distributed.nnodes, cfg.training.compile_mode
        if cfg.training.compile and mode in CUDA_GRAPH_MODES:
            raise ConfigError(cuda_graphs_need_one_process(mode, "asked for by --nproc or --nnodes"))
        if nnodes > 1 and not self.endpoint:
            raise ConfigError(f"distributed.nnodes = {nnodes}: the machines need a meeting point; give "
                              "--rdzv-endpoint HOST:PORT (the same on every machine) and --node-rank")
        if not 0 <= self.node_rank < nnodes:
            raise ConfigError(f"--node-rank {self.node_rank}: expected 0 to {nnodes - 1} "
                              f"(distributed.nnodes = {nnodes})")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--rdzv-backend {self.backend}: expected one of {', '.join(BACKENDS)} (torchrun's)")
        if self.endpoint and ":" not in self.endpoint:
            raise ConfigError(f"--rdzv-endpoint {self.endpoint}: expected HOST:PORT")

    @property
    def endpoint_or_local(self) -> str:
        return self.endpoint or "localhost:0"
