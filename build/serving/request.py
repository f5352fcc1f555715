"""The generation request, declared once: its fields, their types, defaults and bounds, the rules across them, and
its mapping to and from the ensemble's request tensors.

Every client builds a GenerationRequest and sends `to_inputs()` (the gRPC client from its keywords, the OpenAI
gateway from the body it planned); the preprocessing stage reads `from_inputs()` and maps the request onto the
llm's tensorrt_llm inputs (stages.preprocessing, the engine mapping). The checks run where the request is built, so
a request is refused where it enters first, with the same message on every path. A field marked `engine` passes on
to the llm under its own tensor's name, which the tensorrt_llm model takes: adding such a sampling option is one
field here (the deployment's configs, the clients and the stage follow); one the engine takes under another name or
shape also needs its line in the engine mapping.

The tensors follow the tensorrtllm_backend ensemble's request inputs, so its clients and genai-perf work unchanged,
plus `images`, `videos`, `messages`, `raw_prompt`, `tools` and the logit bias.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from ..common.limits import TOP_LOGPROBS_CAP
from ..decoding.guides import Guide
from ..errors import MessageError, PromptTooLongError, RequestError
from .tensors import NUMPY_DTYPES, Tensor, scalar_tensor

Check = Callable[[Any], bool]


@dataclass(frozen=True)
class Wire:
    """How a field travels: its tensor, its bound (`check`, and the words that state it), and whether the stage
    passes it on to the llm as it is (`engine`)."""

    tensor: Tensor
    check: Check | None = None
    bound: str = ""
    engine: bool = False
    json: bool = False  # a JSON value sent as one string


def _wire(
    name: str,
    data_type: str,
    default: Any,
    *,
    dims: tuple[int, ...] = (1,),
    required: bool = False,
    check: Check | None = None,
    bound: str = "",
    engine: bool = False,
    json_value: bool = False,
) -> Any:
    scalar = dims == (1,)
    tensor = scalar_tensor(name, data_type, not required) if scalar else Tensor(name, data_type, dims, optional=True)
    return field(default=default, metadata={"wire": Wire(tensor, check, bound, engine, json_value)})


# Triton request priorities. The python models' dynamic batchers have PRIORITY_LEVELS levels, level 1 their default,
# and serve a level's requests only while no higher level's wait (core r24.10 and r26.04 src/scheduler_utils.cc
# PriorityQueue); an ensemble passes its request's priority to each step (ensemble_scheduler.cc InitStep), and a
# model without levels takes any as its default. 0: the default (interactive requests); batch lines go lowest.
PRIORITY_LEVELS = 2
BATCH_PRIORITY = PRIORITY_LEVELS

# Tensors of the fields that travel as two (a logit bias: OpenAI's token id -> bias; a guide: type and text), which
# the tensorrt_llm backend takes as they are named here for the guide.
LOGIT_BIAS_IDS = Tensor("logit_bias_ids", "INT32", (-1,), optional=True)
LOGIT_BIAS_WEIGHTS = Tensor("logit_bias_weights", "FP32", (-1,), optional=True)
# Declared [1] without reshape by the tensorrt_llm model, unlike its other per-request values.
GUIDE_TYPE = Tensor("guided_decoding_guide_type", "STRING", (1,), optional=True)
GUIDE_TEXT = Tensor("guided_decoding_guide", "STRING", (1,), optional=True)


@dataclass(frozen=True)
class GenerationRequest:
    """One generation; a field given None takes its default. prompt: the text (a user turn after the messages, or the
    whole prompt with raw_prompt). prompt_ids: the whole prompt rendered and tokenized by the client instead
    (Preprocessor.prompt_ids: one placeholder per image, each video's frames with their times), with the images
    and videos in their placeholders' order. images, videos: encoded files, placed by the messages' media parts without
    data, else before the text. messages: OpenAI-style chat messages; tools: the function definitions the chat
    template renders. end_id, pad_id: None takes the checkpoint's. stop_words, bad_words: strings, tokenized by
    the stage. logit_bias: token id -> a bias added to its logit. guide: the grammar the answer must follow.
    priority: Triton's request priority (PRIORITY_LEVELS), which travels with the request, not as a tensor."""

    prompt: str = _wire("text_input", "STRING", "", required=True)
    max_tokens: int = _wire("max_tokens", "INT32", 0, required=True, check=lambda v: v >= 1, bound="at least 1")
    images: Sequence[bytes] = _wire("images", "STRING", (), dims=(-1,))
    videos: Sequence[bytes] = _wire("videos", "STRING", (), dims=(-1,))
    messages: list[dict[str, Any]] | None = _wire("messages", "STRING", None, json_value=True)
    raw_prompt: bool = _wire("raw_prompt", "BOOL", False)
    tools: list[dict[str, Any]] | None = _wire("tools", "STRING", None, json_value=True)
    prompt_ids: Sequence[int] = _wire("prompt_ids", "INT32", (), dims=(-1,))
    stream: bool = _wire("stream", "BOOL", False)
    # The answer holds the generated ids only (the tensorrtllm_backend ensemble's default, false, starts them with the
    # prompt's; a client that wants those sends false).
    exclude_input_in_output: bool = _wire("exclude_input_in_output", "BOOL", True)
    temperature: float = _wire("temperature", "FP32", 0.0, check=lambda v: v >= 0, bound=">= 0 (0 is greedy)")
    top_k: int = _wire("top_k", "INT32", 0, check=lambda v: v >= 0, bound=">= 0 (0: no top-k cut)")
    top_p: float = _wire("top_p", "FP32", 1.0, check=lambda v: 0 < v <= 1, bound="in (0, 1]")
    seed: int = _wire("seed", "UINT64", 0, check=lambda v: 0 <= v < 2**64, bound="in [0, 2**64)")
    end_id: int | None = _wire("end_id", "INT32", None, check=lambda v: v >= 0, bound=">= 0")
    pad_id: int | None = _wire("pad_id", "INT32", None, check=lambda v: v >= 0, bound=">= 0")
    min_tokens: int = _wire("min_tokens", "INT32", 0, check=lambda v: v >= 0, bound=">= 0")
    stop_words: Sequence[str] = _wire("stop_words", "STRING", (), dims=(-1,), check=all, bound="non-empty strings")
    bad_words: Sequence[str] = _wire("bad_words", "STRING", (), dims=(-1,), check=all, bound="non-empty strings")
    presence_penalty: float | None = _wire("presence_penalty", "FP32", None, check=math.isfinite, bound="finite",
                                           engine=True)  # fmt: skip
    frequency_penalty: float | None = _wire("frequency_penalty", "FP32", None, check=math.isfinite, bound="finite",
                                            engine=True)  # fmt: skip
    repetition_penalty: float | None = _wire("repetition_penalty", "FP32", None, check=lambda v: v > 0, bound="> 0",
                                             engine=True)  # fmt: skip
    return_log_probs: bool = _wire("return_log_probs", "BOOL", False, engine=True)
    # Each generated token's likeliest alternatives (the engine's generation logits; check_top_logprobs).
    top_logprobs: int = _wire("top_logprobs", "INT32", 0, check=lambda v: 0 <= v <= TOP_LOGPROBS_CAP,
                              bound=f"in [0, {TOP_LOGPROBS_CAP}]")  # fmt: skip
    logit_bias: Mapping[int, float] | None = None
    guide: Guide | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            wire, value = f.metadata.get("wire"), getattr(self, f.name)
            if wire is not None and wire.tensor.dims == (-1,) and not isinstance(value, tuple):
                # any sequence of media, words or ids
                value = tuple(int(v) for v in value) if wire.tensor.data_type == "INT32" else tuple(value)
                object.__setattr__(self, f.name, value)
            if wire is not None and value is None and not wire.tensor.optional:
                raise RequestError(f"{f.name} is required", field=f.name)
            if value is None and f.default is not None:  # None: not asked for, the default
                value = f.default
                object.__setattr__(self, f.name, value)
            if wire is not None and wire.check is not None and value is not None and not wire.check(value):
                raise RequestError(f"{f.name} must be {wire.bound}, got {value!r}", field=f.name)
            if wire is not None and wire.tensor.data_type == "INT32" and value is not None:
                if any(v >= 2**31 for v in (value if isinstance(value, tuple) else (value,))):
                    raise RequestError(f"{f.name} must be below 2**31 (an int32), got {value!r}", field=f.name)
        if not 0 <= self.priority <= PRIORITY_LEVELS:
            raise RequestError(f"priority must be in [0, {PRIORITY_LEVELS}], got {self.priority!r}", field="priority")
        if self.prompt_ids and (self.prompt or self.messages is not None or self.tools or self.raw_prompt):
            raise MessageError("prompt_ids are the whole prompt, tokenized: send no prompt text, messages, tools or "
                               "raw_prompt with them", field="prompt_ids")  # fmt: skip
        if self.raw_prompt and self.messages is not None:
            raise MessageError("raw_prompt sends the prompt as it is; do not send messages with it", field="messages")
        if self.messages is not None and not isinstance(self.messages, list):
            raise MessageError("messages must be a JSON list of chat messages", field="messages")
        if self.tools is not None and not isinstance(self.tools, list):
            raise MessageError("tools must be a JSON list", field="tools")
        if self.top_logprobs and not self.exclude_input_in_output:
            raise RequestError("top_logprobs are reported for generated tokens only: send exclude_input_in_output "
                               "true with them", field="top_logprobs")  # fmt: skip
        if self.guide is not None and self.min_tokens:
            raise RequestError("min_tokens cannot go with a guide (a JSON response_format or a required tool call): "
                               "the grammar decides where the answer ends", field="min_tokens")  # fmt: skip
        if self.logit_bias is not None and not all(
            isinstance(i, int) and 0 <= i < 2**31 and math.isfinite(w) for i, w in self.logit_bias.items()
        ):
            raise RequestError("logit_bias takes token ids >= 0 and finite biases", field="logit_bias")

    # -- the rules that need the deployment ---------------------------------------------------------

    def check_vocabulary(self, vocab_size: int) -> None:
        """RequestError unless every token id the request names is in the model's vocabulary."""
        bias = self.logit_bias or {}
        outside = sorted(i for i in bias if i >= vocab_size)
        if outside:
            raise RequestError(f"logit_bias: {outside[0]} is not a token id below {vocab_size}", field="logit_bias")

    def check_top_logprobs(self, max_top_logprobs: int) -> None:
        """RequestError unless the deployment serves as many alternatives per token as the request asks."""
        if self.top_logprobs > max_top_logprobs:
            served = (
                f"serves top_logprobs up to {max_top_logprobs}"
                if max_top_logprobs
                else "was built without top_logprobs (qwen3vl-trt build --max-top-logprobs N serves them)"
            )
            raise RequestError(f"top_logprobs {self.top_logprobs}: this deployment {served}", field="top_logprobs")

    def check_length(self, prompt_tokens: int, max_seq_len: int) -> None:
        """PromptTooLongError unless the prompt and max_tokens fit the deployment's context (max_seq_len)."""
        room = max_seq_len - prompt_tokens
        if self.max_tokens > room:
            raise PromptTooLongError(
                f"this deployment's maximum context length is {max_seq_len} tokens; the prompt takes {prompt_tokens} "
                f"and max_tokens asks for {self.max_tokens} (at most {max(room, 0)}): lower max_tokens or shorten "
                "the prompt",
                field="max_tokens",
            )

    def chat(self) -> list[dict[str, Any]]:
        """The chat the template renders: one user turn (the images, the videos, then the prompt), or the messages
        whose image and video parts without data take the request's images and videos in order, followed by the
        prompt as a user turn if any."""
        media = {"image": list(self.images), "video": list(self.videos)}
        if self.messages is None:
            parts: list[dict[str, Any]] = [{"type": kind, kind: data} for kind, sent in media.items() for data in sent]
            return [{"role": "user", "content": [*parts, {"type": "text", "text": self.prompt}]}]
        messages = copy.deepcopy(self.messages)  # the request stays as sent
        pending = {kind: list(sent) for kind, sent in media.items()}
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            for part in content if isinstance(content, list) else ():
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in pending and kind not in part:
                    if not pending[kind]:
                        raise MessageError(f"messages have more {kind} parts than the {len(media[kind])} {kind}s sent")
                    part[kind] = pending[kind].pop(0)
        for kind, left in pending.items():
            if left:
                raise MessageError(
                    f"{len(left)} of the {len(media[kind])} {kind}s sent have no {kind} part in messages"
                )
        if self.prompt:
            messages.append({"role": "user", "content": self.prompt})
        return messages

    # -- the ensemble's tensors -------------------------------------------------------------------------

    def to_inputs(self) -> dict[Tensor, np.ndarray]:
        """The ensemble's inputs for this request, without the batch dimension: the required ones and every other
        that differs from its default (what is left out, the stage reads as its default)."""
        sent = self._encoded(engine_only=False)
        if self.logit_bias:
            sent[LOGIT_BIAS_IDS] = _array(LOGIT_BIAS_IDS, list(self.logit_bias))
            sent[LOGIT_BIAS_WEIGHTS] = _array(LOGIT_BIAS_WEIGHTS, list(self.logit_bias.values()))
        return sent

    def engine_options(self) -> dict[Tensor, np.ndarray]:
        """The inputs of ENGINE_OPTIONS this request sends, which the stage passes on to the llm as they are (the
        media, messages and prompt are not encoded for it)."""
        return self._encoded(engine_only=True)

    def _encoded(self, engine_only: bool) -> dict[Tensor, np.ndarray]:
        """The fields' tensors that to_inputs sends (engine_only: those of ENGINE_OPTIONS), and the guide's."""
        sent: dict[Tensor, np.ndarray] = {}
        for f in fields(self):
            wire, value = f.metadata.get("wire"), getattr(self, f.name)
            if wire is None or (engine_only and not wire.engine) or (value == f.default and wire.tensor.optional):
                continue
            if wire.json:
                value = json.dumps(value)
            items = list(value) if wire.tensor.dims == (-1,) else [value]
            sent[wire.tensor] = _array(wire.tensor, items)
        if self.guide is not None:
            sent[GUIDE_TYPE] = _array(GUIDE_TYPE, [self.guide.type])
            sent[GUIDE_TEXT] = _array(GUIDE_TEXT, [self.guide.text])
        return sent

    def named_inputs(self) -> dict[str, np.ndarray]:
        """to_inputs by tensor name: what a stage reads."""
        return {t.name: array for t, array in self.to_inputs().items()}

    @classmethod
    def from_inputs(cls, inputs: Mapping[str, Any]) -> GenerationRequest:
        """The request of the ensemble's inputs (arrays by tensor name, with or without a batch dimension of 1);
        RequestError for one that cannot be served as sent."""
        missing = [t.name for t in REQUEST_INPUTS if not t.optional and t.name not in inputs]
        if missing:
            raise RequestError(f"the request lacks the required input(s) {', '.join(missing)}", field=missing[0])
        values: dict[str, Any] = {}
        for f in fields(cls):
            wire = f.metadata.get("wire")
            if wire is None or inputs.get(wire.tensor.name) is None:
                continue
            items = _items(inputs[wire.tensor.name])
            if wire.tensor.dims == (-1,) and wire.tensor.data_type != "STRING":
                values[f.name] = tuple(int(i) for i in items)
                continue
            if wire.tensor.dims == (-1,):
                data = tuple(i.encode() if isinstance(i, str) else bytes(i) for i in items)
                words = "bytes" not in str(f.type)  # not media
                values[f.name] = tuple(d.decode(errors="replace") for d in data) if words else data
                continue
            value = _one(wire.tensor, items)
            values[f.name] = _json(wire.tensor, value) if wire.json else value
        bias_ids, bias_weights = (inputs.get(t.name) for t in (LOGIT_BIAS_IDS, LOGIT_BIAS_WEIGHTS))
        if bias_ids is not None or bias_weights is not None:
            ids = [int(i) for i in _items(bias_ids if bias_ids is not None else [])]
            weights = [float(w) for w in _items(bias_weights if bias_weights is not None else [])]
            if len(ids) != len(weights) or not ids:
                raise RequestError(
                    f"logit bias needs as many weights as ids, got {len(weights)} and {len(ids)}", field="logit_bias"
                )
            bias: dict[int, float] = {}
            for i, w in zip(ids, weights, strict=True):
                bias[i] = bias.get(i, 0.0) + w  # an id sent twice adds its biases, as the embedding bias sums them
            values["logit_bias"] = bias
        guide_type, guide_text = (inputs.get(t.name) for t in (GUIDE_TYPE, GUIDE_TEXT))
        if guide_type is not None:
            text = _one(GUIDE_TEXT, _items(guide_text)) if guide_text is not None else ""
            values["guide"] = Guide(_one(GUIDE_TYPE, _items(guide_type)), text)
        elif guide_text is not None:
            raise RequestError(f"{GUIDE_TEXT.name} was sent without {GUIDE_TYPE.name}", field="guide")
        return cls(**values)


def _wires() -> list[tuple[str, Wire]]:
    return [(f.name, f.metadata["wire"]) for f in fields(GenerationRequest) if "wire" in f.metadata]


# The ensemble's request inputs, and those the stage passes on to the llm under their own names (with the guide's,
# which the tensorrt_llm model takes as the ensemble does).
REQUEST_INPUTS: tuple[Tensor, ...] = (
    *(wire.tensor for _, wire in _wires()),
    LOGIT_BIAS_IDS,
    LOGIT_BIAS_WEIGHTS,
    GUIDE_TYPE,
    GUIDE_TEXT,
)
ENGINE_OPTIONS: tuple[Tensor, ...] = (*(wire.tensor for _, wire in _wires() if wire.engine), GUIDE_TYPE, GUIDE_TEXT)


def tensor(name: str) -> Tensor:
    """The tensor of a GenerationRequest field."""
    return dict(_wires())[name].tensor


TEXT_INPUT = tensor("prompt")
# The options the CPU target's llm reads as the tensorrt_llm backend does (stages.cpu_llm).
PRESENCE_PENALTY, FREQUENCY_PENALTY, REPETITION_PENALTY, RETURN_LOG_PROBS = (
    tensor(name) for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "return_log_probs")
)


def _array(tensor: Tensor, items: list[Any]) -> np.ndarray:
    if tensor.data_type == "STRING":
        items = [i if isinstance(i, bytes) else str(i).encode() for i in items]
    return np.array(items, dtype=NUMPY_DTYPES[tensor.data_type])


def _items(value: Any) -> list[Any]:
    return list(np.asarray(value, dtype=object if _is_strings(value) else None).reshape(-1))


def _is_strings(value: Any) -> bool:
    return np.asarray(value).dtype.kind in "OSU"


def _one(tensor: Tensor, items: list[Any]) -> Any:
    if len(items) != 1:
        raise RequestError(f"{tensor.name} must hold one value, got {len(items)}", field=tensor.name)
    item = items[0]
    if isinstance(item, bytes | np.bytes_):
        return bytes(item).decode()
    if tensor.data_type == "BOOL":
        return bool(item)
    if tensor.data_type == "FP32":
        return float(item)
    return int(item) if tensor.data_type in ("INT32", "INT64", "UINT64") else item


def _json(tensor: Tensor, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise MessageError(f"{tensor.name} is not valid JSON: {e}", field=tensor.name) from None
