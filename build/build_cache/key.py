"""The build key: what makes a build's artifacts (vision ONNX and engine, LLM checkpoint and engine, their sidecars)
differ, and nothing else. Its parts: the checkpoint (digest or a revision the user vouches for), the GPU model and
compute capability (TensorRT engines and their timing caches are specific to both), the TensorRT, TensorRT-LLM,
CUDA and qwen3vl-trt versions, and the options that change artifacts. Not the repository settings, the target or
any path: those change only the Triton repository, which each replica writes for itself. The key is a hash of the
parts, as NIM keys its profiles by GPU, precision, TP/PP and backend versions."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from .. import __version__
from ..limits import EngineLimits

NO_GPU = "none"


@dataclass(frozen=True)
class Platform:
    """The machine's part of the key. `none` where there is no GPU or the package is absent (a CPU build: its
    artifacts have no engines)."""

    gpu: str
    compute_capability: str
    tensorrt: str
    tensorrt_llm: str
    cuda: str
    qwen3vl_trt: str = __version__

    @classmethod
    def detect(cls) -> Platform:
        """This machine's: the first visible GPU (the engines are built on it), and the versions that build them."""
        import torch

        from ..llm.engine_model import TRTLLM_IMPORT_ERROR
        from ..vision.engine import tensorrt_problem

        gpu, capability = NO_GPU, NO_GPU
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
            capability = "{}.{}".format(*torch.cuda.get_device_capability(0))
        tensorrt = NO_GPU
        if tensorrt_problem() is None:
            import tensorrt as trt

            tensorrt = trt.__version__
        trtllm = NO_GPU
        if TRTLLM_IMPORT_ERROR is None:
            import tensorrt_llm

            trtllm = tensorrt_llm.__version__
        return cls(gpu, capability, tensorrt, trtllm, torch.version.cuda or NO_GPU)


@dataclass(frozen=True)
class ArtifactOptions:
    """The build options that change artifacts, resolved (the LLM dtype and --llm-quant as chosen, the GPU arch the
    LLM options were checked for); calibration: the calibration file's sha256, or "builtin"."""

    vision_dtype: str
    vision_engine_dtype: str
    llm_dtype: str
    llm_quant: str
    kv_cache_dtype: str
    gpu_arch: str
    tp: int
    pp: int
    calibration: str
    limits: EngineLimits


@dataclass(frozen=True)
class BuildKey:
    """A key (hex) and the parts it was made from, flat strings (the manifest, metrics and `build-key` show them)."""

    key: str
    parts: Mapping[str, str]

    @classmethod
    def of(cls, checkpoint: str, platform: Platform, options: ArtifactOptions) -> BuildKey:
        parts = {"checkpoint": checkpoint, **{k: str(v) for k, v in asdict(platform).items()}}
        for name, value in asdict(options).items():
            if name == "limits":
                parts.update({f"limits.{k}": str(v) for k, v in value.items()})
            else:
                parts[name] = str(value)
        canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"))
        return cls(hashlib.sha256(f"qwen3vl-trt build key 1\n{canonical}".encode()).hexdigest()[:32], parts)

    def describe(self) -> str:
        width = max(map(len, self.parts))
        return "\n".join([f"build key {self.key}", *(f"  {k:<{width}}  {v}" for k, v in self.parts.items())])
