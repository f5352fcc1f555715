"""The checkpoint digest: a sha256 over every file of a checkpoint directory (its relative path, size and sha256),
so any change to a weight or config file changes it.

Each file's sha256 comes from the cheapest source that holds it:
- the hub's cache layout (`hf_hub_download` without local_dir): a snapshot file links to `blobs/<sha256>` for a file
  stored with LFS (huggingface_hub file_download.py, `_create_symlink` to the blob named by the etag);
- a `local_dir` download's metadata, `.cache/huggingface/download/<file>.metadata` (commit hash, etag, timestamp),
  trusted as huggingface_hub does only while the file is not newer than the metadata (huggingface_hub 2.4
  `_local_folder.read_download_metadata`); the etag is the sha256 for LFS files;
- a hash this cache computed before for the same real path, size and modification time (`Remembered`);
- else read and hashed now (and remembered). Small files (configs, tokenizer) have git sha1 etags and are hashed.
Hidden paths (`.cache`, `.git`) are not part of the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

_SHA256 = re.compile(r"[0-9a-f]{64}")
_HUB_METADATA = Path(".cache") / "huggingface" / "download"
_CHUNK = 8 << 20
# Files are hashed a few at a time: sha256 releases the GIL on large updates, and network storage serves
# parallel reads faster than one stream.
_HASH_THREADS = 4


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class Remembered:
    """Hashes computed before, one JSON file per checkpoint file in `directory` (the cache's digests/), keyed by
    the file's real path and valid while its size, modification and change times (ns) and inode are the same (the
    change time, which copy tools cannot set, tells apart a same-size copy with its mtime kept)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _record(self, real: Path) -> Path:
        return self.directory / f"{hashlib.sha256(str(real).encode()).hexdigest()}.json"

    def get(self, real: Path, stat: os.stat_result) -> str | None:
        try:
            record = json.loads(self._record(real).read_text())
        except (OSError, ValueError):
            return None
        valid = (
            isinstance(record, dict)
            and record.get("file") == _identity(real, stat)
            and isinstance(record.get("sha256"), str)
            and _SHA256.fullmatch(record["sha256"]) is not None
        )
        return record["sha256"] if valid else None

    def put(self, real: Path, stat: os.stat_result, sha256: str) -> None:
        """Best effort: a cache mounted read-only (or full) only loses the shortcut for next time."""
        record = self._record(real)
        tmp = record.with_name(f".{record.name}.{uuid.uuid4().hex}.tmp")  # replicas share pids across PID namespaces
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"file": _identity(real, stat), "sha256": sha256}))
            os.replace(tmp, record)
        except OSError:
            tmp.unlink(missing_ok=True)


def _identity(real: Path, stat: os.stat_result) -> list:
    return [str(real), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


@dataclass(frozen=True)
class CheckpointDigest:
    """The digest ("sha256:<hex>"), and how many files each source gave (hub, download-metadata, remembered,
    hashed), the bytes hashed now and the seconds it took."""

    value: str
    sources: dict[str, int]
    hashed_bytes: int
    seconds: float

    def describe(self) -> str:
        counts = ", ".join(f"{n} {source}" for source, n in sorted(self.sources.items()))
        hashed = f"{self.hashed_bytes / 2**30:.2f} GiB hashed in {self.seconds:.1f} s"
        return f"checkpoint digest {self.value[:19]}... ({counts}; {hashed})"


def _hub_sha256(path: Path, rel: str, root: Path, stat: os.stat_result) -> tuple[str, str] | None:
    """(sha256, source) from the hub's own records, if it has them for this file. Only the snapshot link's own
    target counts: huggingface_hub 2.4 links that blob on to a store shared by repos, named by its Xet hash
    (utils/_shared_blobs.py)."""
    if path.is_symlink():
        target = Path(os.path.normpath(path.parent / os.readlink(path)))
        if target.parent.name == "blobs" and _SHA256.fullmatch(target.name):
            return target.name, "hub"
    metadata = root / _HUB_METADATA / f"{rel}.metadata"
    try:
        _commit, etag, timestamp = metadata.read_text().splitlines()[:3]
        if _SHA256.fullmatch(etag.strip().strip('"')) and stat.st_mtime - 1 <= float(timestamp):
            return etag.strip().strip('"'), "download-metadata"
    except (OSError, ValueError):
        pass
    return None


def checkpoint_files(root: Path) -> list[str]:
    """The checkpoint's files, relative to root, sorted (hidden paths left out)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith("."):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


def checkpoint_digest(
    root: str | os.PathLike[str], remembered: Remembered | None = None, log: Callable[[str], None] = print
) -> CheckpointDigest:
    """The digest of the checkpoint directory `root`; files not known to the hub are hashed (progress logged every
    ~10 s) and remembered when `remembered` is given."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    start = time.perf_counter()
    rels = checkpoint_files(root)
    if not rels:
        raise CheckpointError(f"checkpoint directory {root} holds no files")
    sources: Counter[str] = Counter()
    known: dict[str, str] = {}
    to_hash: list[tuple[str, Path, os.stat_result]] = []
    sizes = {}
    for rel in rels:
        path = root / rel
        stat = path.stat()
        sizes[rel] = stat.st_size
        real = path.resolve()
        found = _hub_sha256(path, rel, root, stat)
        if found is None and remembered is not None and (value := remembered.get(real, stat)) is not None:
            found = value, "remembered"
        if found is None:
            to_hash.append((rel, real, stat))
        else:
            known[rel] = found[0]
            sources[found[1]] += 1
    total = sum(stat.st_size for _, _, stat in to_hash)
    done = 0
    last_report = time.monotonic()
    if total > 1 << 30:
        log(f"hashing {len(to_hash)} checkpoint file(s), {total / 2**30:.1f} GiB (remembered for the next build)")
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        for (rel, real, stat), value in zip(to_hash, pool.map(lambda item: file_sha256(item[1]), to_hash), strict=True):
            known[rel] = value
            sources["hashed"] += 1
            if remembered is not None:
                remembered.put(real, stat, value)
            done += stat.st_size
            if time.monotonic() - last_report > 10:
                last_report = time.monotonic()
                log(f"hashed {done / 2**30:.1f} of {total / 2**30:.1f} GiB of the checkpoint")
    lines = "".join(f"{rel}\t{sizes[rel]}\t{known[rel]}\n" for rel in rels)
    value = hashlib.sha256(f"qwen3vl-trt checkpoint digest 1\n{lines}".encode()).hexdigest()
    return CheckpointDigest(f"sha256:{value}", dict(sources), total, time.perf_counter() - start)
