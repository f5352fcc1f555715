"""The vision stage: the tower's model code, host-side metadata, ONNX export and its runner."""

from .onnx_runner import OnnxVisionRunner
from .sidecar import VisionSidecar

__all__ = ["OnnxVisionRunner", "VisionSidecar"]
