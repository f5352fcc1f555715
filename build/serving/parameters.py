"""Each python model's config.pbtxt parameters, declared once: the repository writer writes them (`as_strings`), the
stage reads them in its stub (`from_stub_config`), and `serve` and the gateway read or override them in a
ModelConfig (`from_model_config`, `apply`). Triton passes every parameter as a string (python_backend hands a stub
its config as JSON: `{"parameters": {key: {"string_value": ...}}}`); each field's type says how it is written and
parsed. Keys are the field names. The tensorrtllm backend's own `llm` parameters are upstream's
(repository/trtllm_config.py) and not declared here.

The python models find the build and the checkpoint by these absolute paths: after moving either, write the
repository again."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ..common.limits import EngineLimits
from ..errors import LimitsError, Qwen3VLTrtError
from . import interface

P = TypeVar("P", bound="Parameters")

# The visual cache setting (the preprocessing parameter `visual_cache`, `--visual-cache`): off, an LRU in the
# preprocessing process, or a Redis server shared by replicas.
CACHE_OFF = "off"
CACHE_MEMORY = "memory"
CACHE_TTL_S = 24 * 3600  # how long a Redis entry lives by default


def is_redis_url(value: str) -> bool:
    return value.startswith(("redis://", "rediss://", "unix://"))


def check_cache_setting(value: str) -> str:
    """The visual cache setting as given (off, memory or a Redis URL), or LimitsError saying what is accepted."""
    if value in (CACHE_OFF, CACHE_MEMORY) or is_redis_url(value):
        return value
    raise LimitsError(
        f"the visual cache must be {CACHE_OFF!r}, {CACHE_MEMORY!r} or a Redis URL (redis://HOST:PORT/DB), got {value!r}"
    )


class ParameterError(Qwen3VLTrtError):
    """A model's parameters are missing or do not parse: the repository was not written by this version."""


def _write(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, EngineLimits):
        return json.dumps(asdict(value))
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _parse(kind: Any, text: str) -> object:
    optional = typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in typing.get_args(kind)
    if optional:
        if text == "":
            return None
        (kind,) = (k for k in typing.get_args(kind) if k is not type(None))
    if kind is EngineLimits:
        return EngineLimits(**json.loads(text))
    if kind is int:
        return int(text)
    if kind is Path:
        return Path(text)
    if kind is str:
        return text
    raise TypeError(f"no parameter codec for {kind!r}")


@dataclass(frozen=True)
class Parameters:
    """One model's parameters; subclasses declare the fields."""

    model: ClassVar[str]  # the model these parameters configure (serving.interface's names)

    def as_strings(self) -> dict[str, str]:
        return {f.name: _write(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_strings(cls: type[P], values: Mapping[str, str]) -> P:
        hints = typing.get_type_hints(cls)
        missing = [f.name for f in fields(cls) if f.name not in values]
        if missing:
            raise ParameterError(f"the {cls.model} model's configuration lacks the parameter(s) {', '.join(missing)}")
        try:
            return cls(**{f.name: _parse(hints[f.name], values[f.name]) for f in fields(cls)})
        except (ValueError, TypeError, LimitsError) as e:
            raise ParameterError(f"the {cls.model} model's parameters do not parse: {e}") from None

    @classmethod
    def from_stub_config(cls: type[P], config: Mapping[str, Any]) -> P:
        """From the model configuration JSON that python_backend passes `initialize` (args["model_config"]); an empty
        string may be absent there, as proto3's JSON mapping allows."""
        return cls.from_strings({k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()})

    @classmethod
    def from_model_config(cls: type[P], config: Any) -> P:
        """From a ModelConfig protobuf (tritonclient.grpc.model_config_pb2), as a config.pbtxt or a server holds it."""
        return cls.from_strings({k: v.string_value for k, v in config.parameters.items()})

    def apply(self, config: Any) -> None:
        """Writes these parameters into a ModelConfig protobuf (others it has are kept)."""
        for key, value in self.as_strings().items():
            config.parameters[key].string_value = value


# The layout of the model repositories this version writes and serves (model.py imports, parameters, tensors).
# Bump it with a change that makes repositories written before it unservable: `serve` refuses any other.
REPOSITORY_SCHEMA = 7
# A replica whose vision pool does not answer: encodes here (local), or fails the request's images (fail).
VISION_FALLBACKS = ("local", "fail")


@dataclass(frozen=True)
class EnsembleParameters(Parameters):
    """The ensemble's: which repository layout wrote it (Triton ignores an ensemble's parameters)."""

    model: ClassVar[str] = interface.ENSEMBLE

    repository_schema: int = REPOSITORY_SCHEMA


@dataclass(frozen=True)
class ModelParameters(Parameters):
    """What every python model reads: the checkpoint (tokenizer, processor and generation configs) and the
    build's engine limits."""

    model_dir: Path
    limits: EngineLimits


@dataclass(frozen=True)
class VisionParameters(ModelParameters):
    """What preprocessing and vision_encoder both read: the vision ONNX export (sidecar, graph), the TensorRT vision
    engine where the GPU target runs it (None: the CPU target runs the ONNX), and the prompt table's dtype and width
    (the LLM's). vision_digest: what the vision tower's features are made from (its weights, config, graph contract
    and dtype: VisionSidecar.features_digest), which a replica and its vision pool must share."""

    vision_dir: Path
    vision_engine_dir: Path | None
    llm_dtype: str
    llm_hidden_size: int
    vision_digest: str


@dataclass(frozen=True)
class PreprocessingParameters(VisionParameters):
    """preprocess_device: where images are decoded and resized ("cuda": the instance's GPU, or "cpu").
    mrope_positions: the length of the mrope cos/sin table sent to the tensorrtllm backend (0: the CPU target's llm
    takes positions). visual_cache: CACHE_OFF, CACHE_MEMORY (within visual_cache_bytes) or a Redis URL (entries live
    visual_cache_ttl_s). cuda_memory_pool_bytes: on the GPU target, the CUDA memory pool `serve` gives Triton on the
    python models' GPU (repository/gpu_memory.py); None on the CPU target."""

    model: ClassVar[str] = interface.PREPROCESSING

    preprocess_device: str
    mrope_positions: int
    visual_cache: str
    visual_cache_bytes: int
    visual_cache_ttl_s: int
    cuda_memory_pool_bytes: int | None = None
    # Where the images and videos the visual cache does not hold are decoded and encoded: "" here, else a vision
    # pool's target (serve --vision-pool), and what happens when no member answers (VISION_FALLBACKS).
    vision_pool: str = ""
    vision_fallback: str = "local"
    repository_schema: int = REPOSITORY_SCHEMA  # what a replica checks of a vision pool member

    def __post_init__(self) -> None:
        check_cache_setting(self.visual_cache)
        if self.vision_fallback not in VISION_FALLBACKS:
            choices = ", ".join(VISION_FALLBACKS)
            raise LimitsError(f"vision_fallback must be one of {choices}, got {self.vision_fallback!r}")

    def pool_mismatch(self, pool: PreprocessingParameters) -> str | None:
        """What a vision pool member's preprocessing (`pool`) does not share with this one, for its rows to be this
        one's: its repository schema, vision tower, prompt table and limits; None when it shares them all."""
        for name in ("repository_schema", "vision_digest", "llm_dtype", "llm_hidden_size", "limits"):
            mine, theirs = getattr(self, name), getattr(pool, name)
            if mine != theirs:
                return f"its {name} is {theirs}, this replica's {mine}"
        return None


@dataclass(frozen=True)
class VisionEncoderParameters(VisionParameters):
    """attention_budget_bytes: the vision encoder's attention memory per run (stages/vision_batching.py)."""

    model: ClassVar[str] = interface.VISION_ENCODER

    attention_budget_bytes: int


@dataclass(frozen=True)
class LLMParameters(ModelParameters):
    """The CPU target's llm: checkpoint_dir is the TensorRT-LLM checkpoint the reference runtime loads."""

    model: ClassVar[str] = interface.LLM

    checkpoint_dir: Path


@dataclass(frozen=True)
class PostprocessingParameters(ModelParameters):
    model: ClassVar[str] = interface.POSTPROCESSING


# Every declaration, for the tests that check no key is written or read anywhere else.
DECLARATIONS: tuple[type[Parameters], ...] = (
    EnsembleParameters,
    PreprocessingParameters,
    VisionEncoderParameters,
    LLMParameters,
    PostprocessingParameters,
)
