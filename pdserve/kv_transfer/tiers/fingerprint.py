"""What a checkpoint holds, as a short hash: the disk tier's folder is named by it, so
weights overwritten in place under the same path never meet the KV of the old ones.

The fingerprint is the SHA-256 of every file of the checkpoint (a folder, recursively,
leaving out hidden files and folders; or one file), their names and bytes. Hashing a
large model is slow (SHA-256 runs at about 1-2 GB/s on one core: some 70-140 s for a
140 GB checkpoint), so each file's hash is kept in a sidecar, ``checkpoints.json`` in
the disk tier's folder (mode 0600), keyed by the file's path, size, inode, mtime and
ctime: a restart with unchanged files only reads their ``stat``; a file rewritten,
replaced or copied over (which moves its ctime, even where the mtime is set back) is
hashed again. One process hashes once (``lru_cache``).

A model named by a hub id is fingerprinted from its local snapshot when the hub's cache
holds one; a model that is neither a local path nor cached hashes to its name only,
with a warning (its KV is then keyed by the name, as before).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path

from pdserve.core.files import write_atomic

logger = logging.getLogger("pdserve.kv_transfer.disk")

SIDECAR = "checkpoints.json"
_CHUNK = 8 << 20


def checkpoint_fingerprint(model: str, disk_dir: str | Path | None) -> str:
    """The fingerprint of ``model``'s files (a path, or a hub id with a local snapshot),
    their hashes cached in ``disk_dir``'s sidecar (None: no sidecar, every file hashed);
    "" when no file of it can be found."""
    return _fingerprint(model, str(Path(disk_dir).resolve()) if disk_dir else "")


@functools.lru_cache(maxsize=8)
def _fingerprint(model: str, disk_dir: str) -> str:
    root = _local_files(model)
    if root is None:
        logger.warning("disk tier: no local files for model %r; its KV is keyed by the "
                       "name only (weights changed under it are not noticed)", model)
        return ""
    files = _files(root)
    sidecar = Path(disk_dir) / SIDECAR if disk_dir else None
    known = _read_sidecar(sidecar) if sidecar else {}
    seen: dict[str, list[int | str]] = {}
    total = hashlib.sha256()
    for path in files:
        name = str(path.relative_to(root)) if root.is_dir() else path.name
        seen[str(path)] = entry = _file_entry(path, known.get(str(path)))
        total.update(f"{name}\0{entry[-1]}\n".encode())
    if sidecar and seen != {k: v for k, v in known.items() if k in seen}:
        kept = {k: v for k, v in known.items() if os.path.exists(k)}  # drop the gone
        _write_sidecar(sidecar, {**kept, **seen})
    return total.hexdigest()[:16]


def _local_files(model: str) -> Path | None:
    path = Path(model).expanduser()
    if path.exists():
        return path.resolve()
    try:  # a hub id: its snapshot in the local cache, if any (never a download)
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True)).resolve()
    except Exception:  # not cached, not a valid id, no hub library: name only
        return None


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*")
                  if p.is_file() and not any(part.startswith(".")
                                             for part in p.relative_to(root).parts))


def _file_entry(path: Path, known: list[int | str] | None) -> list[int | str]:
    """``[size, inode, mtime_ns, ctime_ns, sha256]`` of ``path``; the hash is reused
    from ``known`` when the other four still match."""
    st = path.stat()  # follows links (hub snapshots link to their blobs)
    key: list[int | str] = [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]
    if known is not None and known[:4] == key:
        return known
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return [*key, digest.hexdigest()]


def _read_sidecar(path: Path) -> dict[str, list[int | str]]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items()
            if isinstance(k, str) and isinstance(v, list) and len(v) == 5}


def _write_sidecar(path: Path, entries: dict[str, list[int | str]]) -> None:
    """Written to a new temporary file (``mkstemp``: a fresh name, 0600, never a link
    already there) and renamed (processes starting together each write a whole file); a
    sidecar that cannot be written costs a rehash next time, no more."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(path, json.dumps(entries))
    except OSError as exc:
        logger.warning("disk tier: checkpoint hashes not saved to %s: %s", path, exc)
