"""File helpers every stage uses: atomic writes, streaming JSONL readers, hashing.

Atomic outputs: a stage writes to a temporary sibling path and renames it into place, so a
killed stage leaves either the old output or nothing, never half a file or half a folder.
Contents are fsynced before the rename and the parent folder after it, so a power cut does
not bring back an empty or half-flushed file under the new name.

Replacing an existing folder swaps the two names in one step (Linux `renameat2` with
`RENAME_EXCHANGE`), so at every instant the path holds the complete old folder or the
complete new one; the old one is then deleted. We swap rather than point a symlink at
versioned folders because the path stays a real folder: DVC, KFP artifact copies and
Kubernetes volume mounts see what they always saw. Where the filesystem cannot swap
(NFS, macOS), the old folder is renamed aside to `.old-<name>.*` first; a process killed
between the two renames leaves that sibling, and the next `atomic_dir` (or `recover_dir`)
on the path moves it back.

    with atomic_path("data/world/corpus.jsonl") as tmp:   # a file
        write(tmp)
    with atomic_dir("outputs/index") as tmp:                 # a whole folder
        build_into(tmp)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import gzip
import hashlib
import io
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mempo.errors import DataError

_TMP_MARK = ".tmp-"


def _tmp_sibling(path: Path) -> Path:
    return path.with_name(f"{_TMP_MARK}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every regular file and folder under `root` (children before their folder)."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            p = os.path.join(folder, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


_OLD_MARK = ".old-"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.lru_cache(maxsize=1)
def _renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> None:
    """Swap the names `a` and `b` (both must exist) in one step; OSError where unsupported."""
    fn = _renameat2()
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available here")
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


def recover_dir(path: str | Path) -> bool:
    """Undo a replacement of `path` that was killed halfway on a filesystem without swaps.

    If `path` is missing and a folder moved aside by `atomic_dir` (`.old-<name>.*`) is
    beside it, move it back (returns True); if `path` exists, delete such leftovers.
    """
    path = Path(path)
    aside = sorted(path.parent.glob(f"{_OLD_MARK}{path.name}.*"), key=lambda p: p.stat().st_mtime)
    restored = False
    if aside and not (path.exists() or path.is_symlink()):
        os.replace(aside.pop(), path)
        _fsync_dir(path.parent)
        restored = True
    for p in aside:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return restored


def _replace_in_two_steps(new: Path, path: Path) -> None:
    """The fallback where names cannot be swapped: old aside, new in, old deleted."""
    old = path.with_name(f"{_OLD_MARK}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    os.replace(path, old)
    try:
        os.replace(new, path)
    except BaseException:
        if not path.exists():
            os.replace(old, path)
        raise
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file path beside `path`; rename it onto `path` on success.

    On an exception the temporary file is removed and `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    try:
        yield tmp
        if not tmp.exists():
            raise FileNotFoundError(f"atomic_path: nothing was written to {tmp} for {path}")
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; on success it replaces `path` whole.

    Everything in the folder is fsynced first; an existing `path` is then swapped with it
    in one step (see the module docstring), so readers see either the complete old folder
    or the complete new one, and the old one is deleted. On an exception `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(path)
    tmp = _tmp_sibling(path)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if path.exists() or path.is_symlink():
            try:
                _exchange(tmp, path)  # tmp now holds the old folder, removed below
            except OSError:
                _replace_in_two_steps(tmp, path)
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists() or tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink()


def write_text(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | Path, obj: Any, indent: int | None = 2) -> Path:
    """Write `obj` as JSON atomically (keys sorted, so equal objects give equal bytes)."""
    return write_text(path, json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows as JSON lines atomically (`.gz` suffix compresses). Returns the row count."""
    path = Path(path)
    n = 0
    with atomic_path(path) as tmp:
        opener = gzip.open if path.suffix == ".gz" else open
        # mtime=0 keeps gzip output byte-identical across runs.
        raw = open(tmp, "wb")
        try:
            fh: Any = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if opener is gzip.open else raw
            for row in rows:
                fh.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
                n += 1
            if fh is not raw:
                fh.close()
        finally:
            raw.close()
    return n


def remove_stale_tmp(folder: str | Path) -> int:
    """Delete leftovers of killed atomic writes in `folder`. Returns how many were removed."""
    n = 0
    for p in Path(folder).glob(f"{_TMP_MARK}*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        n += 1
    return n


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def weights_sha256(model_dir: str | Path) -> str:
    """Hex sha256 over a Hugging Face model folder's weight files (`*.safetensors`, else `*.bin`),
    in name order: the same for two folders with the same weights, whatever their config files
    say (a transformers version, a path). DataError if the folder has no weight file."""
    folder = Path(model_dir)
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise DataError(f"no *.safetensors or *.bin weight file in {folder}", path=str(folder))
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode("utf-8") + b"\0" + sha256_file(f).encode("ascii"))
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------- readers


@dataclass
class ReadStats:
    """What a tolerant read skipped: bad line numbers with the reason."""

    path: str
    rows: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)


def _open_text_bytes(path: Path) -> io.BufferedIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def iter_jsonl(
    path: str | Path,
    *,
    skip_bad: bool = False,
    stats: ReadStats | None = None,
    max_line_bytes: int = 64 << 20,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Stream `(line_number, object)` from a `.jsonl` or `.jsonl.gz` file, never loading it whole.

    A malformed line (not UTF-8, not JSON, not an object, truncated, longer than
    `max_line_bytes`) raises `DataError` naming the file and the 1-based line number, unless
    `skip_bad` is set: then it is skipped and recorded in `stats`. Blank lines are ignored.
    """
    path = Path(path)
    if not path.exists():
        raise DataError("file not found", path=path)
    if stats is None:
        stats = ReadStats(str(path))
    try:
        fh = _open_text_bytes(path)
        with fh:
            for lineno, raw in enumerate(fh, start=1):
                err: str | None = None
                obj: Any = None
                if len(raw) > max_line_bytes:
                    err = f"line is {len(raw)} bytes, over the {max_line_bytes}-byte limit"
                elif not raw.strip():
                    continue
                else:
                    try:
                        text = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        err = f"not valid UTF-8 at byte {e.start}"
                    else:
                        try:
                            obj = json.loads(text)
                        except json.JSONDecodeError as e:
                            tail = "" if raw.endswith(b"\n") else " (truncated last line?)"
                            err = f"invalid JSON: {e.msg} at column {e.colno}{tail}"
                        else:
                            if not isinstance(obj, dict):
                                err = f"expected a JSON object, got {type(obj).__name__}"
                if err is not None:
                    if not skip_bad:
                        raise DataError(err, path=path, row=lineno)
                    stats.skipped.append((lineno, err))
                    continue
                stats.rows += 1
                yield lineno, obj
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"cannot read: {e}", path=path) from e


def flatten(obj: Any, sep: str = ".", prefix: str = "") -> dict[str, Any]:
    """The leaves of nested mappings, keys joined with `sep`: `{"a": {"b": 1}}` -> `{"a.b": 1}`
    (lists and None are leaves; an empty mapping has none). The one walker behind the flat
    params MLflow logs (`config.params_flat`) and the flat metrics (`flatten_numbers`)."""
    from collections.abc import Mapping

    flat: dict[str, Any] = {}

    def walk(key: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{key}{sep}{k}" if key else str(k), v)
        else:
            flat[key] = value

    walk(prefix, obj)
    return flat


def flatten_numbers(obj: Any, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of nested mappings as floats, keys joined with "/" (bools count as
    0/1; strings, lists and None are skipped): `{"a": {"b": 1}}` -> `{"a/b": 1.0}`."""
    return {k: float(v) for k, v in flatten(obj, "/", prefix).items() if isinstance(v, bool | int | float)}
