"""Reading a checkpoint as data, never as code: it may have been copied from another machine or another user.

A pickle names the functions that rebuild its objects, and plain `pickle.load` calls them: a `shared.pt` or a DCP
`.metadata` crafted with a `__reduce__` runs whatever it names when a run resumes. So:

- the state files (`rank<r>.pt`, `shared.pt`) load with `torch.load(weights_only=True)`, which rebuilds only
  tensors, containers and numbers, plus the project's own record types that the experience buffer saves
  (`STATE_TYPES`, plain frozen dataclasses);
- DCP's `.metadata` loads through `RestrictedUnpickler`, which rebuilds DCP's own metadata classes and the few
  torch values they hold (dtypes, sizes, layouts), and the data files it points at must lie in its own folder.

Anything else is refused with `UnsafeCheckpointError`, naming the file and what it asked for; nothing in it runs.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo

from hybrid_rl.checkpoint.collective import CheckpointError
from hybrid_rl.data.records import PreferenceRecord, PromptRecord, ReadOnlyFields
from hybrid_rl.errors import EXIT_BAD_INPUT
from hybrid_rl.types import Sample

# What the trainer's state holds besides tensors and plain values: the buffered source's finished samples and the
# records of its live groups. Frozen dataclasses: rebuilding one sets its fields and calls nothing of the file's.
STATE_TYPES = (Sample, PromptRecord, PreferenceRecord, ReadOnlyFields)
DCP_METADATA = ".metadata"  # the metadata file of a DCP folder written without a process group

_REFUSED = ("refused: it asks to run {what}, which no checkpoint that hybrid_rl writes holds (a pickle can run code "
            "when it is loaded, so a file from elsewhere is read as data only); if you wrote this file yourself "
            "with another tool, load it yourself where you trust it")


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks for more than data; it was not loaded and nothing in it ran. Exit 2; each rank checks
    its own files, so the rank that found one says so."""

    exit_code = EXIT_BAD_INPUT
    agreed = False


def read_state(path: Path) -> Any:
    """A `torch.save`d state file as data (tensors, containers, numbers, strings and `STATE_TYPES`)."""
    try:
        with torch.serialization.safe_globals(list(STATE_TYPES)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if (asked := _asked(str(e))) is None:  # not a refused name: garbled bytes (none of it ran either way)
            raise CheckpointError(f"{path}: unreadable state file ({_first_line(str(e))})") from None
        raise UnsafeCheckpointError(f"{path}: " + _REFUSED.format(what=asked)) from None


def _asked(message: str) -> str | None:
    """The name a refusal quotes ('Unsupported global: GLOBAL posix.system' -> 'posix.system'), or None."""
    for line in message.splitlines():
        if "GLOBAL " in line:
            return line.split("GLOBAL ", 1)[1].split()[0]
    return None


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unpickling failed"


def _dcp_classes() -> dict[tuple[str, str], Any]:
    allowed = {(dcp_metadata.__name__, name): obj for name, obj in vars(dcp_metadata).items()
               if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__}
    allowed[(_StorageInfo.__module__, _StorageInfo.__name__)] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # by name, among torch's
    allowed.update({("torch", name): obj for name, obj in vars(torch).items()
                    if isinstance(obj, torch.dtype | torch.memory_format)})
    for cls in (PurePosixPath, type(Path())):  # where DCP keeps its checkpoint id
        allowed[(cls.__module__, cls.__name__)] = cls
    allowed[("collections", "OrderedDict")] = OrderedDict
    return allowed


class _Refused(pickle.UnpicklingError):
    pass


class RestrictedUnpickler(pickle.Unpickler):
    """Rebuilds only DCP's metadata classes and the torch values they hold; any other global is refused."""

    allowed = _dcp_classes()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        raise _Refused(f"{module}.{name}")


def read_dcp_metadata(path: Path) -> dcp_metadata.Metadata:
    """A DCP `.metadata` file as data; its data files must lie in its own folder."""
    try:
        metadata = RestrictedUnpickler(io.BytesIO(path.read_bytes())).load()
    except _Refused as e:
        raise UnsafeCheckpointError(f"{path}: " + _REFUSED.format(what=e)) from None
    except Exception as e:  # garbled, not hostile: nothing it named was called
        raise CheckpointError(f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{path}: refused: it holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not _plain_name(rel):
            raise UnsafeCheckpointError(f"{path}: refused: it points at a data file outside its folder ({rel!r})")
    return metadata


def _plain_name(rel: object) -> bool:
    return isinstance(rel, str) and rel not in ("", ".", "..") and "/" not in rel and "\\" not in rel


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `read_metadata` through `read_dcp_metadata` (DCP itself uses plain `pickle.load`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

