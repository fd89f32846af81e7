"""Minimal safetensors reader/writer on numpy memmaps (no torch, no pickle, bf16 included).

The format is an 8-byte little-endian header length, a JSON header mapping tensor names
to dtype/shape/byte offsets, then raw little-endian data. Reading through a memmap means
a sharded load touches only the bytes each device needs.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """Lazy view of one `.safetensors` file: `names()`, `shape(name)`, `get(name)`."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{self.path}: not a safetensors file (too short)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > _MAX_HEADER:
                raise ValueError(f"{self.path}: header of {header_len} bytes is not plausible")
            try:
                header = json.loads(f.read(header_len))
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.path}: corrupt safetensors header ({e})") from e
        header.pop("__metadata__", None)
        self._header = header
        self._offset = 8 + header_len
        self._size = os.path.getsize(self.path)
        self._mm = None

    def names(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self._header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        if self._offset + end > self._size:
            raise ValueError(f"{self.path}: tensor {name} runs past the end of the file "
                             "(truncated download?)")
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mm[self._offset + start:self._offset + end]
        return raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike) -> None:
    """Write tensors as safetensors (used by tests and exporters)."""
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        data = arr.tobytes()
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * ((-len(encoded)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)
