"""The deployment's chain in one process on a CPU: preprocessing, the vision encoder (ONNX Runtime),
the reference LLM on the converted checkpoint, and detokenization. `qwen3vl-trt generate` runs it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..contracts import BuildLayout
from ..preprocess import Preprocessor
from ..vision.runner import VisionEncoder
from .reference_llm import LLMRequest, ReferenceLLM
from .sampling import SamplingParams


def engine_request(
    pre: Preprocessor,
    encoder: VisionEncoder,
    messages: list[dict[str, Any]],
    max_position_embeddings: int,
    sampling: SamplingParams | None = None,
) -> LLMRequest:
    """Preprocesses chat messages, encodes their images and returns the LLM engine's inputs."""
    request = pre(messages)
    embeds: tuple[Any, Any] = (None, None)
    if request.num_visual_tokens:
        embeds = encoder.run({"pixel_values": request.pixel_values.cpu().numpy(), **request.vision_inputs})
    return LLMRequest.from_preprocessed(request, max_position_embeddings, *embeds, sampling=sampling)


def generation_end_ids(model_dir: Path) -> tuple[int, ...]:
    """The eos ids of generation_config.json (none if the file is absent)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id", [])
    return tuple(eos if isinstance(eos, list) else [eos])


class LocalPipeline:
    def __init__(self, model_dir: str | os.PathLike[str], build_dir: str | os.PathLike[str]):
        from tokenizers import Tokenizer

        self.model_dir, build = Path(model_dir), BuildLayout(Path(build_dir))
        self.pre = Preprocessor.from_pretrained(self.model_dir)
        self.encoder = VisionEncoder(build.vision)
        self.llm = ReferenceLLM.from_checkpoint(build.llm_checkpoint)
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.end_ids = generation_end_ids(self.model_dir)

    def generate(
        self,
        messages: list[dict[str, Any]],
        sampling: SamplingParams | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> str:
        """The reply to chat messages; on_text receives it piece by piece as tokens arrive."""
        sampling = sampling or SamplingParams(end_ids=self.end_ids)
        request = engine_request(self.pre, self.encoder, messages, self.llm.config.max_position_embeddings, sampling)
        tokens: list[int] = []
        shown = ""

        def stream(_index: int, token: int) -> None:
            nonlocal shown
            if token in sampling.end_ids:
                return
            tokens.append(token)
            text = self.tokenizer.decode(tokens)
            if on_text is not None and not text.endswith("\ufffd"):  # wait for whole UTF-8 characters
                on_text(text[len(shown) :])
                shown = text

        self.llm.generate([request], on_token=stream)
        return self.tokenizer.decode(tokens)
