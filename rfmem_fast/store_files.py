"""Reading a store's files, each checked against the manifest's size and sha256: small
(JSON) files, ``.npy`` headers, the rows (``vectors.npy`` and the scan copy: streamed in
chunks through the checks, or memory-mapped copy-on-write, the float32 rows of a
half-precision or int8 bank mapped for random access), the CSR offsets and 1-D arrays
(read, or mapped read-only). :func:`rfmem_fast.store.read_store` reads a store with them.
"""
from __future__ import annotations

import hashlib
import io
import json
import mmap as mmap_module
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .precision import HALF_DTYPES, SCAN_DTYPES, int8_copy_mismatch, storage_dtype, to_scan_copy
from .store_format import SCAN_FILE, SCAN_META_FILE, StoreError

_CHUNK = 1 << 22  # bytes per read while hashing / verifying
_NORM_TOL = 1e-3  # |norm - 1| allowed for a stored row (rows are float32 unit vectors)


def _read_bytes(path: Path, missing: str) -> bytes:
    """The bytes of ``path``; StoreError (``missing`` or the OS error) naming it otherwise."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise StoreError(path, missing) from None
    except OSError as exc:
        raise StoreError(path, f"cannot be read: {exc}") from None


def _read_small(path: Path, expect: dict | None, verify: bool) -> bytes:
    """Read a whole (JSON) file, checking its size and checksum against ``expect``."""
    data = _read_bytes(path, "missing file")
    if expect is not None:
        if len(data) != expect["bytes"]:
            raise StoreError(path, f"has {len(data)} bytes, the manifest says {expect['bytes']} (truncated or edited)")
        if verify and hashlib.sha256(data).hexdigest() != expect["sha256"]:
            raise StoreError(path, "sha256 checksum mismatch (corrupt or edited)")
    return data


def _parse_json(path: Path, data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StoreError(path, f"is not valid UTF-8 JSON: {exc}") from None


def _check_size(path: Path, expect: dict) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise StoreError(path, "missing file") from None
    if size != expect["bytes"]:
        raise StoreError(path, f"has {size} bytes, the manifest says {expect['bytes']} (truncated or edited)")


def _npy_header(path: Path, dtype: np.dtype, shape: tuple) -> int:
    """Check a .npy header (dtype, C order, shape, size) and return the data offset."""
    try:
        with open(path, "rb") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. numpy's "created on Python 2" for a mangled header
            major, _minor = np.lib.format.read_magic(f)
            if major == 1:
                shp, fortran, dt = np.lib.format.read_array_header_1_0(f)
            elif major in (2, 3):
                shp, fortran, dt = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy version {major}")
            offset = f.tell()
    except FileNotFoundError:
        raise StoreError(path, "missing file") from None
    except Exception as exc:  # untrusted header text: any parse failure is corruption
        raise StoreError(path, f"bad .npy header: {type(exc).__name__}: {exc}") from None
    if dt != dtype or fortran or tuple(shp) != tuple(shape):
        raise StoreError(
            path,
            f"holds {dt} {tuple(shp)}{' (Fortran order)' if fortran else ''}, expected {dtype} {tuple(shape)} C order",
        )
    size = path.stat().st_size
    need = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size != need:
        raise StoreError(path, f"has {size} bytes, its header needs {need} (truncated or padded)")
    return offset


def _read_rows(
    data_dir: Path, files: dict, n: int, d: int, dtype: str, mmap: bool, verify: bool
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """vectors.npy as float32 [n, d] (and scan.npy for a half-precision or int8 bank, and
    scan_meta.npy for int8): read (or map) them, hashing and checking rows in chunks.

    With ``verify`` every byte is hashed, every row checked (finite, unit norm) and every
    row of the scan copy checked to be the rounding (int8: the quantisation,
    :func:`rfmem_fast.precision.int8_copy_mismatch`) of its float32 row, in one streaming
    pass over the files; under ``mmap`` that pass reads the files with ordinary reads
    into small buffers, so the mappings themselves stay untouched (not resident).

    Returns:
        (vectors, scan or None, scan_meta or None).
    """
    half = dtype in HALF_DTYPES
    i8 = dtype == "int8"
    specs = [("vectors.npy", np.dtype("<f4"), d)]
    if dtype in SCAN_DTYPES:
        specs.append((SCAN_FILE, storage_dtype(dtype), d))
    if i8:
        specs.append((SCAN_META_FILE, np.dtype("<f4"), 3))
    paths = [data_dir / name for name, _, _ in specs]
    offsets = [_npy_header(path, dt, (n, w)) for path, (_, dt, w) in zip(paths, specs)]
    outs = [None if mmap else np.empty((n, w), dtype=dt) for _, dt, w in specs]
    if verify or not mmap:
        rows_per = max(1, _CHUNK // max(1, d * 4))
        bufs = [np.empty((rows_per, w), dtype=dt) if mmap else None for _, dt, w in specs]
        shas = [hashlib.sha256() for _ in specs]
        bad: list[str | None] = [None] * len(specs)
        handles = []
        try:
            for path, off, sha in zip(paths, offsets, shas):
                f = open(path, "rb")
                handles.append(f)
                sha.update(f.read(off))
            for a in range(0, n, rows_per):
                b = min(n, a + rows_per)
                blocks = []
                for i, f in enumerate(handles):
                    block = bufs[i][: b - a] if mmap else outs[i][a:b]
                    mv = memoryview(block).cast("B")
                    if f.readinto(mv) != mv.nbytes:
                        raise StoreError(paths[i], "ends early (truncated)")
                    if verify:
                        shas[i].update(mv)
                    blocks.append(block)
                if verify and bad[0] is None:
                    with np.errstate(all="ignore"):
                        norms = np.linalg.norm(blocks[0].astype(np.float64), axis=1)
                    off = ~(np.abs(norms - 1.0) <= _NORM_TOL)  # NaN / Inf included
                    if off.any():
                        bad[0] = f"row {a + int(np.flatnonzero(off)[0])} is not a finite unit vector"
                if verify and half and bad[0] is None and bad[1] is None:
                    same = (to_scan_copy(blocks[0], dtype).view(np.uint16) == blocks[1].view(np.uint16)).all(axis=1)
                    if not same.all():
                        bad[1] = f"row {a + int(np.flatnonzero(~same)[0])} is not the {dtype} rounding of its float32 row"
                if verify and i8 and bad[0] is None and bad[1] is None:
                    first = int8_copy_mismatch(blocks[0], blocks[1], blocks[2])
                    if first >= 0:
                        bad[1] = f"row {a + first} is not the int8 quantisation of its float32 row (with scan_meta.npy)"
            if verify:
                for f, sha in zip(handles, shas):
                    sha.update(f.read())
        except OSError as exc:
            raise StoreError(paths[len(handles) - 1 if handles else 0], f"cannot be read: {exc}") from None
        finally:
            for f in handles:
                f.close()
        if verify:
            for path, (name, _, _), sha in zip(paths, specs, shas):
                if sha.hexdigest() != files[name]["sha256"]:
                    raise StoreError(path, "sha256 checksum mismatch (corrupt or edited)")
        for path, msg in zip(paths, bad):
            if msg is not None:  # checksums fine: the store was written with bad rows
                raise StoreError(path, msg)
    if mmap:
        for i, (path, (_, dt, w)) in enumerate(zip(paths, specs)):
            if n == 0:
                outs[i] = np.zeros((0, w), dtype=dt)
                continue
            try:
                # copy-on-write map: writable in memory (torch wraps it without a copy or a
                # warning), never written back to the file, pages read only when touched
                mm = np.load(path, mmap_mode="c", allow_pickle=False)
            except (ValueError, OSError, EOFError) as exc:
                raise StoreError(path, f"cannot be mapped: {exc}") from None
            if len(specs) > 1 and i == 0:
                _random_access(path, mm)
            outs[i] = np.asarray(mm)
    return outs[0], (outs[1] if len(specs) > 1 else None), (outs[2] if i8 else None)


def _random_access(path: Path, mm: np.memmap) -> None:
    """Hints for the float32 rows of a half-precision or int8 bank, which searches read only for
    the candidates they re-score (a few rows per query, at random): drop the file's
    clean pages from the page cache (the verify pass read them) and map it for random
    access (no read-ahead), so that a search makes resident only the pages of the rows
    it reads. Best effort: silently skipped where the OS lacks these calls."""
    try:
        if hasattr(os, "posix_fadvise"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        raw = getattr(mm, "_mmap", None)
        if raw is not None and hasattr(raw, "madvise") and hasattr(mmap_module, "MADV_RANDOM"):
            raw.madvise(mmap_module.MADV_RANDOM)
    except (OSError, ValueError):
        pass


def _read_offsets(path: Path, expect: dict, u: int, n: int, verify: bool) -> np.ndarray:
    dt = np.dtype("<i8")
    _npy_header(path, dt, (u + 1,))
    data = _read_small(path, expect, verify)
    try:
        off = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise StoreError(path, f"cannot be read: {exc}") from None
    off = np.ascontiguousarray(off, dtype=np.int64)
    if off[0] != 0 or off[-1] != n or (np.diff(off) < 0).any():
        raise StoreError(path, f"offsets must be non-decreasing from 0 to {n}")
    return off


def _read_npy(path: Path, expect: dict, dtype: np.dtype, mmap: bool, verify: bool) -> np.ndarray:
    """A 1-D .npy of ``dtype`` (read, or mapped read-only), its checksum checked when ``verify``."""
    if mmap:
        if verify:
            sha = hashlib.sha256()
            try:
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(_CHUNK), b""):
                        sha.update(block)
            except OSError as exc:
                raise StoreError(path, f"cannot be read: {exc}") from None
            if sha.hexdigest() != expect["sha256"]:
                raise StoreError(path, "sha256 checksum mismatch (corrupt or edited)")
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as exc:
            raise StoreError(path, f"cannot be mapped: {type(exc).__name__}: {exc}") from None
    else:
        data = _read_small(path, expect, verify)
        try:
            arr = np.load(io.BytesIO(data), allow_pickle=False)
        except Exception as exc:
            raise StoreError(path, f"bad .npy file: {type(exc).__name__}: {exc}") from None
    if arr.dtype != dtype or arr.ndim != 1:
        raise StoreError(path, f"holds {arr.dtype} {arr.shape}, expected 1-D {dtype}")
    return arr
