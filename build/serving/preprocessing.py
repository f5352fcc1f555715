"""The `preprocessing` model: a Triton request (tensorrtllm_backend-style inputs plus images) ->
the vision encoder's inputs and the LLM engine's inputs, for a batch of requests at once.

A request that cannot be served gets its own error; the others in the batch go on. Sampling inputs
are turned into what the tensorrt_llm backend reads (greedy is runtime_top_k 1), with the defaults
decided here once, so both targets' `llm` models receive every input.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MessageError, PromptTooLongError, RequestError
from ..limits import EngineLimits
from ..preprocess import Preprocessor
from ..preprocess.preprocessor import Request
from ..runtime.local import generation_end_ids
from . import interface

Arrays = Mapping[str, Any]


def _scalar(inputs: Arrays, tensor: interface.Tensor, default: Any) -> Any:
    value = inputs.get(tensor.name)
    if value is None:
        return default
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1:
        raise RequestError(f"{tensor.name} must hold one value, got {flat.size}")
    item = flat[0]
    return item.decode() if isinstance(item, bytes) else item.item() if hasattr(item, "item") else item


def _strings(inputs: Arrays, tensor: interface.Tensor) -> list[bytes]:
    value = inputs.get(tensor.name)
    if value is None:
        return []
    return [bytes(v) if not isinstance(v, str) else v.encode() for v in np.asarray(value, dtype=object).reshape(-1)]


def word_list(words: Sequence[Sequence[int]]) -> np.ndarray:
    """stop_words_list / bad_words_list as TensorRT-LLM takes them: int32 [2, W], row 0 the words'
    ids one after another, row 1 the end offset of each word, padded with -1 (row 0 with 0). No
    words is [[0], [-1]], as the tensorrtllm_backend's preprocessing sends it."""
    words = [w for w in words if len(w)]
    flat = [int(t) for w in words for t in w]
    table = np.zeros((2, max(len(flat), len(words), 1)), dtype=np.int32)
    table[1] = -1
    table[0, : len(flat)] = flat
    table[1, : len(words)] = np.cumsum([len(w) for w in words])
    return table


def split_word_list(table: np.ndarray | None) -> tuple[tuple[int, ...], ...]:
    """The word sequences of a [2, W] word list (inverse of word_list)."""
    if table is None:
        return ()
    table = np.asarray(table).reshape(2, -1)
    words, start = [], 0
    for end in table[1]:
        if end < 0:
            break
        words.append(tuple(int(t) for t in table[0, start:end]))
        start = int(end)
    return tuple(words)


@dataclass(frozen=True)
class _Parsed:
    call: dict[str, Any]  # Preprocessor.batch() arguments
    outputs: dict[str, Any]  # the LLM's sampling inputs and the postprocessing flags


class Preprocessing:
    def __init__(self, model_dir: str | Path, limits: EngineLimits, mrope_positions: int = 0, device: str = "cpu"):
        """mrope_positions: rows of the mrope table sent to the LLM (the engine's max_seq_len on the
        GPU target; 0 sends the prompt's rows only, which the reference runtime reads)."""
        self.pre = Preprocessor.from_pretrained(model_dir, device=device, limits=limits.request_limits())
        self.limits = limits
        self.mrope_positions = mrope_positions
        self.tokenizer = self.pre.prompts.tokenizer
        self.end_ids = generation_end_ids(Path(model_dir))
        if not self.end_ids:
            raise RequestError(f"{model_dir}/generation_config.json names no eos_token_id; the server needs one")

    def execute(self, requests: Sequence[Arrays]) -> list[dict[str, Any] | Exception]:
        """Per request: its output tensors (no batch dimension), or the error to answer it with."""
        results: list[dict[str, Any] | Exception] = []
        parsed: dict[int, _Parsed] = {}
        for i, inputs in enumerate(requests):
            try:
                parsed[i] = self._parse(inputs)
            except RequestError as e:
                results.append(e)
            else:
                results.append({})
        done = self._run(parsed)
        for i, outcome in done.items():
            results[i] = outcome
        return results

    def _run(self, parsed: dict[int, _Parsed]) -> dict[int, dict[str, Any] | Exception]:
        """Preprocesses the batch together (images decoded as one batch); when one request fails,
        each is run alone so that only the bad ones get errors."""
        if not parsed:
            return {}
        order = list(parsed)
        try:
            made = self.pre.batch([parsed[i].call for i in order])
            return {i: self._outputs(parsed[i], request) for i, request in zip(order, made, strict=True)}
        except RequestError as e:
            if len(order) == 1:
                return {order[0]: e}
        return {i: self._alone(parsed[i]) for i in order}

    def _alone(self, parsed: _Parsed) -> dict[str, Any] | Exception:
        try:
            return self._outputs(parsed, self.pre.batch([parsed.call])[0])
        except RequestError as e:
            return e

    def _parse(self, inputs: Arrays) -> _Parsed:
        missing = [t.name for t in interface.REQUEST_INPUTS if not t.optional and t.name not in inputs]
        if missing:
            raise RequestError(f"the request lacks the required input(s) {', '.join(missing)}")
        text = _scalar(inputs, interface.TEXT_INPUT, "")
        images = _strings(inputs, interface.IMAGES)
        messages_json = _scalar(inputs, interface.MESSAGES, None)
        if _scalar(inputs, interface.RAW_PROMPT, False):
            if messages_json is not None:
                raise MessageError("raw_prompt sends text_input as the prompt; do not send messages with it")
            call: dict[str, Any] = {"prompt": text, "images": images}
        else:
            call = {"messages": self._messages(text, images, messages_json)}
        max_tokens = int(_scalar(inputs, interface.MAX_TOKENS, 0))
        if max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}")
        temperature = float(_scalar(inputs, interface.TEMPERATURE_IN, 0.0))
        top_k = int(_scalar(inputs, interface.TOP_K, 0))
        top_p = float(_scalar(inputs, interface.TOP_P, 1.0))
        if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
            raise RequestError(
                f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got {temperature}, {top_k}, {top_p}"
            )
        greedy = temperature == 0.0
        end_id = int(_scalar(inputs, interface.END_ID_IN, self.end_ids[0]))
        # The other end ids stop generation too: TensorRT-LLM takes them as one-token stop words.
        stop_words = [
            *self._encode(_strings(inputs, interface.STOP_WORDS)),
            *[(t,) for t in self.end_ids if t != end_id],
        ]
        streaming = bool(_scalar(inputs, interface.STREAM, False))
        outputs = {
            interface.REQUEST_OUTPUT_LEN.name: np.array([max_tokens], np.int32),
            interface.END_ID.name: np.array([end_id], np.int32),
            interface.PAD_ID.name: np.array([int(_scalar(inputs, interface.PAD_ID_IN, end_id))], np.int32),
            interface.RUNTIME_TOP_K.name: np.array([1 if greedy else top_k], np.int32),
            interface.RUNTIME_TOP_P.name: np.array([1.0 if greedy else top_p], np.float32),
            interface.TEMPERATURE.name: np.array([1.0 if greedy else temperature], np.float32),
            interface.SEED.name: np.array([int(_scalar(inputs, interface.SEED_IN, 0))], np.uint64),
            interface.MIN_TOKENS.name: np.array([int(_scalar(inputs, interface.MIN_TOKENS_IN, 0))], np.int32),
            interface.STREAMING.name: np.array([streaming], bool),
            interface.EXCLUDE_INPUT.name: np.array([bool(_scalar(inputs, interface.EXCLUDE_INPUT_IN, False))], bool),
            interface.STOP_WORDS_LIST.name: word_list(stop_words),
            interface.BAD_WORDS_LIST.name: word_list(self._encode(_strings(inputs, interface.BAD_WORDS))),
        }
        return _Parsed(call, outputs)

    def _encode(self, words: list[bytes]) -> list[list[int]]:
        return [self.tokenizer.encode(w.decode(errors="replace"), add_special_tokens=False).ids for w in words]

    def _messages(self, text: str, images: list[bytes], messages_json: str | None) -> list[dict[str, Any]]:
        """The chat: one user turn (the images, then the text), or the JSON messages whose image parts
        without data take the request's images in order, followed by text_input as a user turn if any."""
        if messages_json is None:
            parts: list[dict[str, Any]] = [{"type": "image", "image": image} for image in images]
            return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
        try:
            messages = json.loads(messages_json)
        except json.JSONDecodeError as e:
            raise MessageError(f"messages is not valid JSON: {e}") from None
        if not isinstance(messages, list):
            raise MessageError("messages must be a JSON list of chat messages")
        pending = list(images)
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            for part in content if isinstance(content, list) else ():
                if isinstance(part, dict) and part.get("type") == "image" and "image" not in part:
                    if not pending:
                        raise MessageError(f"messages have more image parts than the {len(images)} images sent")
                    part["image"] = pending.pop(0)
        if pending:
            raise MessageError(f"{len(pending)} of the {len(images)} images sent have no image part in messages")
        if text:
            messages.append({"role": "user", "content": text})
        return messages

    def _outputs(self, parsed: _Parsed, request: Request) -> dict[str, Any]:
        length = request.num_tokens
        max_tokens = int(parsed.outputs[interface.REQUEST_OUTPUT_LEN.name][0])
        if length + max_tokens > self.limits.max_seq_len:
            raise PromptTooLongError(
                f"the prompt's {length} tokens + max_tokens {max_tokens} exceed the deployment's max_seq_len "
                f"{self.limits.max_seq_len}; lower max_tokens or shorten the prompt"
            )
        vision = {name: np.asarray(request.vision_inputs.get(name, empty)) for name, empty in _NO_IMAGES.items()}
        cos_sin = (
            request.mrope_rotary_cos_sin(self.mrope_positions)
            if self.mrope_positions
            else request.rotary_cos_sin.reshape(-1)
        )
        return {
            interface.VISION_PIXELS.name: request.pixel_values,  # stays on the preprocessing device
            **vision,
            interface.IMAGE_GRID_THW.name: request.image_grid_thw.astype(np.int64).reshape(-1, 3),
            interface.VISUAL_TOKEN_COUNT.name: np.array([request.num_visual_tokens], np.int32),
            interface.INPUT_IDS.name: request.engine_input_ids,
            interface.INPUT_LENGTHS.name: np.array([length], np.int32),
            interface.MROPE_COS_SIN.name: np.ascontiguousarray(cos_sin, dtype=np.float32),
            interface.MROPE_DELTAS.name: interface.MROPE_DELTAS.to_triton(request.mrope_position_deltas),
            interface.EXTRA_IDS.name: request.prompt_table_extra_ids,
            **parsed.outputs,
        }


# The vision metadata of a request without images.
_NO_IMAGES = {
    interface.VISION_POS_EMBED_IDX.name: np.zeros((0, 4), np.int32),
    interface.VISION_POS_EMBED_W.name: np.zeros((0, 4), np.float32),
    interface.VISION_ROTARY_POS.name: np.zeros((0, 2), np.int32),
    interface.VISION_SEGMENT_START.name: np.zeros((0,), np.int32),
}
