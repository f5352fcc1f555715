"""The converted checkpoint run by the reference runtime, on the engine contract, against transformers.

Inputs come from the preprocessor and the exported vision encoder (ONNX Runtime): this is the whole
chain from request bytes to logits, compared with Qwen3VLForConditionalGeneration on the same request.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from images import jpeg
from qwen3vl_trt.errors import InputError
from qwen3vl_trt.hf.reference import hf_model_inputs, hf_rope_index, load_hf_text_model
from qwen3vl_trt.llm.convert import convert_llm
from qwen3vl_trt.llm.inputs import rope_index
from qwen3vl_trt.pipeline.build import build
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.qa.tiny import ENDOFTEXT_ID, IM_END_ID, IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID
from qwen3vl_trt.runtime import DecodeBatch, LLMRequest, ReferenceLLM, SamplingParams
from qwen3vl_trt.runtime.local import LocalPipeline, StreamingDetokenizer, engine_request
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.request import RETURN_LOG_PROBS
from qwen3vl_trt.serving.stages.cpu_llm import InflightLLM
from qwen3vl_trt.vision import OnnxVisionRunner
from transformers import AutoModelForImageTextToText

LOGIT_TOLERANCE = 1e-4  # max |ours - HF| / max |HF| at each prompt position, fp32
END_IDS = (IM_END_ID, ENDOFTEXT_ID)  # the tiny checkpoints' generation_config eos ids

# Converted variants: (tiny checkpoint, tp, pp).
VARIANTS = {
    "dense": ("dense", 1, 1),
    "dense-tp2": ("dense", 2, 1),
    "dense-pp2": ("dense", 1, 2),
    "moe": ("moe", 1, 1),
    "moe-tp2": ("moe", 2, 1),
    "moe-pp2": ("moe", 1, 2),
}


def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


def _image(h, w, seed):
    return {"type": "image", "image": jpeg(h, w, seed=seed)}


def _text(text):
    return {"type": "text", "text": text}


CASES = {
    "text only": _user(_text("Hello! What can you do for me today?")),
    "one image": _user(_image(64, 96, 1), _text("Describe this picture.")),
    "three images between text": _user(
        _text("Compare"),
        _image(64, 64, 2),
        _text("with"),
        _image(96, 160, 3),
        _text("and then"),
        _image(128, 64, 4),
        _text("please."),
    ),
}


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("trtllm")
    return {
        name: convert_llm(checkpoints[src], root / name, dtype="fp32", tp=tp, pp=pp, progress=False)
        for name, (src, tp, pp) in VARIANTS.items()
    }


class Chain:
    """Preprocessor + vision encoder + (reference runtime | transformers) for one tiny checkpoint."""

    def __init__(self, model_dir, vision_dir):
        self.pre = Preprocessor.from_pretrained(model_dir)
        self.encoder = OnnxVisionRunner(vision_dir)
        self.hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()

    def engine_request(self, messages, sampling=None) -> LLMRequest:
        return engine_request(self.pre, self.encoder, messages, sampling)

    def hf_inputs(self, messages) -> dict:
        r = self.pre(messages)
        return hf_model_inputs(self.hf, r.input_ids, self.pre.info.image_token_id, r.pixel_values, r.image_grid_thw)


@pytest.fixture(scope="module")
def chains(checkpoints, vision_exports):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = Chain(checkpoints[name], vision_exports[name])
        return cache[name]

    return get


@pytest.fixture(scope="module")
def runtimes(converted):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = ReferenceLLM.from_checkpoint(converted[name])
        return cache[name]

    return get


def position_errors(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """Per prompt position: max |ours - theirs| / max |theirs|."""
    return (ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logits_match_transformers(variant, case, chains, runtimes):
    chain, llm = chains(VARIANTS[variant][0]), runtimes(variant)
    request = chain.engine_request(CASES[case])
    if case != "text only":
        assert request.prompt_embedding_table is not None and int(request.input_ids.max()) >= llm.vocab_size
    ours = llm.prompt_logits(request)
    with torch.no_grad():
        theirs = chain.hf(**chain.hf_inputs(CASES[case])).logits[0]
    assert ours.shape == theirs.shape
    errors = position_errors(ours, theirs)
    assert float(errors.max()) <= LOGIT_TOLERANCE, f"worst position {int(errors.argmax())}: {float(errors.max()):.2e}"


def test_deepstack_changes_the_logits(chains, runtimes):
    """The DeepStack rows matter: zeroing them moves the logits far beyond the tolerance."""
    chain, llm = chains("dense"), runtimes("dense")
    request = chain.engine_request(CASES["one image"])
    table = request.prompt_embedding_table.clone()
    table.view(-1, 4, table.shape[-1])[:, 1:] = 0  # keep the main rows (K = 3)
    flat = LLMRequest(request.input_ids, table, request.mrope_rotary_cos_sin, request.mrope_position_deltas)
    assert float(position_errors(llm.prompt_logits(flat), llm.prompt_logits(request)).max()) > 100 * LOGIT_TOLERANCE


@pytest.mark.parametrize("variant", ["dense", "moe"])
@pytest.mark.parametrize("case", ["text only", "three images between text"])
def test_greedy_generation_matches_generate(variant, case, chains, runtimes):
    chain, llm = chains(variant), runtimes(variant)
    sampling = SamplingParams(max_new_tokens=16, end_ids=END_IDS)
    (result,) = llm.generate([chain.engine_request(CASES[case], sampling)])
    inputs = chain.hf_inputs(CASES[case])
    with torch.no_grad():
        out = chain.hf.generate(**inputs, max_new_tokens=16, do_sample=False, eos_token_id=list(END_IDS))
    expected = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert result.output_ids == expected
    assert result.finish_reason == ("stop" if expected[-1] in END_IDS else "length")


def test_batch_equals_one_by_one(chains, runtimes):
    """Three requests of different lengths (and budgets) decode together as they do alone."""
    chain, llm = chains("moe"), runtimes("moe")
    budgets = {"text only": 12, "one image": 16, "three images between text": 7}
    requests = [
        chain.engine_request(CASES[case], SamplingParams(max_new_tokens=n, end_ids=END_IDS))
        for case, n in budgets.items()
    ]
    assert len({r.input_ids.size for r in requests}) == 3
    alone = [llm.generate([r])[0].output_ids for r in requests]
    together = [r.output_ids for r in llm.generate(requests)]
    assert together == alone
    assert [len(t) for t in together] == list(budgets.values())


def test_requests_joining_a_running_batch_get_their_own_tokens(chains, runtimes):
    """Inflight batching: a request added after others have decoded for a while (with a longer
    budget, so the cache grows) gets the tokens it gets alone, and so do the others."""
    chain, llm = chains("dense"), runtimes("dense")
    first = chain.engine_request(CASES["three images between text"], SamplingParams(max_new_tokens=6))
    second = chain.engine_request(CASES["one image"], SamplingParams(max_new_tokens=10))
    third = chain.engine_request(CASES["text only"], SamplingParams(max_new_tokens=240))
    alone = [llm.generate([r])[0].output_ids for r in (first, second, third)]
    streamed: list[tuple[int, int]] = []
    batch = DecodeBatch(llm, on_token=lambda i, t: streamed.append((i, t)))
    results = [batch.add(first, 0), batch.add(second, 1)]
    for _ in range(3):
        batch.step()
    results.append(batch.add(third, 2))
    steps = 3
    while batch:
        batch.step()
        steps += 1
        assert len(batch) == sum(len(r.output_ids) < n for r, n in zip(results, (6, 10, 240), strict=True))
    assert [r.output_ids for r in results] == alone
    assert steps == 3 + 239 and [t for i, t in streamed if i == 2] == alone[2]


def test_a_rolling_batch_gives_every_request_its_own_tokens(runtimes):
    """Requests join one after another while others leave (the cache's rows and capacity grow
    several times, and rows freed in the middle are refilled), each getting the tokens it gets alone."""
    llm = runtimes("dense")
    rng = np.random.default_rng(0)
    requests = [
        LLMRequest(rng.integers(0, 1000, length).astype(np.int32), sampling=SamplingParams(max_new_tokens=budget))
        for length, budget in [(5, 9), (40, 3), (12, 30), (3, 1), (70, 12), (8, 20), (25, 6), (16, 40)]
    ]
    alone = [llm.generate([r])[0].output_ids for r in requests]
    batch = DecodeBatch(llm)
    results = []
    for index, request in enumerate(requests):
        results.append(batch.add(request, index))
        batch.step()
    while batch:
        batch.step()
    assert [r.output_ids for r in results] == alone


def test_a_batchs_greedy_banned_and_sampled_rows_pick_as_alone(runtimes):
    """One argmax serves a decode batch's greedy rows; a row with a banned token or sampling picks for
    itself: every request gets the tokens it gets alone."""
    llm = runtimes("dense")
    rng = np.random.default_rng(1)
    ids = [rng.integers(0, 1000, n).astype(np.int32) for n in (9, 30, 17)]
    free = llm.generate([LLMRequest(ids[0], sampling=SamplingParams(max_new_tokens=6))])[0].output_ids
    samplings = [
        SamplingParams(max_new_tokens=6, end_ids=(free[1],), min_new_tokens=4),  # free[1] banned for 4 tokens
        SamplingParams(max_new_tokens=6, temperature=2.0, seed=5),
        SamplingParams(max_new_tokens=6),
    ]
    requests = [LLMRequest(i, sampling=s) for i, s in zip(ids, samplings, strict=True)]
    alone = [llm.generate([r])[0].output_ids for r in requests]
    assert [r.output_ids for r in llm.generate(requests)] == alone
    assert free[1] not in alone[0][:4]


class _Stream:
    """A TokenStream that collects what the inflight batcher sends."""

    def __init__(self):
        self.tokens: list[int] = []
        self.errors: list[Exception] = []
        self.responses: list[dict] = []  # what each send carried
        self.done = threading.Event()

    def send(self, tokens, final, log_probs=None, generation_logits=None):
        self.tokens.extend(tokens)
        self.responses.append(dict(tokens=list(tokens), final=final, log_probs=log_probs, logits=generation_logits))
        if final:
            self.done.set()

    def finish(self):
        self.done.set()

    def fail(self, error):
        self.errors.append(error)
        self.done.set()

    def cancelled(self):
        return False


def test_the_inflight_llm_streams_tokens_and_closes_promptly_when_idle(converted, runtimes):
    end_ids = (IM_END_ID, ENDOFTEXT_ID)
    ids = np.arange(5, 25, dtype=np.int32)
    sampling = SamplingParams(max_new_tokens=6, end_ids=end_ids)
    alone = runtimes("dense").generate([LLMRequest(ids, sampling=sampling)])[0].output_ids
    engine = InflightLLM(converted["dense"], end_ids, max_batch_size=4)
    engine.start()
    stream = _Stream()
    inputs = {
        interface.INPUT_IDS.name: ids,
        interface.REQUEST_OUTPUT_LEN.name: np.array([6], np.int32),
        interface.RUNTIME_TOP_K.name: np.array([1], np.int32),
        interface.STREAMING.name: np.array([True]),
    }
    engine.submit(inputs, stream, "request-1")
    assert stream.done.wait(60) and not stream.errors
    assert stream.tokens == [t for t in alone if t not in end_ids]
    time.sleep(0.5)  # idle: the decode loop waits for work
    start = time.monotonic()
    engine.close()
    assert time.monotonic() - start < 5


def test_the_inflight_llm_returns_the_log_probs_of_its_tokens(converted, runtimes):
    """return_log_probs: every response carries the log probs of the tokens generated so far (the end id's left out,
    as its token is), as the tensorrtllm backend sends them; they equal the runtime's for the request alone."""
    end_ids = (IM_END_ID, ENDOFTEXT_ID)
    ids = np.arange(5, 25, dtype=np.int32)
    sampling = SamplingParams(6, temperature=3.0, seed=9, end_ids=end_ids, return_log_probs=True)
    alone = runtimes("dense").generate([LLMRequest(ids, sampling=sampling)])[0]
    kept = [(t, lp) for t, lp in zip(alone.output_ids, alone.log_probs, strict=True) if t not in end_ids]
    engine = InflightLLM(converted["dense"], end_ids, max_batch_size=2)
    engine.start()
    try:
        inputs = {
            interface.INPUT_IDS.name: ids,
            interface.REQUEST_OUTPUT_LEN.name: np.array([6], np.int32),
            interface.TEMPERATURE.name: np.array([3.0], np.float32),
            interface.RUNTIME_TOP_P.name: np.array([1.0], np.float32),
            interface.SEED.name: np.array([9], np.uint64),
            RETURN_LOG_PROBS.name: np.array([True]),
            interface.EXCLUDE_INPUT.name: np.array([True]),
        }
        for streaming in (False, True):
            stream = _Stream()
            engine.submit({**inputs, interface.STREAMING.name: np.array([streaming])}, stream, f"lp-{streaming}")
            assert stream.done.wait(60) and not stream.errors
            assert stream.tokens == [t for t, _ in kept]
            assert stream.responses[-1]["log_probs"] == pytest.approx([lp for _, lp in kept])
            if streaming:  # cumulative: the k-th response has k log probs
                assert [len(r["log_probs"]) for r in stream.responses] == list(range(1, len(kept) + 1))
    finally:
        engine.close()


def test_the_inflight_llm_returns_the_generation_logits_of_its_tokens(converted, runtimes):
    """return_generation_logits: each response carries the raw logits of its tokens in the tensorrtllm backend's
    shapes without the batch dimension ([n, 1, V] streamed, [1, T, V] at the end), which are the runtime's logits at
    those positions (its prompt logits over the prompt and the tokens), with an embedding bias that the sampling
    applies and they do not."""
    end_ids = (IM_END_ID, ENDOFTEXT_ID)
    llm = runtimes("dense")
    ids = np.arange(5, 25, dtype=np.int32)
    bias = np.zeros(llm.vocab_size, np.float32)
    bias[[7, 11]] = 3.0
    engine = InflightLLM(converted["dense"], end_ids, max_batch_size=2)
    engine.start()
    try:
        inputs = {
            interface.INPUT_IDS.name: ids,
            interface.REQUEST_OUTPUT_LEN.name: np.array([5], np.int32),
            interface.RUNTIME_TOP_K.name: np.array([1], np.int32),
            interface.EMBEDDING_BIAS.name: bias,
            interface.RETURN_GENERATION_LOGITS.name: np.array([True]),
            interface.EXCLUDE_INPUT.name: np.array([True]),
        }
        for streaming in (False, True):
            stream = _Stream()
            engine.submit({**inputs, interface.STREAMING.name: np.array([streaming])}, stream, f"logits-{streaming}")
            assert stream.done.wait(60) and not stream.errors
            sent = [r["logits"] for r in stream.responses if r["tokens"]]
            if streaming:
                assert [r.shape for r in sent] == [(1, 1, llm.vocab_size)] * len(stream.tokens)
                rows = np.concatenate([r[:, 0] for r in sent])
            else:
                (whole,) = sent
                assert whole.shape == (1, len(stream.tokens), llm.vocab_size)
                rows = whole[0]
            whole_ids = np.concatenate([ids, np.asarray(stream.tokens[:-1], np.int32)])
            expected = llm.prompt_logits(LLMRequest(whole_ids)).numpy()[len(ids) - 1 :]
            np.testing.assert_allclose(rows, expected, atol=1e-4)
            assert stream.tokens == [int(np.argmax(r + bias)) for r in rows]  # picked from the biased logits
    finally:
        engine.close()


def test_a_batch_penalizes_the_prompt_and_fails_a_broken_guide_alone(runtimes):
    """The batch hands each sampler its prompt: a huge presence penalty keeps every token out of the prompt and
    the tokens before it. A request whose guide fails ends with the error; the others decode as alone."""
    llm = runtimes("dense")
    ids = np.arange(5, 25, dtype=np.int32)
    shy = SamplingParams(8, temperature=1.0, top_k=1, presence_penalty=1e4, return_log_probs=True)
    plain = SamplingParams(8)

    class Broken:
        def mask(self, logits):
            return logits

        def accept(self, token):
            raise ValueError("no grammar")

    results = llm.generate(
        [
            LLMRequest(ids, sampling=shy),
            LLMRequest(ids, sampling=replace(plain, guide=Broken())),
            LLMRequest(ids, sampling=plain),
        ]
    )
    tokens = results[0].output_ids
    assert not set(tokens) & set(ids.tolist()) and len(set(tokens)) == len(tokens) == 8
    assert len(results[0].log_probs) == 8
    assert results[1].finish_reason == "error" and "no grammar" in str(results[1].error) and not results[1].output_ids
    assert results[2].output_ids == llm.generate([LLMRequest(ids, sampling=plain)])[0].output_ids


def test_sampling_is_seeded_and_respects_its_cuts(chains, runtimes):
    chain, llm = chains("dense"), runtimes("dense")

    def tokens(**kw):
        sampling = SamplingParams(max_new_tokens=12, **kw)
        return llm.generate([chain.engine_request(CASES["one image"], sampling)])[0].output_ids

    greedy = tokens()
    hot = dict(temperature=5.0)
    assert tokens(seed=1, **hot) == tokens(seed=1, **hot)
    assert tokens(seed=1, **hot) != tokens(seed=2, **hot)
    assert tokens(seed=1, **hot) != greedy
    assert tokens(top_k=1, seed=3, **hot) == greedy  # only the argmax survives the cut
    assert tokens(top_p=1e-6, seed=3, **hot) == greedy
    # top_k bounds each pick to the k most likely tokens: with k = 2, every token is one of them.
    request = chain.engine_request(CASES["one image"], SamplingParams(max_new_tokens=1, top_k=2, **hot))
    top2 = set(llm.prompt_logits(request)[-1].topk(2).indices.tolist())
    picks = {
        llm.generate([chain.engine_request(CASES["one image"], SamplingParams(1, top_k=2, seed=s, **hot))])[
            0
        ].output_ids[0]
        for s in range(8)
    }
    assert picks <= top2 and len(picks) == 2


def test_end_ids_stop_and_tokens_stream(chains, runtimes):
    chain, llm = chains("dense"), runtimes("dense")
    free = llm.generate([chain.engine_request(CASES["text only"], SamplingParams(max_new_tokens=8))])[0]
    stop_at = free.output_ids[3]
    first = free.output_ids.index(stop_at)
    streamed: list[tuple[int, int]] = []
    sampling = SamplingParams(max_new_tokens=8, end_ids=(stop_at,))
    results = llm.generate(
        [
            chain.engine_request(CASES["text only"], sampling),
            chain.engine_request(CASES["one image"], SamplingParams(max_new_tokens=5)),
        ],
        on_token=lambda index, token: streamed.append((index, token)),
    )
    assert results[0].output_ids == free.output_ids[: first + 1] and results[0].finish_reason == "stop"
    assert results[1].finish_reason == "length" and len(results[1].output_ids) == 5
    for index, result in enumerate(results):
        assert [t for i, t in streamed if i == index] == result.output_ids


def test_contract_violations_are_refused(chains, runtimes):
    chain, llm = chains("dense"), runtimes("dense")
    request = chain.engine_request(CASES["one image"])
    with pytest.raises(InputError, match="no prompt_embedding_table"):
        llm.prompt_logits(LLMRequest(request.input_ids))
    with pytest.raises(InputError, match="has no row"):
        llm.prompt_logits(LLMRequest(request.input_ids, request.prompt_embedding_table[:-4]))
    with pytest.raises(InputError, match="mrope_rotary_cos_sin"):
        llm.prompt_logits(LLMRequest(request.input_ids, request.prompt_embedding_table, np.zeros(10, np.float32)))
    with pytest.raises(InputError, match="positions"):
        llm.generate([LLMRequest(np.array([1, 2, 3], np.int32), sampling=SamplingParams(max_new_tokens=10**7))])
    with pytest.raises(InputError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


# -- rope_index, the CPU chain's request and streaming ------------------------------------------------


def _vision_prompt(grids, seed: int = 0) -> np.ndarray:
    """Text, then each image as vision_start + its image tokens + vision_end, then text (random ids)."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(0, 1000, 5)]
    for t, h, w in grids:
        parts += [[VISION_START_ID], [IMAGE_TOKEN_ID] * (t * h * w // 4), [VISION_END_ID], rng.integers(0, 1000, 3)]
    return np.concatenate(parts).astype(np.int64)


ROPE_GRIDS = {
    "text only": [],
    "one image": [[1, 4, 6]],
    "several images": [[1, 4, 4], [1, 10, 6], [1, 2, 2], [1, 6, 12]],
    "video-like": [[2, 8, 8], [3, 8, 6]],  # several temporal patches (t <= rows and cols, as in videos)
}


@pytest.fixture(scope="module")
def hf_text_model(tiny_dense):
    return load_hf_text_model(tiny_dense)


@pytest.mark.parametrize("case", list(ROPE_GRIDS))
def test_rope_index_matches_get_rope_index(case, hf_text_model):
    ids = _vision_prompt(ROPE_GRIDS[case])
    grids = np.array(ROPE_GRIDS[case], dtype=np.int64).reshape(-1, 3)
    positions, delta = rope_index(ids, grids, IMAGE_TOKEN_ID, merge_size=2)
    expected, expected_delta = hf_rope_index(hf_text_model, ids, grids, IMAGE_TOKEN_ID)
    np.testing.assert_array_equal(positions, expected)
    assert delta == expected_delta


@pytest.fixture(scope="module")
def local_pipeline(tiny_dense, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "build"
    build(tiny_dense, out, log=lambda *_: None)
    return LocalPipeline(tiny_dense, out)


def test_local_request_carries_only_the_prompts_rope_rows(local_pipeline):
    """The CPU chain hands the runtime the prompt's cos/sin rows, not the engine's
    max_position_embeddings-long table (32 MiB here, 128 MiB for released configs), and gets the
    tokens the full engine table gives."""
    pipe = local_pipeline
    messages = CASES["one image"]
    sampling = SamplingParams(max_new_tokens=12)
    request = engine_request(pipe.pre, pipe.encoder, messages, sampling)
    rotary_dim = pipe.llm.config.rotary_dim
    assert request.mrope_rotary_cos_sin.size == request.input_ids.size * rotary_dim
    full_table = pipe.pre(messages).mrope_rotary_cos_sin(pipe.llm.config.max_position_embeddings)
    assert full_table.size == pipe.llm.config.max_position_embeddings * rotary_dim
    engine_sized = replace(request, mrope_rotary_cos_sin=full_table)
    assert [r.output_ids for r in pipe.llm.generate([request, engine_sized])] == [
        pipe.llm.generate([engine_sized])[0].output_ids
    ] * 2


def _cuts_inside_a_character(tokenizer, ids) -> list[int]:
    """The lengths at which ids end inside a multi-byte UTF-8 character."""
    return [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]


MULTIBYTE_TEXT = "Grüße, naïve café — 你好世界 🙂👍🏽 𝄞 done."


def test_streaming_detokenizer_deltas_add_up_to_the_text(local_pipeline):
    tokenizer = local_pipeline.tokenizer
    ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False).ids
    cuts = _cuts_inside_a_character(tokenizer, ids)
    assert cuts  # the text has characters split across tokens
    for tokens in (ids, ids[: cuts[0]]):
        detokenizer = StreamingDetokenizer(tokenizer)
        deltas = [detokenizer.push(token) for token in tokens]
        assert all("\ufffd" not in d for d in deltas)  # a split character is held back until it is whole
        assert "".join(deltas) + detokenizer.finish() == tokenizer.decode(tokens)
    assert tokenizer.decode(ids) == MULTIBYTE_TEXT


def test_streamed_text_is_the_reply_when_generation_stops_inside_a_character(local_pipeline):
    pipe = local_pipeline
    messages = CASES["text only"]
    # Random weights: look for a seed whose sampled reply has a token boundary inside a character.
    for seed in range(32):
        sampling = SamplingParams(max_new_tokens=64, temperature=5.0, seed=seed)
        tokens = pipe.llm.generate([engine_request(pipe.pre, pipe.encoder, messages, sampling)])[0].output_ids
        if cuts := _cuts_inside_a_character(pipe.tokenizer, tokens):
            break
    else:
        pytest.fail("no sampled reply splits a character")
    cut = replace(sampling, max_new_tokens=cuts[0])  # same seed: the same first tokens, stopped there
    deltas: list[str] = []
    reply = pipe.generate(messages, cut, on_text=deltas.append)
    assert reply.text.endswith("\ufffd") and "".join(deltas) == reply.text
    assert reply.token_ids == tokens[: cuts[0]]
