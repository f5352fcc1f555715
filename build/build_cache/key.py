"""The build key: what makes a build's artifacts (vision ONNX and engine, LLM checkpoint and engine, their sidecars)
differ, and nothing else. Its parts: the checkpoint (digest or a revision the user vouches for), the GPU model and
compute capability (TensorRT engines and their timing caches are specific to both), the TensorRT, TensorRT-LLM,
CUDA and qwen3vl-trt versions, and the options that change artifacts. Not the repository settings, the target or
any path: those change only the Triton repository, which each replica writes for itself. The key is a hash of the
parts, as NIM keys its profiles by GPU, precision, TP/PP and backend versions."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import __version__
from ..errors import BuildCacheError

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
    gpu_sms: str = NO_GPU
    torch: str = NO_GPU
    transformers: str = NO_GPU
    qwen3vl_trt: str = __version__
    code: str = NO_GPU

    @classmethod
    def detect(cls, ranks: int = 1) -> Platform:
        """This machine's: the GPU the engines are built on, and the versions and code that build them. TensorRT-LLM
        builds rank r on GPU r (its parallel_build), so the first `ranks` GPUs must be one model."""
        import torch
        import transformers

        from ..llm.engine_model import TRTLLM_IMPORT_ERROR
        from ..vision.engine import tensorrt_problem

        gpu, capability, sms = NO_GPU, NO_GPU, NO_GPU
        if torch.cuda.is_available():
            count = min(ranks, torch.cuda.device_count())
            models = {(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)) for i in range(count)}
            if len(models) > 1:
                names = ", ".join(sorted(name for name, _ in models))
                raise BuildCacheError(f"the {ranks} GPUs that build the engine's ranks are of several models ({names})")
            gpu = torch.cuda.get_device_name(0)
            capability = "{}.{}".format(*torch.cuda.get_device_capability(0))
            sms = str(torch.cuda.get_device_properties(0).multi_processor_count)
        tensorrt = NO_GPU
        if tensorrt_problem() is None:
            import tensorrt as trt

            tensorrt = trt.__version__
        trtllm = NO_GPU
        if TRTLLM_IMPORT_ERROR is None:
            import tensorrt_llm

            trtllm = tensorrt_llm.__version__
        return cls(
            gpu,
            capability,
            tensorrt,
            trtllm,
            torch.version.cuda or NO_GPU,
            sms,
            torch.__version__,
            transformers.__version__,
            code=code_digest(),
        )


# What makes no artifact: the repository and the processes that serve it (written by each build, not cached), the
# reference runtime, the command line, the acceptance run and test helpers (qa) and the cache itself (its layout has
# a schema of its own).
_NOT_ARTIFACT_CODE = {"serving", "triton_models", "runtime", "qa", "build_cache", "cli.py"}


@functools.cache
def code_digest() -> str:
    """sha256 of the installed sources that make artifacts (the exporters, converters, engine builders and their
    kernels): a changed one makes other artifacts even where the version number stayed."""
    import importlib.util

    digest = hashlib.sha256()
    for package in ("qwen3vl_trt", "qwen3vl_trt.plugins"):
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations is not None
        for location in spec.submodule_search_locations:
            root = Path(location)
            files = (p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
            for path in sorted(p for p in files if p.relative_to(root).parts[0] not in _NOT_ARTIFACT_CODE):
                digest.update(f"{package}/{path.relative_to(root)}\n".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class BuildKey:
    """A key (hex) and the parts it was made from, flat strings (the manifest, metrics and `build-key` show them)."""

    key: str
    parts: Mapping[str, str]

    @classmethod
    def of(cls, checkpoint: str, platform: Platform, options: Mapping[str, str]) -> BuildKey:
        """options: the build options' parts (pipeline.BuildOptions.key_parts)."""
        parts = {"checkpoint": checkpoint, **{k: str(v) for k, v in asdict(platform).items()}, **options}
        canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"))
        return cls(hashlib.sha256(f"qwen3vl-trt build key 1\n{canonical}".encode()).hexdigest()[:32], parts)

    def describe(self) -> str:
        width = max(map(len, self.parts))
        return "\n".join([f"build key {self.key}", *(f"  {k:<{width}}  {v}" for k, v in self.parts.items())])
