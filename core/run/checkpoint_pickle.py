"""What a checkpoint's pickled metadata may name, and a check of it that runs nothing. Torch-free.

`train_state/.metadata` is a pickle: torch.distributed.checkpoint (DCP) writes it with
`pickle.dump` and its own reader loads it with a plain `pickle.load`. Unpickling calls whatever
the file names, so a checkpoint from elsewhere could name `os.system` and have it run by
`--resume`; checkpoints are what people share, and whose account a folder belongs to says nothing
of what is in it. So lmcockpit never reads it that way. ALLOWED is every (module, name) that DCP
writes there, listed from the pickles of real checkpoints (tests/test_checkpoint_trust.py lists
them again and compares), and both readers take nothing else:

* `check_metadata` (resume, chat and export, before any engine starts) gives each allowed name an
  inert stand-in that keeps its arguments and imports nothing: the check runs no code of the
  file's, nor of torch's;
* the engine's reader (train/checkpoint_io.py) resolves the same names to the real classes.

Either refuses any other name with one line, and a file that is no metadata pickle as damaged.
The shard files the metadata points to must lie in its own folder (`shard_problem`).
"""

from __future__ import annotations

import pickle
from typing import Any, BinaryIO

from ..config import ConfigError

METADATA = "torch.distributed.checkpoint.metadata"
FILESYSTEM = "torch.distributed.checkpoint.filesystem"

# Every dtype torch 2.13 defines, by the name it pickles as (`torch.float32` is ("torch",
# "float32")): constants, inert, and one day a quantized optimizer's state may hold any of them.
DTYPES = (
    "bfloat16", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "complex128", "complex32", "complex64",
    "float16", "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "float8_e8m0fnu", "int1", "int16", "int2", "int3", "int32", "int4", "int5", "int6", "int64",
    "int7", "int8", "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "uint1", "uint16", "uint2", "uint3", "uint32",
    "uint4", "uint5", "uint6", "uint64", "uint7", "uint8",
)

# (module, name) as the pickle names it → "module:attribute" the engine imports for it.
ALLOWED: dict[tuple[str, str], str] = {
    **{(METADATA, n): f"{METADATA}:{n}" for n in (
        "Metadata", "StorageMeta", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "MetadataIndex",
        "_MEM_FORMAT_ENCODING",  # how TensorProperties pickles its memory format (an Enum)
    )},
    (FILESYSTEM, "_StorageInfo"): f"{FILESYSTEM}:_StorageInfo",  # which shard file holds an entry, where
    ("torch", "Size"): "torch:Size",
    # A layout pickles as a call of this with its name ("torch.strided"), which it looks up among
    # torch's layouts.
    ("torch.serialization", "_get_layout"): "torch.serialization:_get_layout",
    **{("torch", d): f"torch:{d}" for d in DTYPES},
    # The folder the checkpoint was written to (StorageMeta.checkpoint_id). Python 3.13 pickles it
    # from pathlib._local: either is read as this Python's pathlib.PosixPath.
    ("pathlib", "PosixPath"): "pathlib:PosixPath",
    ("pathlib._local", "PosixPath"): "pathlib:PosixPath",
}


def refusal(where: str, module: str, name: str) -> str:
    return f"{where} names {module}.{name}, which no lmcockpit checkpoint holds: refused (nothing in it was run)"


def damaged(where: str, why: object) -> str:
    first = str(why).splitlines()[0] if str(why) else type(why).__name__
    return f"{where} is not a checkpoint's metadata ({first}); the checkpoint is damaged"


def shard_problem(where: str, relative_path: object) -> str | None:
    """Why the shard file an entry points to is not one to read, or None: DCP writes bare names
    (`__0_0.distcp`) beside the metadata, and a path leading elsewhere would have the load read
    any file (or block on a FIFO)."""
    if isinstance(relative_path, str) and relative_path not in ("", ".", "..") and not (
            set(relative_path) & {"/", "\\", "\0"}):
        return None
    return f"{where} points to the shard file {relative_path!r}, outside its own folder: refused"


class AllowListUnpickler(pickle.Unpickler):
    """A pickle.Unpickler that finds only ALLOWED names, each through `resolve`; any other name is
    a ConfigError saying so, raised before anything the file names is looked up. Persistent ids,
    the one other way a pickle reaches outside itself, stay refused (pickle's default)."""

    def __init__(self, file: BinaryIO, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise ConfigError(refusal(self.where, module, name))
        return self.resolve(module, name)

    def resolve(self, module: str, name: str) -> Any:
        raise NotImplementedError


class StandIn:
    """What the check builds for an allowed class, function or constant: called, constructed or
    given state, it keeps what it was given and does nothing else."""

    pickled_as: tuple[str, str] = ("", "")

    def __new__(cls, *args: Any, **kwargs: Any) -> StandIn:
        self = object.__new__(cls)
        self.args, self.state = args, None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state


class InertUnpickler(AllowListUnpickler):
    def __init__(self, file: BinaryIO, where: str):
        super().__init__(file, where)
        self.stand_ins: dict[tuple[str, str], type[StandIn]] = {}

    def resolve(self, module: str, name: str) -> type[StandIn]:
        key = (module, name)
        if key not in self.stand_ins:
            self.stand_ins[key] = type(name, (StandIn,), {"pickled_as": key})
        return self.stand_ins[key]


def check_metadata(file: BinaryIO, where: str) -> None:
    """A ConfigError unless `file` is a DCP metadata pickle that names only ALLOWED and points
    only to shard files beside it; nothing the file names is imported or run."""
    unpickler = InertUnpickler(file, where)
    try:
        top = unpickler.load()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails in any of a dozen ways
        raise ConfigError(damaged(where, e)) from None
    if not (isinstance(top, StandIn) and top.pickled_as == (METADATA, "Metadata") and isinstance(top.state, dict)):
        raise ConfigError(damaged(where, "it holds no checkpoint Metadata"))
    storage = top.state.get("storage_data")
    if not isinstance(storage, dict):
        raise ConfigError(damaged(where, "it says in no file where its entries are"))
    for info in storage.values():
        state = info.state if isinstance(info, StandIn) else None
        if (problem := shard_problem(where, state.get("relative_path") if isinstance(state, dict) else None)):
            raise ConfigError(problem)
