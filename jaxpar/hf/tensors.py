"""safetensors files, read by slices and written one tensor at a time (no torch, no mmap).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON ({name:
{"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}) and the tensors'
bytes. Everything in a file is untrusted: `read_header` bounds N, requires the dtypes jaxpar
reads (F32, BF16, F16), checks every entry's byte count against its shape and the file's size
against the offsets (a truncated or padded file is refused), before any tensor is read.

`Reader.read(name, ranges)` reads one block of one tensor with `os.pread`: the rows of its first
axis that `ranges` selects (contiguous on disk), then slices the other axes, and returns it as
float32 (bfloat16 widened bit for bit, float16 converted). Nothing is memory-mapped, so a
process's memory holds only what it asked for.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

DTYPES = {"F32": np.dtype("<f4"), "BF16": np.dtype("<u2"), "F16": np.dtype("<f2")}
NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
MAX_HEADER = 100 << 20  # bytes of JSON header, whatever the model
MAX_DIMS = 8


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: where its bytes are (absolute offsets) and what they hold."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset of its first byte in the file
    nbytes: int


def _fail(path: str, what: str, fix: str = "download it again") -> ValueError:
    return ValueError(f"{path}: {what}; {fix}")


def read_header(path: str, max_header: int = MAX_HEADER) -> dict[str, Entry]:
    """The checked entries of a safetensors file (ValueError naming the file and the fix)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _fail(path, f"cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _fail(path, "not a regular file")
        size = st.st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise _fail(path, f"{size} bytes, too short for a safetensors header (truncated)")
        n = int.from_bytes(head, "little")
        if n > min(max_header, MAX_HEADER):
            raise _fail(path, f"header of {n:,} bytes, more than the {max_header:,} allowed")
        if 8 + n > size:
            raise _fail(path, f"{size:,} bytes, shorter than its {n:,}-byte header (truncated)")
        blob = _pread_all(fd, n, 8, path)
    finally:
        os.close(fd)
    try:
        obj = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise _fail(path, f"header is not JSON ({str(e)[:80]})") from None
    if not isinstance(obj, dict):
        raise _fail(path, "header is not a JSON object")
    obj.pop("__metadata__", None)
    base = 8 + n
    out, end = {}, 0
    for name, e in obj.items():
        out[name] = _entry(path, name, e, base)
        end = max(end, out[name].start + out[name].nbytes)
    end = max(end, base)
    if end > size:
        raise _fail(path, f"{size:,} bytes but its header places tensors up to byte {end:,} "
                          f"(truncated)")  # fmt: skip
    if end < size:
        raise _fail(path, f"{size - end:,} bytes past its last tensor; not a safetensors file")
    return out


def _entry(path: str, name: str, e: Any, base: int) -> Entry:
    where = f"tensor {name[:200]!r}"
    if not isinstance(e, dict):
        raise _fail(path, f"{where}: its header entry is not an object")
    dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if dtype not in DTYPES:
        raise _fail(path, f"{where} is {str(dtype)[:20]}, not one of {', '.join(DTYPES)}",
                    "convert the checkpoint to float32 or bfloat16")  # fmt: skip
    ok_shape = (
        isinstance(shape, list) and len(shape) <= MAX_DIMS
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape)
    )  # fmt: skip
    ok_offsets = (
        isinstance(offsets, list) and len(offsets) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in offsets)
        and offsets[0] <= offsets[1]
    )  # fmt: skip
    if not ok_shape or not ok_offsets:
        raise _fail(path, f"{where}: malformed shape or data_offsets in its header")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise _fail(path, f"{where}: {offsets[1] - offsets[0]:,} bytes for a {dtype}{shape}")
    return Entry(path, dtype, tuple(shape), base + offsets[0], nbytes)


def _pread_all(fd: int, n: int, offset: int, path: str) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got:]], offset + got)
        if k <= 0:
            raise _fail(path, f"ended at byte {offset + got:,} while reading (truncated)")
        got += k
    return buf


def widen(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 of the raw values `a` of a `dtype` tensor (bfloat16: exact, by the bits)."""
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return a.astype(np.float32)
    return a


class Reader:
    """Blocks of the tensors of some safetensors files; file descriptors are kept open until
    `close()` (a context manager)."""

    def __init__(self, entries: dict[str, Entry]):
        self.entries = entries
        self._fds: dict[str, int] = {}
        self.bytes_read = 0

    def _fd(self, path: str) -> int:
        if path not in self._fds:
            try:
                self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as e:
                raise _fail(path, f"cannot be opened ({e.strerror})") from None
        return self._fds[path]

    def read_raw(self, name: str, ranges: list[range]) -> np.ndarray:
        """The block of tensor `name` over `ranges` (one per axis) in its stored dtype."""
        e = self.entries[name]
        dt = DTYPES[e.dtype]
        if not e.shape:
            return np.frombuffer(_pread_all(self._fd(e.file), dt.itemsize, e.start, e.file), dt)
        rows = ranges[0]
        row_elems = math.prod(e.shape[1:])
        n = len(rows) * row_elems * dt.itemsize
        buf = _pread_all(self._fd(e.file), n, e.start + rows.start * row_elems * dt.itemsize,
                         e.file)  # fmt: skip
        self.bytes_read += n
        a = np.frombuffer(buf, dt).reshape(len(rows), *e.shape[1:])
        return a[(slice(None), *(slice(r.start, r.stop) for r in ranges[1:]))]

    def read(self, name: str, ranges: list[range]) -> np.ndarray:
        """`read_raw` as float32."""
        return widen(self.read_raw(name, ranges), self.entries[name].dtype)

    def widen(self, name: str, raw: np.ndarray) -> np.ndarray:
        """Values `read_raw` returned for tensor `name`, as float32."""
        return widen(raw, self.entries[name].dtype)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def header_for(tensors: list[tuple[str, tuple[int, ...]]], metadata: dict | None = None) -> bytes:
    """The 8-byte length and JSON header of a float32 file of `tensors` (name, shape), stored
    in that order; padded with spaces to a multiple of 8 bytes as safetensors writes it."""
    obj: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * 4
        obj[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(obj, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob


def write(path: str, layout: list[tuple[str, tuple[int, ...]]], arrays: Iterable[np.ndarray],
          metadata: dict | None = None, mode: int = 0o666) -> int:  # fmt: skip
    """Write a new float32 file `path` (O_EXCL) of the tensors `layout` names (name, shape), their
    values coming one at a time from `arrays` (so one is held at a time); returns its size."""
    header = header_for(layout, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    with open(fd, "wb") as f:
        f.write(header)
        for (name, shape), a in zip(layout, arrays, strict=True):
            if tuple(a.shape) != tuple(shape):
                raise ValueError(
                    f"{name}: {list(a.shape)} written where {list(shape)} was declared"
                )
            f.write(np.ascontiguousarray(a, dtype="<f4").tobytes())
        return f.tell()
