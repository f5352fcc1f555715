"""Triton model configurations as `ModelConfig` protobuf messages (the schema tritonclient ships),
written in protobuf text format and checked by parsing them back."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from ...errors import Qwen3VLTrtError
from ..tensors import Tensor

CONFIG_FILE = "config.pbtxt"
# A model's alternative configurations, by name: configs/<name>.pbtxt, which tritonserver reads instead of config.pbtxt
# under --model-config-name=<name> (server docs/user_guide/model_configuration.md, "Custom Model Configuration").
CONFIGS_DIR = "configs"
# The configs of a replica that leaves its images and videos to a vision pool (serve --role language).
LANGUAGE_CONFIG = "language"

# Triton data types of the checkpoint dtypes the LLM runs in ("MODEL" tensors take one of these).
MODEL_DATA_TYPES = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16"}


def data_type(tensor: Tensor, model_data_type: str = "FP32") -> int:
    name = model_data_type if tensor.data_type == "MODEL" else tensor.data_type
    return mc.DataType.Value(f"TYPE_{name}")


def model_input(
    tensor: Tensor, model_data_type: str = "FP32", optional: bool | None = None, ragged: bool = False
) -> mc.ModelInput:
    spec = mc.ModelInput(name=tensor.name, data_type=data_type(tensor, model_data_type), dims=list(tensor.dims))
    if tensor.optional if optional is None else optional:
        spec.optional = True
    if ragged:
        spec.allow_ragged_batch = True
    return spec


def model_output(tensor: Tensor, model_data_type: str = "FP32") -> mc.ModelOutput:
    return mc.ModelOutput(name=tensor.name, data_type=data_type(tensor, model_data_type), dims=list(tensor.dims))


def parameters(config: mc.ModelConfig, values: Mapping[str, object]) -> None:
    """Sets string parameters (Triton passes every parameter as a string)."""
    for key, value in values.items():
        config.parameters[key].string_value = str(value).lower() if isinstance(value, bool) else str(value)


def instance_group(kind: str, count: int = 1, gpus: Iterable[int] = ()) -> mc.ModelInstanceGroup:
    group = mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.Kind.Value(f"KIND_{kind.upper()}"), count=count)
    group.gpus.extend(gpus)
    return group


def queue_policy(config: mc.ModelConfig, max_queue_size: int, timeout_us: int = 0) -> None:
    """Bounds a dynamic batcher's queue: a request beyond `max_queue_size` waiting, or waiting longer than
    `timeout_us` (0: no limit), is refused (UNAVAILABLE, "Exceeds maximum queue size" / "Request timeout
    expired") instead of waiting without bound (core r24.10 src/scheduler_utils.cc, dynamic_batch_scheduler.cc)."""
    policy = config.dynamic_batching.default_queue_policy
    policy.max_queue_size = max_queue_size
    policy.timeout_action = mc.ModelQueuePolicy.REJECT
    policy.default_timeout_microseconds = timeout_us


def to_json(config: mc.ModelConfig) -> str:
    """The configuration as the repository API's load takes it (tritonserver's model config JSON)."""
    return json_format.MessageToJson(config, preserving_proto_field_name=True)


def to_text(config: mc.ModelConfig) -> str:
    text = text_format.MessageToString(config)
    if parse(text) != config:  # text format round-trips exactly; anything else is a bug here
        raise Qwen3VLTrtError(f"the configuration of {config.name} does not survive its text format")
    return text


def parse(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def config_path(model_dir: Path, name: str | None = None) -> Path:
    """The file tritonserver reads a model's configuration from: configs/<name>.pbtxt under --model-config-name=<name>
    where the model has one, else config.pbtxt."""
    custom = Path(model_dir) / CONFIGS_DIR / f"{name}.pbtxt"
    return custom if name is not None and custom.is_file() else Path(model_dir) / CONFIG_FILE


def write(model_dir: Path, config: mc.ModelConfig, name: str | None = None) -> Path:
    """config.pbtxt, or with a name the alternative configs/<name>.pbtxt."""
    path = Path(model_dir) / CONFIG_FILE if name is None else Path(model_dir) / CONFIGS_DIR / f"{name}.pbtxt"
    path.parent.mkdir(exist_ok=True)
    path.write_text(to_text(config))
    return path


def read(model_dir: Path, name: str | None = None) -> mc.ModelConfig:
    """The configuration tritonserver loads for the model (config_path)."""
    path = config_path(model_dir, name)
    try:
        return parse(path.read_text())
    except (OSError, text_format.ParseError) as e:
        raise Qwen3VLTrtError(f"cannot read the Triton model configuration {path}: {e}") from None
