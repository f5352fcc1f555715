"""The generation request, declared once (serving.request): what a client sends is what the stage reads, each bound
is checked where the request is built with one message, and a sampling option added to the one module reaches the
deployment's configs, the stage's llm inputs and the CPU llm with no edit elsewhere."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
from deployment import LIMITS
from images import jpeg
from qwen3vl_trt.decoding.guides import Guide
from qwen3vl_trt.errors import MessageError, PromptTooLongError, RequestError
from qwen3vl_trt.preprocess.prompts import normalize_messages
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.client import request_inputs
from qwen3vl_trt.serving.request import GUIDE_TYPE, GenerationRequest
from qwen3vl_trt.serving.stages.preprocessing import Preprocessing
from videos import clip

REPO = Path(__file__).resolve().parents[1]

FULL = GenerationRequest(
    prompt="Describe both.",
    max_tokens=12,
    images=(b"\xff\xd8jpeg",),
    videos=(b"mp4",),
    messages=[{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Hi"}]}],
    tools=[{"type": "function", "function": {"name": "f"}}],
    stream=True,
    exclude_input_in_output=False,
    temperature=0.75,  # float32 values, as they travel
    top_k=5,
    top_p=0.875,
    seed=2**63 + 5,
    end_id=3,
    pad_id=4,
    stop_words=("stop", "halt"),
    bad_words=("bad",),
    presence_penalty=-0.5,
    frequency_penalty=0.25,
    repetition_penalty=1.25,
    return_log_probs=True,
    logit_bias={7: 1.5, 11: -100.0},
    guide=Guide("regex", "[ab]+"),
)


def test_what_a_client_sends_is_what_the_stage_reads():
    sent = {tensor.name: array for tensor, array in FULL.to_inputs().items()}
    assert GenerationRequest.from_inputs(sent) == FULL
    # As Triton hands a stage a batch of one, and as the gRPC client sends it.
    assert GenerationRequest.from_inputs({name: array[None] for name, array in sent.items()}) == FULL
    grpc = {i.name(): i for i in request_inputs(FULL)}
    assert set(grpc) == set(sent) and all(grpc[name].shape() == [1, *sent[name].shape] for name in sent)


def test_only_the_required_inputs_and_what_differs_from_the_defaults_are_sent():
    sent = GenerationRequest(prompt="Hi.", max_tokens=4).to_inputs()
    assert {t.name for t in sent} == {"text_input", "max_tokens"}
    assert GenerationRequest.from_inputs({t.name: a for t, a in sent.items()}) == GenerationRequest("Hi.", 4)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("max_tokens", 0, "at least 1"),
        ("max_tokens", None, "required"),
        ("max_tokens", 2**31, "below 2**31"),
        ("top_k", 2**40, "below 2**31"),
        ("temperature", -0.5, ">= 0"),
        ("top_k", -1, ">= 0"),
        ("top_p", 0.0, "in (0, 1]"),
        ("top_p", 1.5, "in (0, 1]"),
        ("seed", -1, "in [0, 2**64)"),
        ("seed", 2**64, "in [0, 2**64)"),
        ("min_tokens", -2, ">= 0"),
        ("end_id", -1, ">= 0"),
        ("repetition_penalty", 0.0, "> 0"),
        ("presence_penalty", float("nan"), "finite"),
        ("stop_words", ("ok", ""), "non-empty strings"),
        ("logit_bias", {-1: 1.0}, "token ids >= 0"),
        ("logit_bias", {1: float("inf")}, "finite biases"),
    ],
)
def test_every_bound_is_refused_with_the_field_named(field, value, words):
    with pytest.raises(RequestError, match=field if field != "logit_bias" else "logit_bias") as refused:
        GenerationRequest(**{"prompt": "Hi.", "max_tokens": 4, field: value})
    assert refused.value.field == field and words in str(refused.value)


def test_the_rules_across_fields():
    with pytest.raises(MessageError, match="raw_prompt"):
        GenerationRequest("Hi.", 4, raw_prompt=True, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(RequestError, match="min_tokens cannot go with a guide") as refused:
        GenerationRequest("Hi.", 4, min_tokens=2, guide=Guide("json", ""))
    assert refused.value.field == "min_tokens"
    with pytest.raises(RequestError, match="not a token id below 100"):
        GenerationRequest("Hi.", 4, logit_bias={100: 1.0}).check_vocabulary(100)
    GenerationRequest("Hi.", 4, logit_bias={99: 1.0}).check_vocabulary(100)
    with pytest.raises(PromptTooLongError, match="maximum context length is 64 tokens; the prompt takes 60") as long:
        GenerationRequest("Hi.", 5).check_length(60, 64)
    assert long.value.field == "max_tokens"
    GenerationRequest("Hi.", 4).check_length(60, 64)


def test_inputs_a_client_could_not_have_built_are_refused_by_the_stage_reading():
    base = GenerationRequest("Hi.", 4).named_inputs()
    with pytest.raises(RequestError, match="lacks the required input.s. max_tokens"):
        GenerationRequest.from_inputs({"text_input": base["text_input"]})
    with pytest.raises(RequestError, match="max_tokens must hold one value, got 2"):
        GenerationRequest.from_inputs({**base, "max_tokens": np.array([4, 5], np.int32)})
    with pytest.raises(MessageError, match="messages is not valid JSON"):
        GenerationRequest.from_inputs({**base, "messages": np.array([b"[{"], object)})
    with pytest.raises(RequestError, match="as many weights as ids, got 1 and 2"):
        GenerationRequest.from_inputs(
            {**base, "logit_bias_ids": np.array([1, 2], np.int32), "logit_bias_weights": np.array([1.0], np.float32)}
        )
    with pytest.raises(RequestError, match="guided_decoding_guide was sent without guided_decoding_guide_type"):
        GenerationRequest.from_inputs({**base, "guided_decoding_guide": np.array([b"[ab]+"], object)})
    only_type = GenerationRequest.from_inputs({**base, GUIDE_TYPE.name: np.array([b"json"], object)})
    assert only_type.guide == Guide("json", "")


def test_the_chat_places_the_media_and_leaves_the_request_as_sent():
    chat = FULL.chat()
    assert chat[0]["content"][0] == {"type": "image", "image": b"\xff\xd8jpeg"}
    assert chat[0]["content"][1] == {"type": "video", "video": b"mp4"}
    assert chat[-1] == {"role": "user", "content": "Describe both."}
    assert "image" not in FULL.messages[0]["content"][0]
    with pytest.raises(MessageError, match="1 of the 1 images sent have no image part"):
        GenerationRequest("Hi.", 4, images=(b"x",), messages=[{"role": "user", "content": "Hi"}]).chat()


# -- one module: a throwaway option ------------------------------------------------------------------

THROWAWAY = (
    '    throwaway_knob: float | None = _wire("throwaway_knob", "FP32", None, check=math.isfinite, bound="finite", '
    "engine=True)\n"
)
PROBE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import qwen3vl_trt
    import torch
    from qwen3vl_trt.common.contracts import BuildLayout
    from qwen3vl_trt.common.limits import EngineLimits
    from qwen3vl_trt.llm.checkpoint_format import read_trtllm_config
    from qwen3vl_trt.serving import interface
    from qwen3vl_trt.serving.client import request_inputs
    from qwen3vl_trt.serving.repository.writer import model_configs
    from qwen3vl_trt.serving.request import GenerationRequest
    from qwen3vl_trt.serving.stages.preprocessing import Preprocessing

    model_dir, build_dir = Path(sys.argv[1]), Path(sys.argv[2])
    request = GenerationRequest(prompt="Hi.", max_tokens=4, throwaway_knob=0.5)
    layout = BuildLayout(build_dir)
    _, llm = read_trtllm_config(layout.llm_checkpoint)
    configs = model_configs(layout, model_dir, "cpu", EngineLimits(), llm)
    stage = Preprocessing(model_dir, EngineLimits(), torch.float32, 64)
    (prepared,) = stage.execute([request.named_inputs()])
    names = lambda tensors: sorted(t.name for t in tensors)
    print(json.dumps({
        "package": qwen3vl_trt.__file__,
        "client": sorted(i.name() for i in request_inputs(request)),
        "ensemble": names(configs[interface.ENSEMBLE].input),
        "preprocessing_out": names(configs[interface.PREPROCESSING].output),
        "llm_in": names(configs[interface.LLM].input),
        "stage": {k: v.tolist() for k, v in prepared.outputs.items() if k.startswith("throwaway")},
    }))
    """
)


@pytest.mark.slow
def test_a_sampling_option_added_to_the_one_module_reaches_the_stage_and_the_cpu_llm(
    tmp_path, tiny_dense, cpu_repository
):
    package = tmp_path / "qwen3vl_trt"
    shutil.copytree(REPO / "build", package, ignore=shutil.ignore_patterns("__pycache__"))
    module = package / "serving" / "request.py"
    source = module.read_text()
    anchor = next(line for line in source.splitlines(keepends=True) if line.lstrip().startswith("return_log_probs:"))
    module.write_text(source.replace(anchor, anchor + THROWAWAY))
    (tmp_path / "probe.py").write_text(PROBE)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "probe.py"), str(tiny_dense), str(cpu_repository.parent)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["package"].startswith(str(package))
    for where in ("client", "ensemble", "preprocessing_out", "llm_in"):
        assert "throwaway_knob" in seen[where], where
    assert seen["stage"] == {"throwaway_knob": [0.5]}


# -- the stage's engine mapping ---------------------------------------------------------------------


def test_the_stage_maps_the_request_onto_the_engines_inputs(tiny_dense):
    stage = Preprocessing(tiny_dense, LIMITS, torch.float32, 64)
    greedy = GenerationRequest("Hi.", 4, top_k=7, temperature=0.0, presence_penalty=0.5).named_inputs()
    sampled = GenerationRequest("Hi.", 4, top_k=7, top_p=0.8, temperature=0.6, logit_bias={5: 2.0}).named_inputs()
    first, second = stage.execute([greedy, sampled])
    assert not isinstance(first, Exception) and not isinstance(second, Exception)
    assert (first.outputs[interface.RUNTIME_TOP_K.name][0], first.outputs[interface.TEMPERATURE.name][0]) == (1, 1.0)
    assert first.outputs["presence_penalty"].tolist() == [0.5] and "presence_penalty" not in second.outputs
    assert second.outputs[interface.RUNTIME_TOP_K.name][0] == 7
    assert second.outputs[interface.RUNTIME_TOP_P.name][0] == pytest.approx(0.8)
    bias = second.outputs[interface.EMBEDDING_BIAS.name]
    assert bias[5] == 2.0 and np.count_nonzero(bias) == 1
    assert first.outputs[interface.EXCLUDE_INPUT.name].tolist() == [True]  # the product's default


def test_sampling_field_names_are_spelled_in_the_one_module_and_the_engine_mapping():
    """No string literal in the serving code names a sampling field of the request, outside the request's module,
    the engine mapping (the preprocessing stage; the CPU llm, which reads the tensorrt_llm inputs as the backend does;
    interface, which declares those inputs) and the OpenAI protocol, whose parameters bear the same names."""
    content = {"prompt", "prompt_ids", "max_tokens", "images", "videos", "messages", "raw_prompt", "tools", "stream"}
    # priority travels as the gRPC request's own field, under tritonclient's name for it (client.stream_request).
    sampling = {f.name for f in fields(GenerationRequest)} - content - {"priority"}
    mapping = ("request.py", "interface.py", "stages/preprocessing.py", "stages/cpu_llm.py", "gateway/protocol.py")
    allowed = {REPO / "build/serving" / name for name in mapping}
    found = []
    for path in sorted((REPO / "build/serving").rglob("*.py")):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in sampling:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    assert not found, found


# -- the prompt prepared once ---------------------------------------------------------------------------


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _gateway_request(stage: Preprocessing, messages: list, **extra) -> GenerationRequest:
    """What the gateway sends for these messages: the prompt rendered and tokenized once (gateway.planning)."""
    chat = normalize_messages(messages)
    ids, _ = stage.pre.prompt_ids(chat, **extra)
    return GenerationRequest(prompt_ids=ids, images=chat.images, videos=chat.videos, max_tokens=4)


def test_the_stage_neither_renders_nor_tokenizes_a_prompt_sent_tokenized(tiny_dense, monkeypatch):
    stage = Preprocessing(tiny_dense, LIMITS, torch.float32, 64)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": jpeg(96, 64, seed=3)}, _text("Hm?")]},
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": [{"type": "video", "video": clip("h264 3 s 10 fps")}, _text("And?")]},
    ]
    chat = normalize_messages(messages)  # the parts without their media, which travel apart
    sent_as_messages = GenerationRequest(messages=chat.messages, images=chat.images, videos=chat.videos, max_tokens=4)
    sent_tokenized = _gateway_request(stage, messages)
    (expected,) = stage.execute([sent_as_messages.named_inputs()])

    def never(*_args, **_kwargs):
        raise AssertionError("the stage rendered or tokenized a prompt sent tokenized")

    monkeypatch.setattr(stage.pre.prompts, "_render", never)
    monkeypatch.setattr(stage.pre.prompts, "_encode", never)
    (got,) = stage.execute([sent_tokenized.named_inputs()])
    assert not isinstance(expected, Exception) and not isinstance(got, Exception), (expected, got)
    assert set(got.outputs) == set(expected.outputs)
    for name, array in expected.outputs.items():
        np.testing.assert_array_equal(np.asarray(got.outputs[name]), np.asarray(array), err_msg=name)
    assert [(v.kind, v.digest, v.grid) for v in got.visual] == [(v.kind, v.digest, v.grid) for v in expected.visual]


def test_prompt_ids_that_do_not_match_their_media_are_refused(tiny_dense):
    stage = Preprocessing(tiny_dense, LIMITS, torch.float32, 64)
    image = [{"role": "user", "content": [{"type": "image", "image": jpeg(64, 64, seed=1)}]}]
    good = _gateway_request(stage, image)
    moving = [{"role": "user", "content": [{"type": "video", "video": clip("h264 3 s 10 fps")}]}]
    video = _gateway_request(stage, moving)
    frames = np.flatnonzero(np.asarray(video.prompt_ids) == stage.pre.info.video_token_id)
    bad = {
        "no image for the placeholder": GenerationRequest(prompt_ids=good.prompt_ids, max_tokens=4),
        "an id outside the vocabulary": GenerationRequest(
            prompt_ids=(*good.prompt_ids, 10**7), images=good.images, max_tokens=4
        ),  # fmt: skip
        "a frame's placeholder missing": GenerationRequest(
            prompt_ids=np.delete(np.asarray(video.prompt_ids), frames[-1]), videos=video.videos, max_tokens=4
        ),
    }
    words = {
        "no image for the placeholder": "1 image placeholder(s) but 0 image(s)",
        "an id outside the vocabulary": "token ids below",
        "a frame's placeholder missing": "one video placeholder for each of the videos",
    }
    results = stage.execute([request.named_inputs() for request in bad.values()])
    for name, result in zip(bad, results, strict=True):
        assert isinstance(result, MessageError) and words[name] in str(result), (name, result)
    with pytest.raises(MessageError, match="prompt_ids are the whole prompt"):
        GenerationRequest(prompt="Hi.", prompt_ids=good.prompt_ids, max_tokens=4)
