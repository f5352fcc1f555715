"""Streaming safetensors I/O: read row ranges of a tensor, write a file tensor by tensor.

A safetensors file is an 8-byte header length, a JSON header (dtype, shape and byte range of every
tensor) and the raw data. Knowing every output shape up front, the writer puts the header first and
then appends each tensor's bytes as they are produced; the reader fetches any row range with
positioned reads. Neither maps whole files, so memory stays at the size of the chunks in flight.
Both open the file for each call and close it before returning, so no handle outlives a failure,
and both loop on short transfers, which network file systems return.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..common.torch_dtypes import SAFETENSORS_DTYPE_TAGS
from ..errors import CheckpointError


def _read_exactly(path: Path, buffer: bytearray, offset: int) -> None:
    """Fills `buffer` from `path` at `offset`; CheckpointError if the file ends first."""
    view = memoryview(buffer)
    done = 0
    with path.open("rb", buffering=0) as f:
        while done < len(buffer):
            got = os.preadv(f.fileno(), [view[done:]], offset + done)
            if got == 0:
                raise CheckpointError(
                    f"{path.name} ended early: {len(buffer) - done} of {len(buffer)} bytes at offset {offset} "
                    "are missing; re-download or re-copy this file"
                )
            done += got


def _write_exactly(path: Path, data: memoryview, offset: int) -> None:
    with path.open("r+b", buffering=0) as f:
        done = 0
        while done < len(data):
            done += os.pwrite(f.fileno(), data[done:], offset + done)


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's bytes are: file, absolute byte offset, dtype and shape."""

    path: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return (self.shape[0] if self.shape else 1) * self.row_bytes

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along dim 0 (the whole tensor for 0-d), read with positioned reads."""
        if not self.shape:
            start, stop = 0, 1
        count = (stop - start) * self.row_bytes
        buffer = bytearray(count)
        _read_exactly(self.path, buffer, self.offset + start * self.row_bytes)
        tensor = torch.frombuffer(buffer, dtype=self.dtype) if count else torch.empty(0, dtype=self.dtype)
        return tensor.reshape((stop - start, *self.shape[1:]) if self.shape else ())


class RowReader(Protocol):
    """A tensor read in row ranges along dim 0: one stored (TensorLocation), dequantized
    (quantization.BlockFP8Location) or stacked from several (StackedLocation)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def row_bytes(self) -> int: ...

    def read_rows(self, start: int, stop: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class StackedLocation:
    """Tensors of one shape read as one [len(parts), *shape] tensor: per-expert weights as an expert stack."""

    parts: tuple[RowReader, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    @property
    def row_bytes(self) -> int:
        return self.parts[0].row_bytes * self.parts[0].shape[0]

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        return torch.stack([part.read_rows(0, part.shape[0]) for part in self.parts[start:stop]])


@dataclass(frozen=True)
class TensorPlan:
    """An output tensor the writer reserves room for before its data exists."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class StreamingWriter:
    """Writes one safetensors file whose tensors arrive in order, each in one or more chunks."""

    def __init__(self, path: Path, tensors: Sequence[TensorPlan], metadata: dict[str, str] | None = None):
        header: dict[str, object] = {"__metadata__": dict(metadata or {})}
        offset = 0
        for t in tensors:
            header[t.name] = {
                "dtype": SAFETENSORS_DTYPE_TAGS[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self.path = path
        self._plans = list(tensors)
        self._next = 0  # index of the tensor being written
        self._written = 0  # its bytes written so far
        path.write_bytes(struct.pack("<Q", len(raw)) + raw)
        self._end = 8 + len(raw)  # file offset of the next byte
        self._advance()

    def _advance(self) -> None:
        while self._next < len(self._plans) and self._written == self._plans[self._next].nbytes:
            self._next, self._written = self._next + 1, 0

    def write(self, name: str, chunk: torch.Tensor) -> None:
        """Appends the next bytes of tensor `name` (which must be the tensor being written)."""
        plan = self._plans[self._next] if self._next < len(self._plans) else None
        if plan is None or plan.name != name or chunk.dtype != plan.dtype:
            expected = f"{plan.name} ({plan.dtype})" if plan else "nothing more"
            raise RuntimeError(f"{self.path.name}: got {name} ({chunk.dtype}) while expecting {expected}")
        data = chunk.contiguous().reshape(-1).view(torch.uint8).numpy()
        if self._written + data.size > plan.nbytes:
            raise RuntimeError(f"{self.path.name}: {name} got more bytes than its shape {list(plan.shape)} holds")
        _write_exactly(self.path, data.data, self._end)
        self._end += data.size
        self._written += data.size
        self._advance()

    def close(self) -> None:
        """Ends the file (it holds no open handle between writes); every planned byte must have been written."""
        if self._next < len(self._plans):
            raise RuntimeError(
                f"{self.path.name}: {len(self._plans) - self._next} tensor(s) not fully written, "
                f"first {self._plans[self._next].name}"
            )
