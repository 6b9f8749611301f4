"""Load DCP checkpoints without running code from them: checkpoints load weights only.

``torch.distributed.checkpoint.load`` unpickles twice on its own: the ``.metadata`` file with
``pickle.load`` and every non-tensor value (an optimizer's ``lr``, ``betas``) with
``torch.load`` and ``weights_only=False``. A checkpoint folder someone else wrote (or one that was
tampered with) could then run code in every rank. ``dcp_load`` is the same call with

    metadata            read by ``MetadataUnpickler``: only DCP's own metadata classes, torch
                        dtypes, sizes and layouts, and paths; any other global is refused
    non-tensor values   ``torch.load(weights_only=True)`` (``WeightsOnlyLoadPlanner``)
    tensors             already ``weights_only=True`` in DCP's reader

A refused checkpoint is an ``AutoshardError`` naming the folder and the fix.
"""

from __future__ import annotations

import enum
import importlib
import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from autoshard.errors import AutoshardError

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that builds only the globals a DCP ``.metadata`` file holds (module doc)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or _is_torch_dtype(module, name) or _is_dcp_record(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of a DCP checkpoint's metadata")


def _is_torch_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def _is_dcp_record(module: str, name: str) -> bool:
    """A dataclass or enum defined in DCP's metadata / filesystem modules (no functions, no imports)."""
    if module not in _DCP_MODULES:
        return False
    obj = getattr(importlib.import_module(module), name, None)
    return (
        isinstance(obj, type)
        and obj.__module__ == module
        and (hasattr(obj, "__dataclass_fields__") or issubclass(obj, enum.Enum))
    )


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata read by ``MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            try:
                metadata = MetadataUnpickler(metadata_file).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
                raise AutoshardError(
                    f"{path}: not a checkpoint autoshard wrote ({exc}); its metadata would run "
                    f"code or is damaged, so it is not loaded; fix: delete that checkpoint "
                    f"folder or use another --checkpoint-dir"
                ) from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values load with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)", str(exc))
            what = f"it names {found.group(1)}" if found else "it is not plain data"
            raise AutoshardError(
                f"checkpoint value {read_item.dest_index.fqn} is refused ({what}, which loading "
                f"would run); fix: delete that checkpoint folder or use another "
                f"--checkpoint-dir"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def dcp_load(state: dict[str, Any], path: Path, allow_partial_load: bool = False, reader=None) -> None:
    """``dcp.load(state, checkpoint_id=path)`` that runs no code from the checkpoint.

    The metadata is checked here first, because DCP turns a failure inside its reader into an
    exception whose message is a multi-line traceback; ours is one line. ``allow_partial_load``: names of
    ``state`` the checkpoint lacks are left as they are (the caller checked which). ``reader``: another
    storage reader that unpickles nothing (DCP's ``HuggingFaceStorageReader``: safetensors headers are JSON).
    """
    reader = reader if reader is not None else SafeFileSystemReader(path)
    reader.read_metadata()
    try:
        dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(allow_partial_load=allow_partial_load))
    except CheckpointException as exc:
        mine = [e for e, _ in exc.failures.values() if isinstance(e, AutoshardError)]
        if mine:
            raise AutoshardError(str(mine[0])) from exc
        raise
