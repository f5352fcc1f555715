"""The build manifest (manifest.json of a `qwen3vl-trt build` directory): what was built from which
checkpoint, with which limits and for which target, and what each stage did.

`BuildManifest` writes the file and reads it back; every reader of a build (write-repo, the local
runtime, acceptance) goes through it, so the stage names and the file's layout live here only. A manifest
of another schema (another version's layout) is refused with the command that rebuilds it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal, cast, get_args

from .. import __version__
from ..common.contracts import BuildLayout
from ..common.fsutil import read_json
from ..common.limits import EngineLimits
from ..errors import CheckpointError, LimitsError

Target = Literal["gpu", "cpu"]
StageStatus = Literal["done", "skipped"]

VISION_STAGE, LLM_CHECKPOINT_STAGE, LLM_ENGINE_STAGE = "vision-onnx", "llm-checkpoint", "llm-engine"
VISION_ENGINE_STAGE, TRITON_REPO_STAGE = "vision-engine", "triton-repo"
# In the order `qwen3vl-trt build` runs them.
STAGES = (VISION_STAGE, LLM_CHECKPOINT_STAGE, LLM_ENGINE_STAGE, VISION_ENGINE_STAGE, TRITON_REPO_STAGE)

_REBUILD = "rebuild it with `qwen3vl-trt build --force`"
# The layout of manifest.json this version writes and reads; bump it with any change its readers depend on.
MANIFEST_SCHEMA = 3
# How a build's artifacts (everything but its Triton repository) were obtained: built here without a cache,
# built here and published to the cache (a miss), or pulled from the cache (a hit, after waiting for another
# builder where one held the key's lease).
ArtifactSource = Literal["local", "built", "pulled"]
PullMode = Literal["link", "copy"]


@dataclass(frozen=True)
class StageRecord:
    """One stage's entry. A done stage names its output (relative to the build directory) and how long it
    took; a skipped one says why and the command that runs it on a GPU host. The last three fields belong
    to one stage each: vision-onnx's verification (max relative error against transformers, fp32 exports
    only), vision-engine's onnx (the plugin export it was built from), triton-repo's target."""

    stage: str
    status: StageStatus
    output: str | None = None
    seconds: float | None = None
    reason: str | None = None
    rerun_on_gpu_host: str | None = None
    verification: float | None = None
    onnx: str | None = None
    target: Target | None = None

    @classmethod
    def done(
        cls,
        stage: str,
        output: str,
        started: float,
        verification: float | None = None,
        onnx: str | None = None,
        target: Target | None = None,
    ) -> StageRecord:
        """A stage that ran from `started` (time.perf_counter) until now and wrote `output`."""
        seconds = round(time.perf_counter() - started, 1)
        return cls(stage, "done", output, seconds, verification=verification, onnx=onnx, target=target)

    @classmethod
    def skipped(cls, stage: str, reason: str, rerun_on_gpu_host: str) -> StageRecord:
        return cls(stage, "skipped", reason=reason, rerun_on_gpu_host=rerun_on_gpu_host)

    def as_json(self) -> dict[str, object]:
        """The entry as manifest.json holds it: the fields this stage has (vision-onnx always records
        its verification, null when the export was not verified)."""
        record = {k: v for k, v in asdict(self).items() if v is not None}
        if self.stage == VISION_STAGE and self.status == "done":
            record["verification"] = self.verification
        return record

    @classmethod
    def from_json(cls, entry: Mapping[str, Any], where: Path) -> StageRecord:
        """An entry of manifest.json, its fields checked (entries of later versions are ignored)."""
        names = [f.name for f in fields(cls)]
        problems = [
            f"'{name}' is {entry.get(name)!r}"
            for name in names
            if (entry.get(name) is not None or name in ("stage", "status")) and not _STAGE_FIELDS[name](entry.get(name))
        ]
        if problems:
            raise CheckpointError(f"{where}: stage entry {dict(entry)!r}: {'; '.join(problems)}; {_REBUILD}")
        return cls(**{name: entry[name] for name in names if entry.get(name) is not None})


def _instance_of(*kinds: type) -> Callable[[object], bool]:
    return lambda value: isinstance(value, kinds) and not isinstance(value, bool)


def _one_of(choices: tuple[str, ...]) -> Callable[[object], bool]:
    return lambda value: value in choices


# How each field of a stage entry is checked (StageRecord's fields).
_STAGE_FIELDS: dict[str, Callable[[object], bool]] = {
    "stage": _instance_of(str),
    "status": _one_of(get_args(StageStatus)),
    "output": _instance_of(str),
    "seconds": _instance_of(int, float),
    "reason": _instance_of(str),
    "rerun_on_gpu_host": _instance_of(str),
    "verification": _instance_of(int, float),
    "onnx": _instance_of(str),
    "target": _one_of(get_args(Target)),
}


@dataclass(frozen=True)
class CacheRecord:
    """What the build cache did for a build (`build --cache`): the key and its parts (build_cache.key), whether
    the artifacts were built here and published ("built") or pulled ("pulled"); seconds spent waiting for another
    builder of the key, pulling (checking and linking or copying), bytes pulled, the entry's path, how it was
    pulled, and why an entry found for the key was refused (corrupt or foreign) and rebuilt."""

    key: str
    parts: Mapping[str, str]
    source: ArtifactSource
    entry: str
    mode: PullMode
    wait_s: float = 0.0
    pull_s: float = 0.0
    pull_bytes: int = 0
    build_s: float | None = None
    refused: str | None = None

    def as_json(self) -> dict[str, object]:
        return {**asdict(self), "parts": dict(self.parts)}

    @classmethod
    def from_json(cls, raw: object, where: Path) -> CacheRecord:
        names = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or not {"key", "parts", "source", "entry", "mode"} <= raw.keys() <= names:
            raise CheckpointError(f"{where}: 'cache' is not a build-cache record, got {raw!r}; {_REBUILD}")
        parts = raw["parts"]
        valid = (
            isinstance(raw["key"], str)
            and isinstance(parts, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in parts.items())
            and raw["source"] in get_args(ArtifactSource)
            and raw["mode"] in get_args(PullMode)
        )
        if not valid:
            raise CheckpointError(f"{where}: 'cache' is not a build-cache record, got {raw!r}; {_REBUILD}")
        return cls(**raw)


@dataclass(frozen=True)
class BuildManifest:
    """manifest.json of a build: `model` is the checkpoint it was built from (absolute), `qwen3vl_trt` the
    version that built it."""

    model: Path
    limits: EngineLimits
    stages: tuple[StageRecord, ...]
    target: Target | None = None
    model_type: str | None = None
    size: str | None = None
    qwen3vl_trt: str | None = __version__
    cache: CacheRecord | None = None

    @property
    def source(self) -> ArtifactSource:
        """How the artifacts were obtained: "local" for a build without --cache."""
        return "local" if self.cache is None else self.cache.source

    def stage(self, name: str) -> StageRecord | None:
        return next((s for s in self.stages if s.stage == name), None)

    def done_stages(self) -> tuple[str, ...]:
        return tuple(s.stage for s in self.stages if s.status == "done")

    def as_json(self) -> dict[str, object]:
        return {
            "schema": MANIFEST_SCHEMA,
            "qwen3vl_trt": self.qwen3vl_trt,
            "model": str(self.model),
            "model_type": self.model_type,
            "size": self.size,
            "limits": asdict(self.limits),
            "target": self.target,
            "stages": [s.as_json() for s in self.stages],
            "cache": None if self.cache is None else self.cache.as_json(),
        }

    def write(self, build_dir: str | os.PathLike[str]) -> Path:
        path = BuildLayout(Path(build_dir)).manifest
        path.write_text(json.dumps(self.as_json(), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, build_dir: str | os.PathLike[str], required_stages: tuple[str, ...] = ()) -> BuildManifest:
        """A build directory's manifest; refuses a file that is not a build manifest, or a build whose
        required stages did not run."""
        path = BuildLayout(Path(build_dir)).manifest
        raw = read_json(
            path, f"{build_dir} has no {BuildLayout.MANIFEST}: is it a `qwen3vl-trt build` output directory?"
        )
        entries = raw.get("stages")
        if not isinstance(entries, list) or not all(isinstance(s, dict) for s in entries):
            raise CheckpointError(f"{path} is not a qwen3vl-trt build manifest (no list of stages); {_REBUILD}")
        stages = tuple(StageRecord.from_json(entry, path) for entry in entries)
        done = {s.stage for s in stages if s.status == "done"}
        missing = [stage for stage in required_stages if stage not in done]
        if missing:
            raise CheckpointError(f"{build_dir} lacks the stage(s) {', '.join(missing)} (see {path}); {_REBUILD}")
        if raw.get("schema") != MANIFEST_SCHEMA:
            raise CheckpointError(
                f"{path} was written by another version of qwen3vl-trt (manifest schema {raw.get('schema')}, this "
                f"version reads {MANIFEST_SCHEMA}); {_REBUILD}"
            )
        model = raw.get("model")
        if not isinstance(model, str):
            raise CheckpointError(f"{path}: 'model' must be the checkpoint's path, got {model!r}; {_REBUILD}")
        return cls(
            model=Path(model),
            limits=_limits(raw.get("limits"), path),
            stages=stages,
            target=cast("Target | None", _optional(raw, "target", get_args(Target), path)),
            model_type=_optional(raw, "model_type", None, path),
            size=_optional(raw, "size", None, path),
            qwen3vl_trt=_optional(raw, "qwen3vl_trt", None, path),
            cache=None if raw.get("cache") is None else CacheRecord.from_json(raw["cache"], path),
        )

    @classmethod
    def of_repository(cls, repo: str | os.PathLike[str]) -> BuildManifest | None:
        """The manifest of the build whose Triton repository `repo` is (its parent directory's), None for a
        repository that `write-repo` wrote elsewhere."""
        repo = Path(repo)
        if repo.name != BuildLayout.TRITON_REPO or not BuildLayout(repo.parent).manifest.is_file():
            return None
        return cls.read(repo.parent)


def _optional(raw: Mapping[str, Any], key: str, choices: tuple[str, ...] | None, path: Path) -> str | None:
    """A string entry that may be null, one of `choices` where given."""
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or (choices is not None and value not in choices):
        expected = f"one of {', '.join(choices)}" if choices else "a string"
        raise CheckpointError(f"{path}: '{key}' must be {expected}, got {value!r}; {_REBUILD}")
    return value


def _limits(raw: object, path: Path) -> EngineLimits:
    if not isinstance(raw, dict) or not raw.keys() <= {f.name for f in fields(EngineLimits)}:
        raise CheckpointError(f"{path}: 'limits' is not a set of engine limits, got {raw!r}; {_REBUILD}")
    try:
        return EngineLimits(**raw)
    except LimitsError as e:
        raise CheckpointError(f"{path}: {e}; {_REBUILD}") from None
