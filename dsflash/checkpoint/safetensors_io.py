"""A small reader/writer of the safetensors file format with the dtypes the official checkpoint uses.

Why our own: ``safetensors.numpy`` (0.8) writes ``F8_E4M3`` / ``F8_E8M0`` but cannot load them (its
numpy type table has no float8 entries), and it reads whole files. The format is simple:

    [8 bytes: little-endian u64 N] [N bytes: JSON header] [raw little-endian tensor bytes]

The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the first byte after the header) plus an optional ``"__metadata__"`` dict of strings.

Reading memory-maps the file: a tensor is a read-only ``np.memmap`` view, so a 7 GB shard is never
read whole, and only the pages actually copied are touched.

Internal dtypes (the stored formats of ``dsflash.model.params``):
``F8_E4M3`` -> ``float8_e4m3fn``; ``F8_E8M0`` -> ``uint8`` (same bytes: the UE8M0 exponent);
``I8`` -> ``int8``; ``U8`` -> ``uint8``; ``BF16`` -> ``bfloat16``; ``F16``/``F32``/``I32``/``I64``/... as numpy.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

# safetensors dtype string -> numpy dtype we hold it as
ST_TO_NP: dict[str, np.dtype] = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32),
    "U64": np.dtype(np.uint64),
    "BOOL": np.dtype(np.bool_),
}
ITEMSIZE = {k: v.itemsize for k, v in ST_TO_NP.items()}

# numpy dtype -> default safetensors dtype string when writing (uint8 is written as U8 unless the
# caller says F8_E8M0; the checkpoint writer always says which)
_NP_TO_ST = {
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.int16): "I16",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint16): "U16",
    np.dtype(np.uint32): "U32",
    np.dtype(np.uint64): "U64",
    np.dtype(np.bool_): "BOOL",
}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit


class SafetensorsError(ValueError):
    """A malformed, truncated or inconsistent safetensors file (message names the file and tensor)."""


def st_dtype_of(dtype) -> str:
    dt = np.dtype(dtype)
    if dt not in _NP_TO_ST:
        raise ValueError(f"dtype {dt} has no safetensors equivalent")
    return _NP_TO_ST[dt]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str            # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple
    begin: int            # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """One ``.safetensors`` file: header parsed and validated eagerly, data memory-mapped lazily.

    ``SafetensorsFile(path)`` raises ``SafetensorsError`` naming the file (and tensor) for a short or
    garbled header, offsets outside the file (truncated shard), a size that does not match
    dtype x shape, overlapping tensors or an unknown dtype."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.metadata: dict[str, str] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._mm: np.memmap | None = None
        self._parse_header()

    # ------------------------------------------------------------------ header
    def _fail(self, msg: str):
        raise SafetensorsError(f"{self.path}: {msg}")

    def _parse_header(self) -> None:
        try:
            size = os.path.getsize(self.path)
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot stat file ({e.strerror})") from e
        self.file_size = size
        if size < 8:
            self._fail(f"file is {size} bytes, too short for a safetensors header (truncated or not safetensors)")
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                self._fail(f"header length {n} is implausible (not a safetensors file?)")
            if 8 + n > size:
                self._fail(f"header length {n} runs past the end of the {size}-byte file (truncated shard)")
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self._fail(f"header is not valid JSON ({e})")
        if not isinstance(header, dict):
            self._fail("header is not a JSON object")
        self.data_start = 8 + n
        data_len = size - self.data_start
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            self._fail("__metadata__ is not an object")
        self.metadata = {str(k): str(v) for k, v in meta.items()}
        spans = []
        for name, d in header.items():
            try:
                dtype, shape, (b, e) = d["dtype"], tuple(int(s) for s in d["shape"]), d["data_offsets"]
                b, e = int(b), int(e)
            except (KeyError, TypeError, ValueError):
                self._fail(f"tensor {name!r}: malformed header entry {d!r}")
            if dtype not in ITEMSIZE:
                self._fail(f"tensor {name!r}: unsupported dtype {dtype!r}")
            if any(s < 0 for s in shape):
                self._fail(f"tensor {name!r}: negative dimension in shape {list(shape)}")
            if not 0 <= b <= e:
                self._fail(f"tensor {name!r}: bad data_offsets [{b}, {e}]")
            want = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype]
            if e - b != want:
                self._fail(f"tensor {name!r}: {e - b} bytes for {dtype} {list(shape)} (expected {want})")
            if e > data_len:
                self._fail(f"tensor {name!r}: data ends at byte {self.data_start + e} but the file has only "
                           f"{size} bytes (truncated shard)")
            spans.append((b, e, name))
            self.tensors[name] = TensorInfo(name, dtype, shape, self.data_start + b, self.data_start + e)
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                self._fail(f"tensors {n0!r} and {n1!r} overlap")

    # ------------------------------------------------------------------ data
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self):
        return self.tensors.keys()

    def _memmap(self) -> np.memmap:
        if self._mm is None:
            if self.file_size == self.data_start:  # no payload: mmap of nothing is not allowed
                self._mm = np.zeros(0, np.uint8)
            else:
                self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm

    def get(self, name: str, dtype=None) -> np.ndarray:
        """Read-only memmap view of a tensor (no copy). ``dtype`` reinterprets the bytes (same itemsize)."""
        try:
            t = self.tensors[name]
        except KeyError:
            raise SafetensorsError(f"{self.path}: no tensor {name!r}") from None
        dt = ST_TO_NP[t.dtype] if dtype is None else np.dtype(dtype)
        if dt.itemsize != ITEMSIZE[t.dtype]:
            raise ValueError(f"{self.path}: cannot view {t.dtype} tensor {name!r} as {dt}")
        raw = self._memmap()[t.begin:t.end]
        return raw.view(dt).reshape(t.shape)

    def close(self) -> None:
        """Drop our reference to the mapping (views already handed out keep it alive)."""
        self._mm = None


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray] | Iterable[tuple],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write tensors to ``path``; returns the payload size in bytes.

    ``tensors``: a mapping name -> array, or an iterable of ``(name, array)`` / ``(name, array, st_dtype)``
    where ``st_dtype`` overrides the stored dtype string (e.g. ``"F8_E8M0"`` for uint8 scale bytes).
    Tensors are written back to back in the given order (the reference implementation rejects gaps;
    only the header is padded to 8 bytes); arrays are written one at a time (never concatenated)."""
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    entries = []
    off = 0
    for item in items:
        name, arr = item[0], np.asarray(item[1])
        st = item[2] if len(item) > 2 and item[2] else st_dtype_of(arr.dtype)
        if st not in ITEMSIZE:
            raise ValueError(f"tensor {name!r}: unknown safetensors dtype {st!r}")
        if ITEMSIZE[st] != arr.dtype.itemsize:
            raise ValueError(f"tensor {name!r}: {arr.dtype} cannot be stored as {st}")
        if name in header:
            raise ValueError(f"duplicate tensor name {name!r}")
        header[name] = {"dtype": st, "shape": list(arr.shape), "data_offsets": [off, off + arr.nbytes]}
        entries.append((off, arr))
        off += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * ((-len(raw)) % 8)
    payload = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, arr in entries:
            a = np.ascontiguousarray(arr)
            if a.dtype.byteorder == ">":
                a = a.byteswap().view(a.dtype.newbyteorder("<"))
            f.write(memoryview(a.reshape(-1).view(np.uint8)))
            payload += a.nbytes
    return payload
