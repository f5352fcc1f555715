"""The shared build cache (`build --cache`): a second build of the same key pulls the first's artifacts, byte for
byte, and writes its own repository; anything that changes artifacts is another key; builders started together
build once; a builder that dies hands over when its lease lapses; a damaged entry is rebuilt, never served."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from qwen3vl_trt.build_cache import store as store_module
from qwen3vl_trt.build_cache.digest import Remembered, checkpoint_digest, file_sha256
from qwen3vl_trt.build_cache.key import BuildKey, Platform
from qwen3vl_trt.build_cache.store import ENTRY_FILE, BuildCache, CacheSettings, EntryProblem
from qwen3vl_trt.common.contracts import BuildLayout
from qwen3vl_trt.common.manifest import VISION_STAGE, BuildManifest, StageRecord
from qwen3vl_trt.hf.checkpoint import Checkpoint
from qwen3vl_trt.pipeline.build import BuildOptions, build, build_key
from qwen3vl_trt.runtime.local import LocalPipeline
from qwen3vl_trt.runtime.sampling import SamplingParams
from qwen3vl_trt.serving.repository.settings import RepositorySettings

from tests.deployment import cli, user

# The cache's behaviour does not depend on the transformers version (the builds only use it to export).
pytestmark = [pytest.mark.once, pytest.mark.slow]

FAST = BuildOptions(dtype="fp16")  # an export without the fp32 parity run: these tests are about the cache


def _quiet(*_args) -> None:
    pass


def _artifact_hashes(build_dir: Path) -> dict[str, str]:
    """sha256 of every artifact file of a build (through its links into the cache), by relative path."""
    hashes = {}
    for name in store_module.ARTIFACTS:
        top = build_dir / name
        if top.exists():
            for path in sorted(p for p in top.rglob("*") if p.is_file()):
                hashes[str(path.relative_to(build_dir))] = file_sha256(path)
    return hashes


def _key(ckpt_dir: Path, **options):
    ckpt = Checkpoint(ckpt_dir)
    build_options = BuildOptions(**options)
    return build_key(ckpt, build_options, build_options.check(ckpt), log=_quiet)


@pytest.fixture(scope="module")
def published(tiny_dense, tmp_path_factory) -> tuple[Path, Path, BuildManifest, list[str]]:
    """A miss: the cache, the build directory, its manifest and its log."""
    root = tmp_path_factory.mktemp("published")
    lines: list[str] = []
    first = build(tiny_dense, root / "b1", FAST, cache=CacheSettings(root / "cache"), log=lines.append)
    return root / "cache", root / "b1", first, lines


def test_second_build_is_a_hit_with_the_same_artifacts_and_its_own_repository(tiny_dense, tmp_path, published):
    """A hit copies (or links) exactly what the miss built; a repository setting changes only the repository."""
    cache, b1, first, lines = published
    assert first.cache is not None and first.cache.source == "built" and first.cache.build_s is not None
    assert any("miss for key" in line for line in lines)
    assert (b1 / BuildLayout.VISION).is_symlink()  # link mode: served where it lies in the cache

    lines = []
    settings = RepositorySettings(max_queue_delay_us=500)
    second = build(
        tiny_dense,
        tmp_path / "b2",
        FAST,
        cache=CacheSettings(cache, mode="copy"),
        settings=settings,
        log=lines.append,
    )
    assert second.cache is not None and second.cache.source == "pulled" and second.cache.key == first.cache.key
    assert second.cache.pull_bytes > 0 and any("hit for key" in line for line in lines)
    assert not (tmp_path / "b2" / BuildLayout.VISION).is_symlink()
    assert _artifact_hashes(b1) == _artifact_hashes(tmp_path / "b2")
    # The manifest read back says how the artifacts were obtained.
    assert BuildManifest.read(tmp_path / "b2").source == "pulled"
    assert BuildManifest.of_repository(tmp_path / "b2" / BuildLayout.TRITON_REPO) == BuildManifest.read(tmp_path / "b2")

    # Its own repository: its paths and the changed setting.
    config = (tmp_path / "b2" / BuildLayout.TRITON_REPO / "llm" / "config.pbtxt").read_text()
    assert str(tmp_path / "b2" / BuildLayout.LLM_CHECKPOINT) in config and "max_queue_delay_microseconds: 500" in config
    assert (
        "max_queue_delay_microseconds: 500" not in (b1 / BuildLayout.TRITON_REPO / "llm" / "config.pbtxt").read_text()
    )

    # Both builds answer alike.
    messages = user("Describe the picture.", _png())
    answers = [
        LocalPipeline(tiny_dense, b).generate(messages, SamplingParams(max_new_tokens=6)).token_ids
        for b in (b1, tmp_path / "b2")
    ]
    assert answers[0] == answers[1] and len(answers[0]) == 6


def _png() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 90)).save(out, format="PNG")
    return out.getvalue()


def _flip_weight_byte(ckpt_dir: Path) -> str:
    """Changes one byte of tensor data in the first shard (its header untouched); the shard's name."""
    shard = sorted(ckpt_dir.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    data[8 + header_len + 5] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard.name


def test_what_changes_artifacts_changes_the_key(tiny_dense, tmp_path, monkeypatch):
    """A weight changed in one shard, an artifact option, another GPU: another key. A repository setting is not
    part of the key (the hit above)."""
    base = _key(tiny_dense)
    assert _key(tiny_dense) == base  # deterministic
    changed = tmp_path / "changed"
    shutil.copytree(tiny_dense, changed)
    assert _key(changed).key == base.key  # the digest is of the content, not the path
    _flip_weight_byte(changed)
    assert _key(changed).parts["checkpoint"] != base.parts["checkpoint"]
    assert _key(changed).key != base.key
    assert _key(tiny_dense, dtype="bf16").key != base.key
    from qwen3vl_trt.common.limits import EngineLimits

    assert _key(tiny_dense, limits=EngineLimits(max_batch_size=4)).key != base.key
    h200 = Platform("NVIDIA H200", "9.0", "10.14.1.48", "1.2.1", "13.0")
    monkeypatch.setattr(Platform, "detect", classmethod(lambda cls, ranks=1: h200))
    on_h200 = _key(tiny_dense)
    h100 = dataclasses.replace(h200, gpu="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(Platform, "detect", classmethod(lambda cls, ranks=1: h100))
    assert len({base.key, on_h200.key, _key(tiny_dense).key}) == 3
    assert on_h200.parts["gpu"] == "NVIDIA H200" and on_h200.parts["compute_capability"] == "9.0"


def test_checkpoint_digest_reads_the_hubs_hashes_and_remembers_its_own(tmp_path):
    """The hub's blob names and download metadata give a file's sha256 without reading it (while the file is not
    newer than the metadata); other files are hashed once and remembered by path, size and mtime."""
    plain = tmp_path / "plain"
    plain.mkdir()
    weights = os.urandom(1 << 16)
    (plain / "model.safetensors").write_bytes(weights)
    (plain / "config.json").write_text("{}")
    sha = hashlib.sha256(weights).hexdigest()
    expected = checkpoint_digest(plain, log=_quiet)
    assert expected.sources == {"hashed": 2}

    # hf_hub_download into the hub cache: the snapshot links to blobs/<sha256>.
    hub = tmp_path / "models--org--name"
    (hub / "blobs").mkdir(parents=True)
    (hub / "blobs" / sha).write_bytes(weights)
    snapshot = hub / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(hub / "blobs" / sha)
    (snapshot / "config.json").write_text("{}")
    found = checkpoint_digest(snapshot, log=_quiet)
    assert found.value == expected.value and found.sources == {"hub": 1, "hashed": 1}
    # huggingface_hub 2.4 links the blob on into a store shared by repos, named by its Xet hash.
    shared = tmp_path / "blobs" / "ab"
    shared.mkdir(parents=True)
    (hub / "blobs" / sha).rename(shared / ("ab" + "1" * 62))
    (hub / "blobs" / sha).symlink_to(shared / ("ab" + "1" * 62))
    found = checkpoint_digest(snapshot, log=_quiet)
    assert found.value == expected.value and found.sources == {"hub": 1, "hashed": 1}

    # A local_dir download's metadata (commit, etag, timestamp); a file modified after it is hashed again.
    local = tmp_path / "local"
    shutil.copytree(plain, local)
    metadata = local / ".cache" / "huggingface" / "download"
    metadata.mkdir(parents=True)
    (metadata / "model.safetensors.metadata").write_text(f"0123abc\n{sha}\n{time.time() + 5}\n")
    found = checkpoint_digest(local, log=_quiet)
    assert found.value == expected.value and found.sources == {"download-metadata": 1, "hashed": 1}
    (metadata / "model.safetensors.metadata").write_text(f"0123abc\n{'0' * 64}\n{time.time() - 100}\n")
    assert checkpoint_digest(local, log=_quiet).value == expected.value  # the stale metadata's etag is not used

    remembered = Remembered(tmp_path / "digests")
    assert checkpoint_digest(plain, remembered, _quiet).sources == {"hashed": 2}
    again = checkpoint_digest(plain, remembered, _quiet)
    assert again.value == expected.value and again.sources == {"remembered": 2} and again.hashed_bytes == 0
    (plain / "model.safetensors").write_bytes(os.urandom(1 << 16))
    changed = checkpoint_digest(plain, remembered, _quiet)
    assert changed.value != expected.value and changed.sources == {"hashed": 1, "remembered": 1}


def _build_command(ckpt: Path, output: Path, cache: Path, *extra: str) -> list[str]:
    return ["build", "--model", str(ckpt), "--output", str(output), "--cache", str(cache), "--dtype", "fp16", *extra]


def test_builders_started_together_build_once(tiny_dense, tmp_path):
    """Three replicas starting at once for one key: one builds, two wait (reported) and pull the same artifacts."""
    cache = tmp_path / "cache"
    procs = [
        cli(*_build_command(tiny_dense, tmp_path / f"r{i}", cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for i in range(3)
    ]
    logs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], logs
    sources = sorted(BuildManifest.read(tmp_path / f"r{i}").source for i in range(3))
    assert sources == ["built", "pulled", "pulled"], logs
    assert sum("miss for key" in log for log in logs) == 1
    hashes = [_artifact_hashes(tmp_path / f"r{i}") for i in range(3)]
    assert hashes[0] == hashes[1] == hashes[2] and hashes[0]
    records = [BuildManifest.read(tmp_path / f"r{i}").cache for i in range(3)]
    pulled = [r for r in records if r is not None and r.source == "pulled"]
    assert len(pulled) == 2 and all(r.wait_s > 0 for r in pulled), records  # they waited for the builder
    assert len(BuildCache(cache).listing()) == 1


def test_a_dead_builders_lease_lapses_and_another_builds(tiny_dense, tmp_path):
    """A builder killed mid-build: the next one waits for its lease to lapse (its heartbeat stops), takes it,
    builds and publishes; prune clears the dead builder's work."""
    cache = tmp_path / "cache"
    lease = ("--cache-lease-s", "3")
    victim = cli(*_build_command(tiny_dense, tmp_path / "dead", cache, *lease), stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any((cache / "building").glob("*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert any((cache / "building").glob("*")), "the builder did not start building"
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert not (cache / "entries").exists() or not any((cache / "entries").iterdir())
    heir = subprocess.run(
        [sys.executable, "-m", "qwen3vl_trt.cli", *_build_command(tiny_dense, tmp_path / "heir", cache, *lease)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert heir.returncode == 0, heir.stdout + heir.stderr
    assert "lease-000002.json" in heir.stdout  # the dead builder held generation 1
    assert "waiting for pid" in heir.stdout or BuildManifest.read(tmp_path / "heir").cache.wait_s >= 3  # type: ignore[union-attr]
    manifest = BuildManifest.read(tmp_path / "heir")
    assert manifest.source == "built"
    # The dead builder's work stays (a slow builder taken for dead may still finish it) until cache prune, which
    # removes work whose lease is gone.
    assert len(list((cache / "building").iterdir())) == 1
    BuildCache(cache, log=_quiet).prune()
    assert list((cache / "building").iterdir()) == [] and len(BuildCache(cache).listing()) == 1
    assert not (tmp_path / "dead").exists()  # nothing half-written where the dead builder was to publish


def test_a_damaged_entry_is_rebuilt_never_served(tiny_dense, tmp_path, monkeypatch, published):
    """Truncated: found by size at every pull. Altered in place at the same size: by hash, at every pull for small
    files and with verify for large ones. Foreign (another key's entry.json): refused too."""
    cache = tmp_path / "cache"
    shutil.copytree(published[0], cache)  # a cache of its own to damage
    first = published[2]
    assert first.cache is not None
    entry = cache / "entries" / first.cache.key
    store = BuildCache(cache, log=_quiet)
    key = _cache_key(first)

    small = entry / BuildLayout.LLM_CHECKPOINT / "config.json"
    _rewrite(small, lambda data: data[:-1] + bytes([data[-1] ^ 1]))  # same size
    with pytest.raises(EntryProblem, match="sha256 differs"):
        store.check(key, verify=False)
    _rewrite(small, lambda data: data[:-1] + bytes([data[-1] ^ 1]))  # restored
    assert store.check(key, verify=False) is not None

    large = max((p for p in entry.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    _rewrite(large, lambda data: bytes([data[0] ^ 1]) + data[1:])
    monkeypatch.setattr(store_module, "ALWAYS_HASH_BYTES", 1024)  # as a large file of a full-size model
    assert store.check(key, verify=False) is not None  # sizes only: a same-size alteration passes ...
    with pytest.raises(EntryProblem, match="sha256 differs"):
        store.check(key, verify=True)  # ... --verify finds it
    monkeypatch.undo()

    # Truncated: the next build refuses the entry, moves it aside and builds again; the result is whole.
    _rewrite(large, lambda data: data[: len(data) // 2])
    lines: list[str] = []
    rebuilt = build(tiny_dense, tmp_path / "b2", FAST, cache=CacheSettings(cache), log=lines.append)
    assert rebuilt.cache is not None and rebuilt.cache.source == "built"
    assert rebuilt.cache.refused is not None and "truncated" in rebuilt.cache.refused
    assert any("refused" in line for line in lines)
    assert store.check(key, verify=True) is not None
    assert any((cache / "refused").iterdir())

    # Foreign: an entry.json written for another key.
    manifest = json.loads((entry / ENTRY_FILE).read_text())
    _rewrite(entry / ENTRY_FILE, lambda _: json.dumps({**manifest, "key": "0" * 32}).encode())
    with pytest.raises(EntryProblem, match="foreign"):
        store.check(key, verify=False)

    # Pruning clears what was refused and, by size, the entries.
    assert store.prune(max_bytes=0) == [key.key]
    assert store.listing() == [] and not any((cache / "refused").iterdir())


def _cache_key(manifest: BuildManifest):
    assert manifest.cache is not None
    return BuildKey(manifest.cache.key, manifest.cache.parts)


def _rewrite(path: Path, change) -> None:
    data = path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(change(data))
    path.chmod(0o444)


def test_build_key_command_prints_the_key_and_its_parts(tiny_dense, capsys):
    from qwen3vl_trt.cli import main

    assert main(["build-key", "--model", str(tiny_dense), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["key"] == _key(tiny_dense).key and printed["parts"]["gpu"] == "none"
    assert main(["build-key", "--model", str(tiny_dense), "--checkpoint-id", "rev1"]) == 0
    out = capsys.readouterr().out
    assert "id:rev1" in out and "hashed" not in out and printed["key"] not in out


def test_cache_refuses_a_directory_that_is_not_one(tmp_path):
    (tmp_path / "data.txt").write_text("mine")
    from qwen3vl_trt.errors import BuildCacheError

    with pytest.raises(BuildCacheError, match="not a qwen3vl-trt build cache"):
        BuildCache(tmp_path).open()


def _fake_build(staging: Path) -> tuple[StageRecord, ...]:
    (staging / BuildLayout.VISION).mkdir()
    (staging / BuildLayout.VISION / "model.onnx").write_bytes(b"onnx" * 100)
    return (StageRecord(VISION_STAGE, "done", BuildLayout.VISION, 0.1),)


def test_a_failed_build_releases_its_lease_and_leaves_nothing(tmp_path):
    store = BuildCache(tmp_path / "cache", log=_quiet)
    key = BuildKey("f" * 32, {"checkpoint": "id:x"})

    def fails(staging: Path) -> tuple[StageRecord, ...]:
        _fake_build(staging)
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        store.obtain(key, fails, tmp_path / "into", tmp_path / "out")
    assert not any(store.entries.iterdir()) and not any(store.building.iterdir())
    assert not any((store.leases / key.key).iterdir())  # the next builder need not wait for a lapse
    into = tmp_path / "into"
    into.mkdir()
    assert store.obtain(key, _fake_build, into, tmp_path / "out").record.source == "built"


def test_an_entry_moved_away_between_check_and_pull_is_looked_for_again(tmp_path, monkeypatch):
    """Another replica refuses (or prune removes) the entry right after this one checked it: no dangling links
    and no hit reported; the entry is built again."""
    store = BuildCache(tmp_path / "cache", log=_quiet)
    key = BuildKey("e" * 32, {"checkpoint": "id:x"})
    first = tmp_path / "first"
    first.mkdir()
    store.obtain(key, _fake_build, first, first)
    checked = BuildCache.check

    def check_then_lose_it(self, key, verify):
        manifest = checked(self, key, verify)
        if manifest is not None and not getattr(self, "moved", False):
            self.moved = True
            self._refuse(key.key)  # as a concurrent refusal or prune would
        return manifest

    monkeypatch.setattr(BuildCache, "check", check_then_lose_it)
    second = tmp_path / "second"
    second.mkdir()
    pulled = store.obtain(key, _fake_build, second, second)
    assert pulled.record.source == "built"
    assert (second / BuildLayout.VISION / "model.onnx").read_bytes() == b"onnx" * 100
    assert not (first / BuildLayout.VISION).exists() or (first / BuildLayout.VISION / "model.onnx").exists()


def test_bad_cache_paths_are_refused_with_a_clear_error(tiny_dense, tmp_path, capsys):
    from qwen3vl_trt.cli import main

    a_file = tmp_path / "file"
    a_file.write_text("")
    assert main(["build", "--model", str(tiny_dense), "--output", str(tmp_path / "o"), "--cache", str(a_file)]) == 2
    assert "cannot be used" in capsys.readouterr().err
    inside = ["build", "--model", str(tiny_dense), "--output", str(tmp_path / "o"), "--cache", str(tmp_path / "o/c")]
    assert main(inside) == 2
    assert "overlaps" in capsys.readouterr().err and not (tmp_path / "o").exists()  # refused before any work
    assert main(["cache", "list", "--cache", str(tmp_path / "typo")]) == 2
    assert "not a qwen3vl-trt build cache" in capsys.readouterr().err and not (tmp_path / "typo").exists()
