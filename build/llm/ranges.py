"""Activation ranges a calibration pass measured (qwen3vl_trt.pipeline.calibration), by decoder layer and observed input
(runtime.reference_llm.Observer's names), which the converter turns into static scales."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Ranges:
    amax: list[dict[str, float]] = field(default_factory=list)  # per layer: name -> absolute maximum

    def scale(self, layer: int, name: str, levels: float) -> float:
        """amax / levels: the scale that maps the range onto `levels` (1 where nothing was observed)."""
        value = self.amax[layer].get(name, 0.0)
        return value / levels if value > 0 else 1.0
