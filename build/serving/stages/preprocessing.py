"""The `preprocessing` model: a Triton request (a serving.request.GenerationRequest's inputs) -> the LLM engine's
inputs, for a batch of requests at once, in two steps: `execute` reads each request and tokenizes it (unless its
client sent it tokenized), looks its images and videos up in the visual-feature cache and decodes only the others,
each with the vision encoder's inputs for it alone (`VisualFeatures`); once the vision encoder has encoded those,
`finish` stores them in the cache and lays each request's prompt table out from their rows, cached or new, in prompt
order.

A request that cannot be served gets its own error; the others in the batch go on. The request's options are
turned into what the tensorrt_llm backend reads (greedy is runtime_top_k 1; the defaults are the request's), so both
targets' `llm` models receive every input.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...common.limits import EngineLimits
from ...decoding.guides import check_guide
from ...errors import RequestError, StageError
from ...hf.checkpoint import generation_end_ids
from ...preprocess import Preprocessor
from ...preprocess.preprocessor import Request, VisualInput, VisualKind
from ...vision.metadata import vision_metadata
from ...vision.sidecar import VisionEngineSidecar, VisionSidecar
from .. import interface
from ..request import GenerationRequest
from .visual_cache import FeatureScope, VisualCache

Arrays = Mapping[str, Any]
# What a pool request's prompt takes besides the visual tokens, per image or video (its vision start and end tokens
# and the template's text around them) and for the chat template itself.
POOL_PROMPT_TOKENS = 8
Found = MutableMapping[bytes, torch.Tensor]  # the visual cache's rows of one batch, by digest


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
    request: GenerationRequest
    outputs: dict[str, Any]  # the llm's inputs of the request's options (the engine mapping)
    cached: bool = True  # its images are looked up in and stored into the visual cache


@dataclass(frozen=True)
class PromptTableFormat:
    """What the LLM reads of the vision encoder: rows of `hidden_size` in `dtype`, K+1 rows per visual token
    (the main embedding, then one per DeepStack layer: llm.inputs.interleave_prompt_table)."""

    dtype: torch.dtype
    hidden_size: int
    rows_per_token: int

    def shape(self, tokens: int) -> tuple[int, int]:
        return (tokens * self.rows_per_token, self.hidden_size)


@dataclass(frozen=True)
class VisualFeatures:
    """One image or video of a request: its cache digest and grid, and its prompt-table rows when the cache had
    them, or else the vision encoder's inputs for it alone (contracts.VISION_INPUTS and grid), or, with a vision
    pool, its encoded file undecoded (`source`: the pool decodes it), or none of these when an earlier batch is
    encoding the same one now (the request waits for that encode)."""

    kind: VisualKind
    digest: bytes
    grid: tuple[int, int, int]
    tokens: int
    rows: torch.Tensor | None
    vision_inputs: dict[str, Any] | None
    source: bytes | None = field(default=None, repr=False)

    @property
    def encodes(self) -> bool:
        """Whether this request encodes it (here or in the pool), rather than finding or joining its rows."""
        return self.vision_inputs is not None or self.source is not None


@dataclass(frozen=True)
class Prepared:
    """A request ready for the LLM but for its prompt table: its output tensors, its images and videos in prompt
    order, and whether the visual cache keeps the features of those it encodes."""

    outputs: dict[str, Any]
    visual: tuple[VisualFeatures, ...]
    cached: bool = True

    @property
    def to_encode(self) -> list[VisualFeatures]:
        """Images and videos this request sends to the vision encoder."""
        return [item for item in self.visual if item.encodes]

    @property
    def pending(self) -> list[VisualFeatures]:
        """Images whose rows this request still needs: its own to encode, and those being encoded already."""
        return [item for item in self.visual if item.rows is None]


class Preprocessing:
    def __init__(
        self,
        model_dir: str | Path,
        limits: EngineLimits,
        llm_dtype: torch.dtype,
        llm_hidden_size: int,
        mrope_positions: int = 0,
        device: str = "cpu",
    ):
        """llm_dtype, llm_hidden_size: of the prompt table the LLM reads. mrope_positions: rows of the mrope
        table sent to the LLM (the engine's max_seq_len on the GPU target; 0 sends the prompt's rows only, which
        the reference runtime reads). Images are looked up in and stored into `cache` once one is set (see
        feature_scope); without one, every image is encoded."""
        self.pre = Preprocessor.from_pretrained(model_dir, device=device, limits=limits.request_limits())
        self.limits = limits
        self.table = PromptTableFormat(llm_dtype, llm_hidden_size, self.pre.info.deepstack_count + 1)
        self.cache: VisualCache | None = None
        # With a vision pool, images and videos the cache does not hold are left undecoded for the pool (scheduler).
        self.pooled = False
        self.mrope_positions = mrope_positions
        self.tokenizer = self.pre.prompts.tokenizer
        self.end_ids = generation_end_ids(Path(model_dir))
        if not self.end_ids:
            raise RequestError(f"{model_dir}/generation_config.json names no eos_token_id; the server needs one")
        check_guide("regex", "a")  # the grammar library's start (seconds) is paid here, not by a guided request

    def feature_scope(self, vision_dir: Path, engine_dir: Path | None) -> FeatureScope:
        """What decides an image's features besides its bytes and grid: the vision model (its weights, graph
        contract, dtype, and the runner: ONNX Runtime, or the TensorRT engine of one TensorRT version and GPU), the
        LLM's dtype, and the preprocessing settings that shape pixels (processor config, resize backend, device)."""
        export = VisionSidecar.load(vision_dir)
        vision = {
            "visual_weights_sha256": export.source_checkpoint.get("visual_weights_sha256"),
            "config_sha256": export.source_checkpoint.get("config_sha256"),
            "contract_sha256": export.contract_sha256(),
            "graph_variant": export.graph_variant,
            "dtype": export.dtype,
        }
        runner: dict[str, Any] = {"runtime": "onnxruntime"}
        if engine_dir is not None:
            engine = VisionEngineSidecar.load(engine_dir).raw
            runner = {
                "runtime": "tensorrt",
                "tensorrt_version": engine["tensorrt_version"],
                "gpu": engine["gpu"],
                "contract_sha256": engine["contract_sha256"],
            }
        return FeatureScope.of(
            {
                "vision": vision,
                "runner": runner,
                "prompt_table": {"dtype": str(self.table.dtype), "hidden_size": self.table.hidden_size},
                "image_processing": asdict(self.pre.image_config),
                "video_processing": asdict(self.pre.video_config) if self.pre.video_config is not None else None,
                "video_decoder": type(self.pre.video_decoder).__name__ if self.pre.video_decoder else "pyav",
                "resize_backend": self.pre.normalize.backend,
                "device": self.pre.device.type,
            }
        )

    def execute(
        self, requests: Sequence[Arrays], encoding: Collection[bytes] = (), uncached: Collection[int] = ()
    ) -> list[Prepared | Exception]:
        """Per request: what it needs of the vision encoder and the rest of its output tensors (no batch
        dimension), or the error to answer it with. `encoding`: digests of images an earlier batch is encoding
        now; those are neither looked up nor decoded (their requests wait for that encode). `uncached`: the
        requests (by index) whose images the visual cache neither looks up nor keeps (warm-up requests)."""
        results: dict[int, Prepared | Exception] = {}
        parsed: dict[int, _Parsed] = {}
        for i, inputs in enumerate(requests):
            try:
                parsed[i] = replace(self._parse(inputs), cached=i not in uncached)
            except RequestError as e:
                results[i] = e
        results.update(self._run(parsed, encoding))
        return [results[i] for i in range(len(requests))]

    def vision_request(self, images: Sequence[VisualFeatures]) -> dict[str, Any]:
        """One vision encoder request of images to encode (of any requests): their inputs concatenated, as the
        encoder takes several images (vision.metadata's per-patch arrays concatenate)."""
        first = images[0].vision_inputs
        assert first is not None and all(image.vision_inputs is not None for image in images)
        joined = {}
        for name in first:
            parts = [image.vision_inputs[name] for image in images]  # type: ignore[index]
            joined[name] = torch.cat(parts) if isinstance(parts[0], torch.Tensor) else np.concatenate(parts)
        joined[interface.VISUAL_TOKEN_COUNT.name] = np.array([sum(image.tokens for image in images)], np.int32)
        return joined

    def pool_requests(self, images: Sequence[VisualFeatures]) -> list[tuple[GenerationRequest, list[VisualFeatures]]]:
        """Vision pool members' requests for undecoded images and videos (a member's `preprocessing` decodes and
        encodes them and answers their rows as the prompt table), each within one request's limits, and each one's
        images in the order of its rows: the images, then the videos (GenerationRequest.chat)."""
        limits = self.pre.limits
        chunks: list[list[VisualFeatures]] = []
        counts = {"image": 0, "video": 0}
        tokens = 0
        for image in sorted(images, key=lambda image: image.kind == "video"):
            fits = (
                chunks
                and counts[image.kind] < (limits.max_images if image.kind == "image" else limits.max_videos)
                and tokens + image.tokens <= limits.max_visual_tokens
                # each item's placeholder tokens around its rows, and the chat template's few
                and tokens + image.tokens + POOL_PROMPT_TOKENS * (len(chunks[-1]) + 2) <= limits.max_prompt_tokens
            )
            if not fits:
                chunks.append([])
                counts, tokens = {"image": 0, "video": 0}, 0
            chunks[-1].append(image)
            counts[image.kind] += 1
            tokens += image.tokens
        requests = []
        for chunk in chunks:
            sources: dict[str, list[bytes]] = {"image": [], "video": []}
            for image in chunk:
                assert image.source is not None, "only an encoded file goes to a pool"
                sources[image.kind].append(image.source)
            request = GenerationRequest(prompt="", images=sources["image"], videos=sources["video"], max_tokens=1)
            requests.append((request, chunk))
        return requests

    def decode(self, images: Sequence[VisualFeatures]) -> list[VisualFeatures]:
        """Images and videos left undecoded for a pool that did not answer, decoded here for the local vision
        encoder, as the pool would have (checked against the digests and grids their prompts were laid out with)."""
        requests = self.pool_requests(images)
        made = self.pre.batch([{"messages": request.chat()} for request, _ in requests])
        decoded = [item for one in made for item in self._features(one, {})]
        for want, got in zip([image for _, chunk in requests for image in chunk], decoded, strict=True):
            if (want.digest, want.grid) != (got.digest, got.grid):
                raise StageError(f"decoding a {want.kind} again gave grid {got.grid}, not {want.grid}")
        return decoded

    def split_rows(self, table: torch.Tensor, images: Sequence[VisualFeatures]) -> dict[bytes, torch.Tensor]:
        """The vision encoder's prompt table of a vision_request, cut into each image's rows, by digest."""
        sizes = [self.table.shape(image.tokens)[0] for image in images]
        if table.shape[0] != sum(sizes):
            raise StageError(f"the vision encoder answered {table.shape[0]} rows for images of {sum(sizes)}")
        return {image.digest: rows for image, rows in zip(images, torch.split(table, sizes), strict=True)}

    def finish(self, prepared: Prepared, encoded: Mapping[bytes, torch.Tensor]) -> dict[str, Any]:
        """The request's output tensors with its prompt table, from its images' cached rows and the vision
        encoder's rows of the others (`encoded`, by digest); the cache keeps the rows of the images this request
        sent to the encoder. A request without images gets one zero row, which no id addresses, so every request
        carries a table."""
        rows = []
        for image in prepared.visual:
            if image.rows is not None:
                rows.append(image.rows)
                continue
            made = encoded[image.digest]
            if tuple(made.shape) != self.table.shape(image.tokens) or made.dtype != self.table.dtype:
                raise StageError(
                    f"the vision encoder answered {list(made.shape)} {made.dtype} for an image of {image.tokens} "
                    f"tokens; expected {list(self.table.shape(image.tokens))} {self.table.dtype}"
                )
            if self.cache is not None and prepared.cached and image.encodes:
                self.cache.put(image.digest, image.grid, made)
            rows.append(made)
        if rows:
            device = next((r.device for r in rows if r.device.type != "cpu"), rows[0].device)
            table = torch.cat([r.to(device) for r in rows])
        else:
            table = torch.zeros((1, self.table.hidden_size), dtype=self.table.dtype)
        return {**prepared.outputs, interface.PROMPT_TABLE.name: table}

    def _run(self, parsed: dict[int, _Parsed], encoding: Collection[bytes]) -> dict[int, Prepared | Exception]:
        """Preprocesses the batch together (images looked up in the cache in one round trip, the others decoded
        as one batch); when one request fails, each is run alone so that only the bad ones get errors."""
        if not parsed:
            return {}
        found: Found = {}  # this batch's alone: nothing of a request stays on the component once it is prepared

        def skipped(batch: Sequence[_Parsed]) -> Callable[[Sequence[Sequence[VisualInput]]], list[list[bool]]]:
            return lambda visual: self._cached(visual, [one.cached for one in batch], encoding, found)

        def alone(one: _Parsed) -> Prepared | Exception:
            try:
                return self._prepared(one, self.pre.batch([one.call], skipped([one]))[0], found, encoding)
            except RequestError as e:
                return e

        order = list(parsed)
        try:
            made = self.pre.batch([parsed[i].call for i in order], skipped([parsed[i] for i in order]))
            return {
                i: self._prepared(parsed[i], request, found, encoding) for i, request in zip(order, made, strict=True)
            }
        except RequestError as e:
            if len(order) == 1:
                return {order[0]: e}
        return {i: alone(parsed[i]) for i in order}

    def _cached(
        self,
        visual: Sequence[Sequence[VisualInput]],
        cached: Sequence[bool],
        encoding: Collection[bytes],
        found: Found,
    ) -> list[list[bool]]:
        """Preprocessor.batch's skip_decoding: looks every image and video of the batch up at once (but those being
        encoded now, `encoding`, and those of requests whose `cached` flag is off) and keeps the rows found for
        _prepared in `found`; one is skipped when its rows were found or are coming, or, with a vision pool, when it
        is an encoded file (the pool decodes it)."""
        found.clear()
        merge = self.pre.image_config.merge_size
        digests = [[item.digest for item in items] for items in visual]
        coming = {digest for plan_digests in digests for digest in plan_digests if digest in encoding}
        wanted = {}
        for items, looked_up in zip(visual, cached, strict=True):
            for item in items:
                if looked_up and item.digest not in coming:
                    tokens = int(item.grid_thw.prod()) // (merge * merge)
                    wanted[item.digest] = (tuple(int(g) for g in item.grid_thw), self.table.shape(tokens))
        if self.cache is not None:
            lookup = self.cache.lookup([(digest, *image) for digest, image in wanted.items()], self.table.dtype)
            found.update((digest, rows) for digest, rows in zip(wanted, lookup, strict=True) if rows is not None)
        return [
            [
                (looked_up and item.digest in found) or item.digest in coming or self._pool_source(item) is not None
                for item in items
            ]
            for items, looked_up in zip(visual, cached, strict=True)
        ]

    def _pool_source(self, item: VisualInput) -> bytes | None:
        """The encoded file a vision pool decodes for this item, None when this replica decodes it."""
        return item.source if self.pooled and isinstance(item.source, bytes) else None

    def _prepared(self, parsed: _Parsed, request: Request, found: Found, encoding: Collection[bytes]) -> Prepared:
        return Prepared(self._outputs(parsed, request), tuple(self._features(request, found, encoding)), parsed.cached)

    def _features(self, request: Request, found: Found, encoding: Collection[bytes] = ()) -> list[VisualFeatures]:
        """A request's images and videos in prompt order: the vision encoder's inputs of those it decoded, the rows
        the cache held, and what a pool or an earlier batch encodes of the others."""
        merge = self.pre.image_config.merge_size
        decoded = request.decoded or (True,) * len(request.visual)
        images, first = [], 0
        for item, was_decoded in zip(request.visual, decoded, strict=True):
            digest, grid = item.digest, item.grid_thw
            patches = int(grid.prod())
            tokens = patches // (merge * merge)
            vision_inputs = None
            if was_decoded:
                vision_inputs = {
                    interface.VISION_PIXELS.name: request.pixel_values[first : first + patches],
                    **vision_metadata(grid[None], merge, self.pre.info.vision.num_grid_per_side),
                    interface.IMAGE_GRID_THW.name: grid[None].astype(np.int64),
                }
                first += patches
            rows = None if was_decoded else found.get(digest)  # None: being encoded by an earlier batch or a pool
            pooled = not was_decoded and rows is None and digest not in encoding
            source = self._pool_source(item) if pooled else None
            t, h, w = (int(g) for g in grid)
            images.append(VisualFeatures(item.kind, digest, (t, h, w), tokens, rows, vision_inputs, source))
        return images

    def _parse(self, inputs: Arrays) -> _Parsed:
        request = GenerationRequest.from_inputs(inputs)
        request.check_vocabulary(self.pre.info.text.vocab_size)
        request.check_top_logprobs(self.limits.max_top_logprobs)
        if request.guide is not None:
            check_guide(request.guide.type, request.guide.text)
        call: dict[str, Any]
        if request.prompt_ids:  # rendered and tokenized by the client (the gateway): neither is done again
            ids = np.asarray(request.prompt_ids, np.int64)
            call = {"prompt_ids": ids, "images": list(request.images), "videos": list(request.videos)}
        elif request.raw_prompt:
            call = {"prompt": request.prompt, "images": list(request.images), "videos": list(request.videos)}
        else:
            call = {"messages": request.chat(), **({"tools": request.tools} if request.tools else {})}
        return _Parsed(call, request, self._engine_inputs(request))

    def _engine_inputs(self, request: GenerationRequest) -> dict[str, Any]:
        """The engine mapping: the request as the tensorrt_llm backend reads it (greedy is runtime_top_k 1; the
        checkpoint's end ids unless the request names one), the options it takes under their own names passed on
        when sent (the engine's defaults apply to the others), and the logit bias as the embedding_bias: a bias per
        vocabulary entry, as long as the model's vocabulary (TensorRT-LLM's decoder refuses any other length)."""
        greedy = request.temperature == 0.0
        end_id = self.end_ids[0] if request.end_id is None else request.end_id
        # The other end ids stop generation too: TensorRT-LLM takes them as one-token stop words.
        stop_words = [*self._encode(request.stop_words), *[(t,) for t in self.end_ids if t != end_id]]
        outputs = {
            interface.REQUEST_OUTPUT_LEN.name: np.array([request.max_tokens], np.int32),
            interface.END_ID.name: np.array([end_id], np.int32),
            interface.PAD_ID.name: np.array([end_id if request.pad_id is None else request.pad_id], np.int32),
            interface.RUNTIME_TOP_K.name: np.array([1 if greedy else request.top_k], np.int32),
            interface.RUNTIME_TOP_P.name: np.array([1.0 if greedy else request.top_p], np.float32),
            interface.TEMPERATURE.name: np.array([1.0 if greedy else request.temperature], np.float32),
            interface.SEED.name: np.array([request.seed], np.uint64),
            interface.MIN_TOKENS.name: np.array([request.min_tokens], np.int32),
            # A request with top_logprobs streams: each response carries its tokens' rows of logits, where the one
            # response of a request that does not would carry max_tokens rows (interface.GENERATION_LOGITS).
            interface.STREAMING.name: np.array([request.stream or request.top_logprobs > 0], bool),
            interface.EXCLUDE_INPUT.name: np.array([request.exclude_input_in_output], bool),
            interface.RETURN_GENERATION_LOGITS.name: np.array([request.top_logprobs > 0], bool),
            interface.STOP_WORDS_LIST.name: word_list(stop_words),
            interface.BAD_WORDS_LIST.name: word_list(self._encode(request.bad_words)),
        }
        outputs.update((tensor.name, array) for tensor, array in request.engine_options().items())
        if request.logit_bias:
            bias = np.zeros(self.pre.info.text.vocab_size, np.float32)
            for token, weight in request.logit_bias.items():
                bias[token] += weight
            outputs[interface.EMBEDDING_BIAS.name] = bias
        return outputs

    def _encode(self, words: Sequence[str]) -> list[list[int]]:
        return [self.tokenizer.encode(w, add_special_tokens=False).ids for w in words]

    def _outputs(self, parsed: _Parsed, request: Request) -> dict[str, Any]:
        length = request.num_tokens
        parsed.request.check_length(length, self.limits.max_seq_len)
        cos_sin = (
            request.mrope_rotary_cos_sin(self.mrope_positions)
            if self.mrope_positions
            else request.rotary_cos_sin.reshape(-1)
        )
        return {
            interface.INPUT_IDS.name: request.engine_input_ids,
            interface.INPUT_LENGTHS.name: np.array([length], np.int32),
            interface.MROPE_COS_SIN.name: np.ascontiguousarray(cos_sin, dtype=np.float32),
            interface.MROPE_DELTAS.name: interface.MROPE_DELTAS.to_triton(request.mrope_position_deltas),
            interface.EXTRA_IDS.name: request.prompt_table_extra_ids,
            **parsed.outputs,
        }
