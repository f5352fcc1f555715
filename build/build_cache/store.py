"""The cache directory: entries by build key, published atomically and checked at every pull.

    CACHE_DIR/
      cache.json                 marks the directory a cache of this layout (CACHE_SCHEMA)
      entries/<key>/             a published entry: the artifact directories and entry.json (their files' sizes and
                                 sha256, the key's parts, the stages that made them); last_used is touched at a pull
      building/<key>-<token>/    a builder's work in progress, on the same file system so that publishing is one
                                 rename (a partial entry is never visible); <token> names its lease
      leases/<key>/              the builder's lease (lease.py)
      refused/<key>-<id>/        entries found corrupt or foreign, moved aside (out of every reader's way) and rebuilt
      digests/                   checkpoint file hashes remembered by path, size and modification time (digest.py)

Requires POSIX semantics of the storage: atomic rename of a directory and exclusive create (NFS, EFS, Filestore,
CephFS). Object-store mounts without them (s3fs, gcsfuse, mountpoint-s3) are not supported.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from .. import __version__
from ..common.contracts import BuildLayout
from ..common.fsutil import fsync
from ..common.manifest import CacheRecord, PullMode, StageRecord
from ..errors import BuildCacheError
from .digest import Remembered, file_sha256
from .key import BuildKey
from .lease import Lease, LeaseWatch, live_tokens

CACHE_SCHEMA = 1
CACHE_MARKER = "cache.json"
ENTRY_FILE = "entry.json"
LAST_USED = "last_used"
# The directories of a build that an entry holds (all but the Triton repository and the manifest).
ARTIFACTS = (
    BuildLayout.VISION,
    BuildLayout.VISION_PLUGIN,
    BuildLayout.VISION_ENGINE,
    BuildLayout.LLM_CHECKPOINT,
    BuildLayout.LLM_ENGINE,
)
# A file this small is hashed at every pull (a fraction of a second); larger ones with --verify.
ALWAYS_HASH_BYTES = 64 << 20
# Several times the NFS client's attribute and directory caching (acdirmax: 60 s by default, nfs(5)), so that a
# stale view of a live builder's heartbeat never reads as a lapsed lease.
DEFAULT_LEASE_S = 180.0
DEFAULT_WAIT_S = 4 * 3600.0  # a 235B-A22B engine at TP 8 takes about an hour to build
_POLL_S = 1.0
_REPORT_S = 10.0


@dataclass(frozen=True)
class CacheSettings:
    """`build --cache`: the cache directory; pulled artifacts linked where they lie (read-only) or copied into the
    build; verify: hash every file of an entry at the pull (else sizes, and the hashes of small files); checkpoint_id:
    a revision the user vouches for, in place of the checkpoint's digest; lease_s and wait_s as BuildCache's."""

    root: Path
    mode: PullMode = "link"
    verify: bool = False
    checkpoint_id: str | None = None
    lease_s: float = DEFAULT_LEASE_S
    wait_s: float = DEFAULT_WAIT_S


class EntryProblem(BuildCacheError):
    """Why an entry cannot be served (corrupt, foreign, incomplete)."""


@dataclass(frozen=True)
class EntryManifest:
    """entry.json: the key and its parts, the artifact stages' records (outputs relative to the entry), each file's
    size and sha256 (relative path -> [size, sha256]), when and by which version it was published, how long the
    build took and the output directory it was built for (its skipped stages' commands name it)."""

    key: str
    parts: dict[str, str]
    stages: tuple[StageRecord, ...]
    files: dict[str, tuple[int, str]]
    created: str
    build_s: float
    built_for: str
    qwen3vl_trt: str = __version__

    @property
    def bytes(self) -> int:
        return sum(size for size, _ in self.files.values())

    def write(self, entry: Path) -> None:
        content = {
            "schema": CACHE_SCHEMA,
            **asdict(self),
            "stages": [s.as_json() for s in self.stages],
            "files": {k: list(v) for k, v in self.files.items()},
        }
        (entry / ENTRY_FILE).write_text(json.dumps(content, indent=1) + "\n")

    @classmethod
    def read(cls, entry: Path) -> EntryManifest:
        path = entry / ENTRY_FILE
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise EntryProblem(f"it has no {ENTRY_FILE}") from None
        except (OSError, ValueError) as e:
            raise EntryProblem(f"its {ENTRY_FILE} is unreadable ({e})") from None
        if not isinstance(raw, dict) or raw.get("schema") != CACHE_SCHEMA:
            schema = raw.get("schema") if isinstance(raw, dict) else None
            raise EntryProblem(f"it was written in another layout (schema {schema}, this version reads {CACHE_SCHEMA})")
        try:
            files = {str(k): (int(v[0]), str(v[1])) for k, v in raw["files"].items()}
            stages = tuple(StageRecord.from_json(s, path) for s in raw["stages"])
            return cls(
                key=str(raw["key"]),
                parts={str(k): str(v) for k, v in raw["parts"].items()},
                stages=stages,
                files=files,
                created=str(raw["created"]),
                build_s=float(raw["build_s"]),
                built_for=str(raw["built_for"]),
                qwen3vl_trt=str(raw["qwen3vl_trt"]),
            )
        except Exception as e:  # any malformed field: the entry is not one this version wrote
            raise EntryProblem(f"its {ENTRY_FILE} is malformed ({type(e).__name__}: {e})") from None


class EntryMoved(BuildCacheError):
    """The entry was moved away (refused or pruned elsewhere) between its check and its pull: look again."""


@dataclass(frozen=True)
class Pulled:
    """What `obtain` gives the pipeline: the entry's stage records (outputs relative to the build directory, skipped
    stages' commands naming this build's output) and the manifest's cache record."""

    stages: tuple[StageRecord, ...]
    record: CacheRecord


@dataclass(frozen=True)
class EntryInfo:
    """An entry as `cache list` shows it."""

    key: str
    bytes: int
    created: str
    last_used: float  # epoch seconds
    parts: dict[str, str]


def _files_of(root: Path) -> dict[str, Path]:
    found = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            found[str(path.relative_to(root))] = path
    return found


def _hash_all(paths: list[Path]) -> list[str]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(file_sha256, paths))


class BuildCache:
    """A cache directory (created on first use). lease_s: how long a builder's silent heartbeat means it is gone;
    wait_s: how long to wait for another builder of the same key before giving up."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        lease_s: float = DEFAULT_LEASE_S,
        wait_s: float = DEFAULT_WAIT_S,
        log: Callable[[str], None] = print,
    ) -> None:
        self.root = Path(root).absolute()
        self.lease_s = lease_s
        self.wait_s = wait_s
        self.log = log
        self.entries = self.root / "entries"
        self.building = self.root / "building"
        self.leases = self.root / "leases"
        self.refused = self.root / "refused"
        self.remembered = Remembered(self.root / "digests")

    def open(self, create: bool = True) -> BuildCache:
        """Creates the layout (create), or checks that an existing directory is a cache of this layout. The marker
        comes first, by an exclusive create with its content (a hard link), so that replicas opening a new cache
        at once all find it marked."""
        marker = self.root / CACHE_MARKER
        try:
            if not marker.is_file():
                if not create:
                    raise BuildCacheError(f"{self.root} is not a qwen3vl-trt build cache (it has no {CACHE_MARKER})")
                if self.root.exists() and any(self.root.iterdir()):
                    raise BuildCacheError(
                        f"{self.root} is not empty and not a qwen3vl-trt build cache (it has no {CACHE_MARKER})"
                    )
                self.root.mkdir(parents=True, exist_ok=True)
                tmp = self.root / f".{CACHE_MARKER}.{uuid.uuid4().hex}"
                tmp.write_text(json.dumps({"qwen3vl_trt_build_cache": CACHE_SCHEMA}) + "\n")
                try:
                    os.link(tmp, marker)
                except FileExistsError:
                    pass  # another replica marked it first
                finally:
                    tmp.unlink()
            for directory in (self.entries, self.building, self.leases, self.refused):
                directory.mkdir(exist_ok=True)
        except OSError as e:
            raise BuildCacheError(
                f"--cache {self.root} cannot be used: {e.strerror or e} (it must be a writable directory on storage "
                "every replica mounts)"
            ) from None
        try:
            schema = json.loads(marker.read_text()).get("qwen3vl_trt_build_cache")
        except (OSError, ValueError, AttributeError):
            schema = None
        if schema != CACHE_SCHEMA:
            raise BuildCacheError(
                f"{self.root} is a build cache of another layout ({CACHE_MARKER}: {schema!r}, this version uses "
                f"{CACHE_SCHEMA}); give this version a cache directory of its own"
            )
        return self

    # -- reading entries

    def check(self, key: BuildKey, verify: bool) -> EntryManifest | None:
        """The key's entry if it is whole: its entry.json names this key and parts, its files are exactly those
        listed with their sizes, and the files' sha256 match (those under ALWAYS_HASH_BYTES at every pull, all with
        verify). None when there is no entry; EntryProblem when there is one that must not be served."""
        entry = self.entries / key.key
        if not entry.is_dir():
            return None
        try:
            return self._checked(entry, key, verify)
        except FileNotFoundError:
            return None  # moved away (refused or pruned) while being checked: there is none
        except OSError as e:
            raise EntryProblem(f"it cannot be read ({e})") from None

    def _checked(self, entry: Path, key: BuildKey, verify: bool) -> EntryManifest:
        manifest = EntryManifest.read(entry)
        if manifest.key != key.key or manifest.parts != dict(key.parts):
            raise EntryProblem("it is foreign: its entry.json was written for another key")
        present = {rel: path for rel, path in _files_of(entry).items() if rel not in (ENTRY_FILE, LAST_USED)}
        missing = sorted(manifest.files.keys() - present.keys())
        extra = sorted(present.keys() - manifest.files.keys())
        if missing or extra:
            raise EntryProblem(f"its files differ from its manifest (missing {missing[:3]}, not listed {extra[:3]})")
        for rel, (size, _) in manifest.files.items():
            actual = present[rel].stat().st_size
            if actual != size:
                raise EntryProblem(f"{rel} has {actual} bytes, its manifest says {size} (truncated or altered)")
        to_hash = sorted(rel for rel, (size, _) in manifest.files.items() if verify or size <= ALWAYS_HASH_BYTES)
        for rel, digest in zip(to_hash, _hash_all([present[rel] for rel in to_hash]), strict=True):
            if digest != manifest.files[rel][1]:
                raise EntryProblem(f"{rel}'s sha256 differs from its manifest's (altered)")
        return manifest

    def _refuse(self, key: str, why: str | None = None, inode: int | None = None) -> None:
        """Moves an entry aside, bad (`why`) or pruned: one rename, so readers after it find none (and rebuild).
        inode: the entry directory that was found bad; one published since in its place stays."""
        entry = self.entries / key
        try:
            if inode is not None and entry.stat().st_ino != inode:
                return  # already replaced by a rebuilt entry
            if why is not None:
                self.log(f"build cache: entry {key} refused: {why}; it is moved to {self.refused} and rebuilt")
            os.rename(entry, self.refused / f"{key}-{uuid.uuid4().hex[:8]}")
        except FileNotFoundError:
            pass  # another replica moved it first

    # -- obtaining artifacts

    def obtain(
        self,
        key: BuildKey,
        build: Callable[[Path], tuple[StageRecord, ...]],
        into: Path,
        built_for: Path,
        mode: PullMode = "link",
        verify: bool = False,
    ) -> Pulled:
        """The key's artifacts in the build directory `into` (links to the entry or copies): pulled from the cache,
        or built by `build(staging_dir)` (which returns its stage records) and published first when no entry is
        there. With a builder of the key at work elsewhere, waits for it and pulls. built_for: the build's final
        output directory."""
        self.open()
        started = time.monotonic()
        watch = LeaseWatch(self.leases / key.key, self.lease_s)
        refused: str | None = None
        reported = started
        while True:
            manifest, problem = self._look(key, verify)
            if problem is not None:
                refused = problem
            if manifest is not None:
                waited = time.monotonic() - started
                try:
                    return self._pull(key, manifest, into, built_for, mode, "pulled", waited, refused)
                except EntryMoved:
                    _unpull(into)
                    continue
            generation, holder, live = watch.look()
            if not live:
                try:
                    lease = Lease.try_take(watch.directory, self.lease_s, generation)
                except OSError as e:
                    raise BuildCacheError(
                        f"key {key.key} is not in the build cache {self.root}, and building it there needs to write "
                        f"{watch.directory}: {e.strerror or e}"
                    ) from None
                if lease is not None:
                    return self._build(key, lease, build, into, built_for, mode, verify, started, refused)
                time.sleep(_POLL_S)  # another waiter took it (or this host's listing is stale): watch again
                continue
            if time.monotonic() - started > self.wait_s:
                raise BuildCacheError(
                    f"waited {self.wait_s:g} s for {holder.describe() if holder else 'another builder'} to build key "
                    f"{key.key} in {self.root}; its lease is still renewed. Raise the wait or check that builder"
                )
            if time.monotonic() - reported >= _REPORT_S:
                reported = time.monotonic()
                who = holder.describe() if holder else "another builder"
                self.log(
                    f"build cache: waiting for {who} to build key {key.key} (waited {reported - started:.0f} s; its "
                    f"heartbeat last changed {watch.still_for():.0f} s ago, lease {self.lease_s:g} s)"
                )
            time.sleep(_POLL_S)

    def _look(self, key: BuildKey, verify: bool) -> tuple[EntryManifest | None, str | None]:
        try:
            inode = (self.entries / key.key).stat().st_ino
        except FileNotFoundError:
            return None, None
        try:
            return self.check(key, verify), None
        except EntryProblem as e:
            self._refuse(key.key, str(e), inode)
            return None, str(e)

    def _build(
        self,
        key: BuildKey,
        lease: Lease,
        build: Callable[[Path], tuple[StageRecord, ...]],
        into: Path,
        built_for: Path,
        mode: PullMode,
        verify: bool,
        started: float,
        refused: str | None,
    ) -> Pulled:
        staging = self.building / f"{key.key}-{lease.token}"
        try:
            manifest, problem = self._look(key, verify)  # published between our look and our lease
            if manifest is not None:
                return self._pull(key, manifest, into, built_for, mode, "pulled", time.monotonic() - started, refused)
            refused = problem or refused
            waited = time.monotonic() - started
            self.log(
                f"build cache: miss for key {key.key}: building (lease {lease.path.name} held by pid {os.getpid()})"
            )
            build_start = time.monotonic()
            staging.mkdir(parents=True)
            stages = build(staging)
            build_s = time.monotonic() - build_start
            self._publish(key, staging, stages, build_s, built_for)
        finally:
            lease.release()
            _remove_tree(staging)
        manifest = self.check(key, verify=False)
        if manifest is None:
            raise BuildCacheError(f"entry {key.key} vanished from {self.entries} right after it was published")
        return self._pull(key, manifest, into, built_for, mode, "built", waited, refused, build_s)

    def _publish(
        self, key: BuildKey, staging: Path, stages: tuple[StageRecord, ...], build_s: float, built_for: Path
    ) -> None:
        """entry.json with every file's size and sha256, files made read-only and flushed, then one rename; an
        entry published meanwhile by another builder wins (both are builds of the same key)."""
        start = time.monotonic()
        files = _files_of(staging)
        rels = sorted(files)
        total = sum(path.stat().st_size for path in files.values())
        if total > 1 << 30:
            self.log(f"build cache: hashing the entry's {total / 2**30:.1f} GiB for its manifest")
        digests = _hash_all([files[rel] for rel in rels])
        manifest = EntryManifest(
            key=key.key,
            parts=dict(key.parts),
            stages=stages,
            files={rel: (files[rel].stat().st_size, digest) for rel, digest in zip(rels, digests, strict=True)},
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            build_s=round(build_s, 1),
            built_for=str(built_for),
        )
        manifest.write(staging)
        for path in [*files.values(), staging / ENTRY_FILE]:
            os.chmod(path, 0o444)  # served where it lies: nobody writes into an entry
            fsync(path)
        for dirpath, _dirnames, _filenames in os.walk(staging, topdown=False):
            if Path(dirpath) != staging:  # the entry itself stays writable: last_used, and moving it aside
                os.chmod(dirpath, 0o555)
            fsync(Path(dirpath), directory=True)
        try:
            os.rename(staging, self.entries / key.key)
        except OSError:
            if not (self.entries / key.key).is_dir():
                raise
            self.log(f"build cache: key {key.key} was published by another builder meanwhile; using that entry")
            return
        fsync(self.entries, directory=True)
        self.log(
            f"build cache: published key {key.key} ({manifest.bytes / 2**30:.2f} GiB, hashed in "
            f"{time.monotonic() - start:.1f} s)"
        )

    def _pull(
        self,
        key: BuildKey,
        manifest: EntryManifest,
        into: Path,
        built_for: Path,
        mode: PullMode,
        source: str,
        waited: float,
        refused: str | None,
        build_s: float | None = None,
    ) -> Pulled:
        start = time.monotonic()
        entry = self.entries / key.key
        for name in sorted({rel.split(os.sep, 1)[0] for rel in manifest.files}):
            try:
                if mode == "link":
                    os.symlink(entry / name, into / name, target_is_directory=True)
                    (into / name).stat()  # resolves: the entry was not moved away since its check
                else:
                    shutil.copytree(entry / name, into / name)
            except FileNotFoundError:
                raise EntryMoved(key.key) from None
        try:
            (entry / LAST_USED).touch()
        except OSError:
            pass  # read-only mount of the cache: pruning by age then counts from the publish
        seconds = time.monotonic() - start
        if source == "pulled":
            how = "linked" if mode == "link" else "copied"
            self.log(
                f"build cache: hit for key {key.key}: {manifest.bytes / 2**30:.2f} GiB {how} from {entry} in "
                f"{seconds:.1f} s" + (f" after waiting {waited:.0f} s for its builder" if waited >= 1 else "")
            )
        stages = tuple(_retarget(s, manifest.built_for, built_for) for s in manifest.stages)
        record = CacheRecord(
            key=key.key,
            parts=dict(key.parts),
            source="built" if source == "built" else "pulled",
            entry=str(entry),
            mode=mode,
            wait_s=round(waited, 1),
            pull_s=round(seconds, 2),
            pull_bytes=manifest.bytes,
            build_s=None if build_s is None else round(build_s, 1),
            refused=refused,
        )
        return Pulled(stages, record)

    # -- listing and pruning

    def listing(self) -> list[EntryInfo]:
        infos = []
        for entry in sorted(self.entries.iterdir()) if self.entries.is_dir() else []:
            try:
                manifest = EntryManifest.read(entry)
            except EntryProblem:
                infos.append(EntryInfo(entry.name, 0, "?", entry.stat().st_mtime, {}))
                continue
            used = entry / LAST_USED
            last = used.stat().st_mtime if used.exists() else (entry / ENTRY_FILE).stat().st_mtime
            infos.append(EntryInfo(entry.name, manifest.bytes, manifest.created, last, manifest.parts))
        return infos

    def prune(
        self, older_than_s: float | None = None, max_bytes: int | None = None, dry_run: bool = False
    ) -> list[str]:
        """Removes entries not pulled for older_than_s, then the least recently pulled until the rest fit in
        max_bytes; also refused entries and the work of builders whose lease is gone. The removed entries' keys.
        An entry is first renamed into refused/ (one step: no reader sees half of it), then deleted."""
        now = time.time()
        infos = sorted(self.listing(), key=lambda info: info.last_used)
        doomed = [i for i in infos if older_than_s is not None and now - i.last_used > older_than_s]
        kept = [i for i in infos if i not in doomed]
        if max_bytes is not None:
            while kept and sum(i.bytes for i in kept) > max_bytes:
                doomed.append(kept.pop(0))
        if dry_run:
            return [i.key for i in doomed]
        for info in doomed:
            self._refuse(info.key)
        for stale in self.building.iterdir() if self.building.is_dir() else []:
            key, _, token = stale.name.rpartition("-")
            if token not in live_tokens(self.leases / key):
                _remove_tree(stale)
        for refused in self.refused.iterdir() if self.refused.is_dir() else []:
            _remove_tree(refused)
        return [i.key for i in doomed]


def _retarget(stage: StageRecord, built_for: str, output: Path) -> StageRecord:
    """A skipped stage's command as it reads for this build's output directory."""
    if stage.rerun_on_gpu_host is None or built_for == str(output):
        return stage
    return StageRecord(
        **{**asdict(stage), "rerun_on_gpu_host": stage.rerun_on_gpu_host.replace(built_for, str(output))}
    )


def _unpull(into: Path) -> None:
    """Takes back what a pull put into a build directory."""
    for name in ARTIFACTS:
        path = into / name
        if path.is_symlink():
            path.unlink()
        elif path.exists():
            _remove_tree(path)


def _remove_tree(path: Path) -> None:
    """Deletes a tree whose directories may be read-only (an entry's); what cannot be removed stays for prune."""
    for dirpath, _dirnames, _filenames in os.walk(path):
        with contextlib.suppress(OSError):
            os.chmod(dirpath, 0o755)
    shutil.rmtree(path, ignore_errors=True)
