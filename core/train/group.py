"""What the trainer asks of a run's other processes: `Group` for one process, `ProcessGroup` for several.

One `Group` for a single process (every
collective is the identity) and `ProcessGroup` for several, on torch.distributed.

The trainer is written once against this interface, so a one-process run executes the same loop
with no collectives at all. Under several processes:

* DDP keeps a whole model per process and averages gradients; FSDP2 (`fully_shard` on each block
  and on the root) shards weights, gradients and optimizer state. Both average over ranks, so 2
  processes × accumulation 1 give the gradient of 1 process × accumulation 2.
* Commands are agreed between optimizer steps: one tiny all-reduce says whether any rank has
  something (the front-end's command on rank 0, a signal or a lost parent on any rank), and only
  then are the commands gathered, so every rank acts on the same list in the same order.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from datetime import timedelta

import torch
import torch.distributed as dist

# A rank waits here while rank 0 tokenises the corpus or writes a checkpoint: minutes, not the
# default 10 (NCCL) or 30 (gloo). A dead rank does not wait for this: the launcher ends the run.
COLLECTIVE_TIMEOUT = timedelta(hours=2)


class Group:
    """A single process."""

    rank = 0
    world = 1
    local_rank = 0
    local_world = 1
    strategy = ""
    distributed = False  # whether a torch.distributed process group exists (even of one process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Whether weights and gradients are sharded (FSDP): every rank then takes part in each
        forward pass, sampling and evaluation included, and sums make whole-model figures."""
        return False

    @property
    def bucketed(self) -> bool:
        """Whether DDP wraps the model (also a torchrun group of one): its gradients are views
        into its communication buckets, which must be zeroed in place, never set to None."""
        return False

    def device_spec(self, spec: str) -> str:
        return spec

    def connect(self, device: torch.device) -> None:
        pass

    def local_devices(self, device: torch.device) -> tuple[str, ...]:
        return (str(device),)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the training step calls (before compile)."""
        return model

    def accumulating(self, wrapped: torch.nn.Module, last: bool):
        """Around each micro-batch: how its gradients reach the other ranks (one process: nowhere)."""
        return contextlib.nullcontext()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def agree(self, local: list) -> list:
        return local

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` on every rank."""
        return t

    def gather(self, obj: object) -> list:
        """Every rank's `obj`, by rank, on every rank."""
        return [obj]

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class ProcessGroup(Group):
    """One of several processes started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK set)."""

    distributed = True

    def __init__(self, strategy: str):
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.local_world = int(os.environ["LOCAL_WORLD_SIZE"])
        self.strategy = strategy
        self.device: torch.device | None = None

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    @property
    def bucketed(self) -> bool:
        return not self.sharded

    def device_spec(self, spec: str) -> str:
        """Process i trains on GPU i of its machine; "cpu" (or no GPU) trains on the CPU."""
        if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
            return "cpu"
        if spec.startswith("cuda:"):  # config allows it only with one process per machine
            return spec
        return f"cuda:{self.local_rank}"

    def connect(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)

    def local_devices(self, device: torch.device) -> tuple[str, ...]:
        if device.type == "cuda" and self.local_world > 1:
            return tuple(f"cuda:{i}" for i in range(self.local_world))
        return (str(device),) * self.local_world

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

            for layer in model.layers:
                fully_shard(layer)
                # Sampling calls decode(), not forward(): it must gather the shards too.
                register_fsdp_forward_method(layer, "decode")
            fully_shard(model)
            for method in ("decode", "token_losses"):
                register_fsdp_forward_method(model, method)
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        # Gradients as views into DDP's buckets: otherwise DDP keeps a second copy of every gradient
        # (and the trainer zeroes them in place, memory_estimate.grads_between_steps: set to None, they would
        # come back as fresh tensors beside the buckets). The only buffers are the rotary tables,
        # equal on every rank by construction: broadcasting them before each forward would be a
        # collective per micro-batch for nothing.
        return DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                   gradient_as_bucket_view=True, **no_buffer_sync())

    def accumulating(self, wrapped: torch.nn.Module, last: bool):
        """DDP all-reduces after the last micro-batch only. FSDP reduce-scatters after every one,
        adding into the sharded gradients: left unsynchronised, it would hold each micro-batch's
        gradients whole (4 bytes per parameter on every GPU, what sharding is for saving)."""
        if self.strategy == "fsdp":
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else wrapped.no_sync()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)  # gloo has no AVG
        return t

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        return self.sum(t).div_(self.world)

    def agree(self, local: list) -> list:
        """Every rank's pending commands, the same list on every rank (rank 0's first)."""
        any_pending = torch.tensor([1 if local else 0], device=self.device)
        dist.all_reduce(any_pending, op=dist.ReduceOp.MAX)
        if not int(any_pending.item()):
            return []
        gathered: list[list] = [[] for _ in range(self.world)]
        dist.all_gather_object(gathered, local)
        return [cmd for part in gathered for cmd in part]

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=0)
        return t

    def gather(self, obj: object) -> list:
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, obj)
        return gathered

    def barrier(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def no_buffer_sync() -> dict[str, bool]:
    """DDP's argument that turns off the buffer broadcast before each forward: torch 2.13 renamed
    `broadcast_buffers` to `forward_sync_buffers` and warns (FutureWarning) at the old name."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}
