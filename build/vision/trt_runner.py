"""Runs a vision TensorRT engine (GPU hosts): what the GPU target's vision_encoder uses.

One VisionEngine per Triton model instance: one execution context, whose input shapes are set per
batch. Inputs are the per-patch contract (contracts.VISION_INPUTS) as torch tensors, host or device
(a Triton python backend tensor becomes one through DLPack: torch.utils.dlpack.from_dlpack); the
requests of a batch are concatenated, never padded, and the outputs are split back per request.

The engine is enqueued on a stream of its own: TensorRT 10.14's execute_async_v3 on the default
stream (what the python backend's models run on) adds device-wide synchronizations. The caller's
stream (default: the current one) orders it: the engine waits for the caller's work on its inputs,
and the caller's stream waits for the engine before it touches the outputs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from ..common.contracts import (
    CU_SEQLENS,
    DEEPSTACK_EMBEDS,
    IMAGE_EMBEDS,
    MAX_SEQLEN_CARRIER,
    SEGMENT_START,
    VISION_GRAPH_INPUTS,
    VISION_INPUTS,
)
from ..errors import CheckpointError, InputError
from .engine import require_gpu_stack
from .metadata import attention_segments
from .sidecar import VisionEngineSidecar, VisionSidecar

_TORCH_DTYPES = {"float32": torch.float32, "int32": torch.int32}


class VisionEngine:
    """One execution context over a build-vision-engine output directory."""

    def __init__(self, engine_dir: str | os.PathLike[str], device: int = 0):
        require_gpu_stack("run the vision engine")
        import tensorrt as trt

        self.engine_dir = Path(engine_dir)
        self.device = torch.device("cuda", device)
        self.export = VisionSidecar.load(self.engine_dir)
        self.sidecar = VisionEngineSidecar.load(self.engine_dir)
        self.sidecar.check_runtime(self.export, trt.__version__, torch.cuda.get_device_capability(self.device))
        self.variant = self.export.graph_variant
        self.merge_unit = self.export.spatial_merge_size**2
        plan_path = self.engine_dir / self.sidecar.engine_file
        plan = plan_path.read_bytes()
        self._logger = trt.Logger(trt.Logger.WARNING)
        with torch.cuda.device(self.device):
            self._runtime = trt.Runtime(self._logger)
            engine = self._runtime.deserialize_cuda_engine(plan)
            if engine is None:
                raise CheckpointError(
                    f"TensorRT cannot load {plan_path} (its log is above); "
                    "rebuild it with `qwen3vl-trt build-vision-engine`"
                )
            self.engine = engine
            self.context = engine.create_execution_context()
            self._stream = torch.cuda.Stream(self.device)
            # The carrier's data is never read: one zero buffer, sliced to each batch's longest segment.
            self._carrier = torch.zeros(self.sidecar.max_patches, dtype=torch.int32, device=self.device)
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        expected = [spec.name for spec in VISION_GRAPH_INPUTS[self.variant]]
        if inputs != expected:
            raise CheckpointError(f"{self.engine_dir}: the engine's inputs {inputs} are not the contract's {expected}")
        self._input_dtypes = {str(t["name"]): _TORCH_DTYPES[str(t["dtype"])] for t in self.export.contract()["inputs"]}
        output_dtypes = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16}
        self._output_dtypes = {
            name: output_dtypes[engine.get_tensor_dtype(name)] for name in (IMAGE_EMBEDS.name, DEEPSTACK_EMBEDS.name)
        }

    def run(
        self, per_patch: Mapping[str, torch.Tensor | np.ndarray], stream: torch.cuda.Stream | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(image_embeds [M, D], deepstack_embeds [K, M, D]) on the device for one batch's per-patch inputs.

        stream (default the device's current one) is the caller's: device inputs must be ready on it, and the
        outputs are ready on it."""
        caller = stream or torch.cuda.current_stream(self.device)
        segment_start = per_patch[SEGMENT_START.name]
        host_flags = segment_start.cpu().numpy() if isinstance(segment_start, torch.Tensor) else segment_start
        segments = attention_segments(np.asarray(host_flags))
        patches = int(host_flags.shape[0])
        num_segments = int(segments[CU_SEQLENS.name].shape[0]) - 1
        if patches > self.sidecar.max_patches or num_segments > self.sidecar.max_images:
            raise InputError(
                f"a vision engine run takes at most {self.sidecar.max_patches} patches in "
                f"{self.sidecar.max_images} segments, got {patches} in {num_segments}: split the batch, or build "
                "the engine with larger --max-patches / --max-images"
            )
        self._stream.wait_stream(caller)
        with torch.cuda.stream(self._stream):
            # The graph's own inputs: the plugin variant takes cu_seqlens and the carrier instead of segment_start.
            sources = {**per_patch, CU_SEQLENS.name: segments[CU_SEQLENS.name]}
            feeds = {
                spec.name: (
                    self._carrier[: segments[MAX_SEQLEN_CARRIER.name].shape[0]]
                    if spec.name == MAX_SEQLEN_CARRIER.name
                    else self._device_tensor(spec.name, sources[spec.name])
                )
                for spec in VISION_GRAPH_INPUTS[self.variant]
            }
            # An input the caller made is read on the engine's stream from here on, also if a step below raises:
            # the caching allocator must not hand its memory out again before the engine's stream is past it.
            for tensor in feeds.values():
                tensor.record_stream(self._stream)
            for name, tensor in feeds.items():
                # Both return False (and log why) where TensorRT refuses: a shape outside the profile, say.
                if not self.context.set_input_shape(name, tuple(tensor.shape)):
                    shape = tuple(tensor.shape)
                    raise InputError(f"the vision engine refuses {name} of shape {shape} (its log is above)")
                self._bind(name, tensor)
            outputs = {}
            for name, dtype in self._output_dtypes.items():
                dims = self.context.get_tensor_shape(name)
                shape = [dims[i] for i in range(len(dims))]
                outputs[name] = torch.empty(shape, dtype=dtype, device=self.device)
                self._bind(name, outputs[name])
            if not self.context.execute_async_v3(self._stream.cuda_stream):
                raise RuntimeError("TensorRT could not enqueue the vision engine (its log is above)")
        # The outputs, made on the engine's stream, are read on the caller's.
        caller.wait_stream(self._stream)
        for tensor in outputs.values():
            tensor.record_stream(caller)
        return outputs[IMAGE_EMBEDS.name], outputs[DEEPSTACK_EMBEDS.name]

    def _bind(self, name: str, tensor: torch.Tensor) -> None:
        if not self.context.set_tensor_address(name, tensor.data_ptr()):
            raise RuntimeError(f"TensorRT refused the address of the vision engine's {name} (its log is above)")

    def encode_requests(
        self, requests: Sequence[Mapping[str, torch.Tensor | np.ndarray]], stream: torch.cuda.Stream | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One run over the requests' concatenated patches; (image_embeds, deepstack_embeds) per request, ready on
        `stream` (default the current one), where the batch is assembled too."""
        caller = stream or torch.cuda.current_stream(self.device)
        with torch.cuda.stream(caller):
            batch = {
                spec.name: torch.cat([torch.as_tensor(r[spec.name]).to(self.device) for r in requests])
                for spec in VISION_INPUTS
            }
        image_embeds, deepstack_embeds = self.run(batch, caller)
        tokens = [int(r[SEGMENT_START.name].shape[0]) // self.merge_unit for r in requests]
        return list(zip(image_embeds.split(tokens), deepstack_embeds.split(tokens, dim=1), strict=True))

    def _device_tensor(self, name: str, value: torch.Tensor | np.ndarray) -> torch.Tensor:
        tensor = torch.as_tensor(value).to(self.device, self._input_dtypes[name], non_blocking=True)
        return tensor.contiguous()
