"""The deployment's chain in one process on a CPU: preprocessing, the vision encoder (ONNX Runtime),
the reference LLM on the converted checkpoint, and detokenization. `qwen3vl-trt generate` runs it."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common.contracts import BuildLayout
from ..common.manifest import LLM_CHECKPOINT_STAGE, VISION_STAGE, BuildManifest
from ..decoding.detokenize import StreamingDetokenizer
from ..hf.checkpoint import generation_end_ids
from ..preprocess import Preprocessor
from ..vision.onnx_runner import OnnxVisionRunner, VisionSidecar
from .reference_llm import LLMRequest, ReferenceLLM
from .sampling import SamplingParams


def engine_request(
    pre: Preprocessor,
    encoder: OnnxVisionRunner,
    messages: list[dict[str, Any]],
    sampling: SamplingParams | None = None,
) -> LLMRequest:
    """Preprocesses chat messages, encodes their images and videos and returns the reference runtime's request
    (the engine's inputs, with only the prompt's rows of the mrope table)."""
    request = pre(messages)
    embeds: tuple[Any, Any] = (None, None)
    if request.num_visual_tokens:
        embeds = encoder.run({"pixel_values": request.pixel_values.cpu().numpy(), **request.vision_inputs})
    return LLMRequest.from_preprocessed(request, *embeds, sampling=sampling)


@dataclass(frozen=True)
class Reply:
    text: str
    token_ids: list[int]  # generated tokens, end id excluded: `text` decodes from exactly these


class LocalPipeline:
    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        build_dir: str | os.PathLike[str],
        intra_op_threads: int | None = None,
    ):
        """intra_op_threads: the vision encoder's ONNX Runtime threads (None: one per physical core);
        torch's are the process's (torch.set_num_threads)."""
        import hashlib

        from tokenizers import Tokenizer

        from ..hf.checkpoint import read_config

        self.model_dir, build = Path(model_dir), BuildLayout(Path(build_dir))
        # Cheap checks first: a build of another checkpoint would answer with the wrong weights.
        BuildManifest.read(build.root, required_stages=(VISION_STAGE, LLM_CHECKPOINT_STAGE))
        config_sha256 = hashlib.sha256(read_config(self.model_dir)[0]).hexdigest()
        rebuild = f"qwen3vl-trt build --model {self.model_dir} --output {build.root} --force"
        VisionSidecar.load(build.vision).check_source(self.model_dir, config_sha256, rebuild)
        self.pre = Preprocessor.from_pretrained(self.model_dir)
        self.encoder = OnnxVisionRunner(build.vision, intra_op_threads)
        self.llm = ReferenceLLM.from_checkpoint(build.llm_checkpoint)
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.end_ids = generation_end_ids(self.model_dir)

    def generate(
        self,
        messages: list[dict[str, Any]],
        sampling: SamplingParams | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Reply:
        """The reply to chat messages; on_text receives its text piece by piece as tokens arrive."""
        sampling = sampling or SamplingParams(end_ids=self.end_ids)
        request = engine_request(self.pre, self.encoder, messages, sampling)
        detokenizer = StreamingDetokenizer(self.tokenizer)
        pieces: list[str] = []
        token_ids: list[int] = []

        def show(piece: str) -> None:
            if piece:
                pieces.append(piece)
                if on_text is not None:
                    on_text(piece)

        def stream(_index: int, token: int) -> None:
            if token not in sampling.end_ids:
                token_ids.append(token)
                show(detokenizer.push(token))

        self.llm.generate([request], on_token=stream)
        show(detokenizer.finish())
        return Reply("".join(pieces), token_ids)
