"""Run fingerprints: which training run a checkpoint belongs to, from its config and the
*contents* of its inputs.

    from mempo.training.fingerprint import HASH_CACHE_FILE, run_fingerprint
    fp = run_fingerprint({"train": ...}, {"policy": policy_dir, "data": data_dir},
                         run_dir / "checkpoints" / HASH_CACHE_FILE)

`run_fingerprint` hashes the training config (less the keys a resumption may change,
`RESUME_SAFE_KEYS`) together with `input_hash` of each input: a file's bytes, a folder's
files, or what a retrieval service serves (its index, not its port). Per-file hashes are
cached by (path, size, mtime, ctime, inode), so a resumed run does not reread an unchanged
index. `mempo.training.checkpoint` never continues a checkpoint written under another
fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mempo.errors import DataError, MempoError
from mempo.io import sha256_file, write_json

HASH_CACHE_FILE = "input_hashes.json"
# Files changed less than this long ago (ns) are not cached: their stamp may not have ticked.
_RACY_NS = 2_000_000_000


# Keys that may change between a run and its resumption without changing what is trained.
RESUME_SAFE_KEYS = frozenset({"resume", "steps", "max_steps", "checkpoint_every", "keep_checkpoints",
                              "threads", "device", "eval_every", "val_every", "out"})


def config_fingerprint(config: dict[str, Any], ignore: frozenset[str] | set[str] = frozenset()) -> str:
    """sha256 of the training config (JSON, sorted), ignoring `RESUME_SAFE_KEYS` and `ignore`
    at any depth."""
    skip = RESUME_SAFE_KEYS | set(ignore)

    def strip(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if k not in skip}
        return obj

    return hashlib.sha256(json.dumps(strip(config), sort_keys=True, default=str).encode()).hexdigest()


def _load_cache(cache: Path | None) -> dict[str, Any]:
    if cache is None:
        return {}
    try:
        data = json.loads(cache.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _file_hash(path: Path, cache: dict[str, Any]) -> str:
    """sha256 of a file's bytes, reused from `cache` while (size, mtime, ctime, inode) match.

    ctime is in the key because no tool can set it back: a rewrite that restores size and
    mtime (`cp -p`, `rsync -t`, `touch -d`) still changes it, so the file is read again.
    """
    st = path.stat()
    key = str(path.resolve())
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    hit = cache.get(key)
    if isinstance(hit, dict) and hit.get("stamp") == stamp:
        return str(hit["sha256"])
    digest = sha256_file(path)
    # Timestamps tick coarsely (a few ms; 1-2 s on some filesystems): a file changed within a
    # tick of being hashed could keep its stamp, so only files older than that are cached
    # (git's "racily clean" rule). Recently written files are simply read again next time.
    if time.time_ns() - st.st_ctime_ns > _RACY_NS:
        cache[key] = {"stamp": stamp, "sha256": digest}
    else:
        cache.pop(key, None)
    return digest


def _service_identity(url: str) -> str:
    """What a retrieval service serves (its `/health` index summary), not where it listens."""
    import httpx

    try:
        resp = httpx.get(url.rstrip("/") + "/health", timeout=30.0)
        index = resp.json()["index"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise MempoError(f"cannot fingerprint the retrieval service at {url} (GET /health: {e}); "
                         "training needs it reachable") from e
    return "service:" + hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()


def input_hash(spec: str | Path, cache: str | Path | None = None, *, probe_services: bool = True,
               _memo: dict[str, Any] | None = None) -> str:
    """Content hash of one training input, as the trainer reads it.

    - a file: sha256 of its bytes;
    - a folder: sha256 over every file's relative path and sha256 (temp leftovers of killed
      atomic writes skipped), so a changed, added or removed file changes it;
    - `http(s)://` (a retrieval service): the index summary its `/health` reports (the port it
      happens to listen on does not count); with `probe_services=False` the URL itself.

    File hashes are cached in the JSON file `cache` keyed by (path, size, mtime, ctime, inode),
    so a resume re-reads only what changed (a multi-GB index is read once).
    """
    text = str(spec)
    if text.startswith(("http://", "https://")):
        return _service_identity(text) if probe_services else "url:" + text.rstrip("/")
    path = Path(spec)
    if not path.exists():
        raise DataError("training input not found (cannot fingerprint it)", path=path)
    cache_path = Path(cache) if cache is not None else None
    memo = _memo if _memo is not None else _load_cache(cache_path)
    if path.is_file():
        out = "file:" + _file_hash(path, memo)
    else:
        h = hashlib.sha256()
        for folder, dirs, files in os.walk(path, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".tmp-", ".old-")))
            for name in sorted(files):
                if name.startswith((".tmp-", ".old-")):
                    continue
                f = Path(folder) / name
                h.update(f"{f.relative_to(path).as_posix()}\0{_file_hash(f, memo)}\n".encode())
        out = "dir:" + h.hexdigest()
    if _memo is None and cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(cache_path, memo, indent=None)
    return out


def run_fingerprint(config: Mapping[str, Any], inputs: Mapping[str, str | Path | None],
                    cache: str | Path | None = None, *, probe_services: bool = True,
                    ignore: frozenset[str] | set[str] = frozenset()) -> str:
    """The identity of one training run: its config plus the content hashes of its inputs.

    Args:
        config: the params sections the trainer reads (`RESUME_SAFE_KEYS` ignored).
        inputs: name -> path or retriever spec (None/"" skipped). Keys with these names are
            dropped from `config`: an input counts by what it holds, not where it lives.
        cache: JSON file for the per-file hash cache (see `input_hash`).
        probe_services: ask a retrieval service URL what it serves (see `input_hash`).
        ignore: more config keys that may change without changing the run (any depth).
    """
    cache_path = Path(cache) if cache is not None else None
    memo = _load_cache(cache_path)
    hashes = {name: input_hash(spec, probe_services=probe_services, _memo=memo)
              for name, spec in sorted(inputs.items()) if spec}
    if cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(cache_path, memo, indent=None)
    config_part = config_fingerprint(dict(config), ignore=set(inputs) | set(ignore))
    return hashlib.sha256(json.dumps({"config": config_part, "inputs": hashes}, sort_keys=True).encode()).hexdigest()
