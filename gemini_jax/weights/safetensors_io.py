"""Safetensors files on disk: read one tensor at a time, write atomically.

A checkpoint directory holds either one `model.safetensors` or shards listed by
`model.safetensors.index.json`. safetensors memory-maps each file, so only the tensor being read
is materialised; callers cast and place it before asking for the next one, which keeps the peak
near the model's own size. Every failure is a `CheckpointError` that names the file and tensor.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Optional

import ml_dtypes
import numpy as np

from gemini_jax.errors import CheckpointError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names; numpy reads BF16 via ml_dtypes

NUMPY_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                "bfloat16": np.dtype(ml_dtypes.bfloat16)}


class TensorReader:
    """The tensors of one checkpoint directory, opened lazily. Use as a context manager.

    `names()` lists every tensor; `read(name, shape, dtype)` checks the stored shape and float
    dtype, then returns that one tensor as a numpy array cast to `dtype`.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, object] = {}
        try:
            self._where: dict[str, Path] = self._locate()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def names(self) -> list[str]:
        return sorted(self._where)

    def file_of(self, name: str) -> Path:
        return self._where[name]

    def read(self, name: str, shape: Optional[tuple[int, ...]], dtype: np.dtype) -> np.ndarray:
        """Tensor `name` as `dtype`; `shape` (when given) is what the caller expects on disk."""
        path = self._where.get(name)
        if path is None:
            raise CheckpointError(f"{self.directory}: no tensor named {name!r}.")
        handle = self._open(path)
        try:
            view = handle.get_slice(name)
            stored_dtype, stored_shape = view.get_dtype(), tuple(view.get_shape())
        except Exception as e:  # a shard whose index entry lies
            raise CheckpointError(f"{path}: cannot find tensor {name!r} ({e}); the index "
                                  f"{INDEX_NAME} and the shard disagree.") from None
        if shape is not None and stored_shape != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {list(stored_shape)}, expected "
                                  f"{list(shape)} from config.json.")
        if stored_dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {stored_dtype}; weights must be "
                                  f"one of {FLOAT_DTYPES}.")
        try:
            array = handle.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{path}: reading tensor {name!r} failed ({e}); the file may be "
                                  f"corrupt, download it again.") from None
        return array.astype(dtype, copy=False)

    def _locate(self) -> dict[str, Path]:
        """tensor name -> file, from the index when sharded, else from the single file's header."""
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory} is not a directory.")
        # A single file wins over an index when both are present, as in transformers.
        single = self.directory / WEIGHTS_NAME
        if single.exists():
            return {name: single for name in self._open(single).keys()}
        index = self.directory / INDEX_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e!r}); it needs a "
                                      f"'weight_map' of tensor name -> shard file.") from None
            where = {name: self.directory / file for name, file in weight_map.items()}
            missing = sorted({str(p.name) for p in where.values() if not p.exists()})
            if missing:
                raise CheckpointError(f"{index} lists shard file(s) {missing} that are not in "
                                      f"{self.directory}; the download is incomplete.")
            for path in sorted(set(where.values())):
                self._open(path)  # validate every shard's header up front
            return where
        present = sorted(p.name for p in self.directory.iterdir())
        raise CheckpointError(f"{self.directory} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}; "
                              f"found {present}.")

    def _open(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            # NOTE: safetensors is imported where a file is read or written, so that the package
            # and an Engine over in-memory weights run without it (a bare jax + flax machine).
            from safetensors import safe_open

            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="numpy"))
            except Exception as e:  # SafetensorError on a truncated/garbled header, OSError ...
                raise CheckpointError(f"{path}: not a readable safetensors file ({e}); it may be "
                                      f"truncated or corrupt, write or download it again.") from None
            self._handles[path] = handle
        return handle


def write_safetensors(arrays: dict[str, np.ndarray], path: str | os.PathLike,
                      metadata: Optional[dict[str, str]] = None) -> Path:
    """Write `arrays` to one safetensors file. Atomic: a crash leaves the old file or none."""
    from safetensors.numpy import save_file  # see TensorReader._open

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path
