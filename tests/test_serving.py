"""The Triton deployment end to end on a real tritonserver (the CPU target), called over gRPC with
tritonclient, against transformers' generate on the same requests."""

from __future__ import annotations

import json
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
import torch
import tritonclient.grpc as grpcclient
from deployment import LIMITS, SETTINGS, TransformersGreedy, build_cpu_repository
from images import jpeg
from qwen3vl_trt.decoding.detokenize import Detokenizer
from qwen3vl_trt.decoding.guides import Guide
from qwen3vl_trt.hf.reference import hf_greedy_log_softmax
from qwen3vl_trt.preprocess import Preprocessor
from qwen3vl_trt.qa.tiny import ENDOFTEXT_ID, IM_END_ID, synthetic_video
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.client import Client, InferenceError
from qwen3vl_trt.serving.ports import free_ports
from qwen3vl_trt.serving.request import GUIDE_TEXT, LOGIT_BIAS_IDS, LOGIT_BIAS_WEIGHTS, GenerationRequest
from qwen3vl_trt.serving.server.tritonserver import TritonServer
from videos import audio_only, clip, corrupt_middle, ffv1_mkv

pytestmark = [pytest.mark.slow, pytest.mark.server]

END_IDS = (IM_END_ID, ENDOFTEXT_ID)


class Deployment:
    def __init__(self, model_dir, root):
        self.model_dir = model_dir
        self.server = TritonServer(build_cpu_repository(model_dir, root), free_ports(), log_path=root / "server.log")
        self.server.start()
        self.server.wait_ready()
        self.url = self.server.url
        self.greedy = TransformersGreedy(model_dir, END_IDS)

    def client(self) -> Client:
        return Client(self.url, timeout_s=120)

    def expected(self, prompt, images=(), max_tokens=16, videos=()) -> list[int]:
        """transformers' greedy tokens for the same request (end ids dropped, as the server does)."""
        return self.greedy.tokens(prompt, images, max_tokens, videos)

    def expected_log_softmax(self, prompt, images=(), max_tokens=16) -> tuple[list[int], np.ndarray]:
        """transformers' greedy tokens for the same request and the log-softmax of the model's logits at each."""
        inputs = self.greedy.inputs(prompt, images)
        return hf_greedy_log_softmax(self.greedy.model, inputs, max_tokens, END_IDS)

    def statistics(self, model: str) -> dict:
        stats = self.client().grpc.get_inference_statistics(model_name=model, as_json=True)
        return stats["model_stats"][0]


@pytest.fixture(scope="module")
def dense(checkpoints, tmp_path_factory):
    deployment = Deployment(checkpoints["dense"], tmp_path_factory.mktemp("serve-dense"))
    yield deployment
    deployment.server.stop()


PHOTO = jpeg(64, 96, seed=1)


@pytest.mark.parametrize("images", [[PHOTO], []], ids=["one image", "text only"])
def test_greedy_tokens_equal_transformers_generate(dense, images):
    answer = dense.client().generate("Describe this picture.", images, max_tokens=16)
    assert answer.token_ids == dense.expected("Describe this picture.", images)
    assert answer.text


CLIP = clip("h264 3 s 10 fps")
WEBM = clip("vp9 webm 25 fps odd size", seed=2)


@pytest.mark.parametrize(
    "images, videos",
    [([], [CLIP]), ([PHOTO], [WEBM]), ([], [CLIP, WEBM])],
    ids=["video", "image and video", "2 videos"],
)
def test_video_greedy_tokens_equal_transformers_generate(dense, images, videos):
    answer = dense.client().generate("What happens?", images, max_tokens=16, videos=videos)
    assert answer.token_ids == dense.expected("What happens?", images, videos=videos)


def test_moe_greedy_tokens_equal_transformers_generate(checkpoints, tmp_path):
    moe = Deployment(checkpoints["moe"], tmp_path)
    try:
        images = [jpeg(96, 64, seed=5), PHOTO]
        answer = moe.client().generate("Compare the two images.", images, max_tokens=16)
        assert answer.token_ids == moe.expected("Compare the two images.", images)
        answer = moe.client().generate("What moves?", [PHOTO], max_tokens=16, videos=[CLIP])
        assert answer.token_ids == moe.expected("What moves?", [PHOTO], videos=[CLIP])
    finally:
        moe.server.stop()


def test_streaming_sends_the_same_text_as_deltas(dense):
    client = dense.client()
    whole = client.generate("Describe this picture.", [PHOTO], max_tokens=16)
    pieces: list[str] = []
    streamed = client.generate("Describe this picture.", [PHOTO], max_tokens=16, stream=True, on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == streamed.text == whole.text
    assert streamed.token_ids == whole.token_ids


@pytest.mark.parametrize(
    "prompt, images, options",
    [
        ("Describe this picture.", [PHOTO], {"max_tokens": 16, "return_log_probs": True}),
        ("Go on.", [], {"max_tokens": 400, "min_tokens": 400}),
        ("Describe this picture.", [PHOTO], {"max_tokens": 8, "top_logprobs": 3}),
    ],
    ids=["image, log probs", "long stream", "image, top logprobs"],
)
def test_the_tokens_ensemble_decoded_by_the_client_equals_the_text_ensemble(dense, prompt, images, options):
    """Clients that decode the ids themselves (the tokens ensemble, no postprocessing step per streamed token) get the
    text, ids and log probabilities that the ensemble decoding in the server gives, streamed or not; the streamed
    pieces concatenate to the whole text."""
    text_client = dense.client()
    tokens_client = Client(dense.url, timeout_s=120, detokenizer=Detokenizer.from_model_dir(dense.model_dir))
    assert tokens_client.model == interface.TOKENS_ENSEMBLE
    expected = text_client.generate(prompt, images, **options)
    assert expected.text
    if "min_tokens" in options:
        assert len(expected.token_ids) == options["max_tokens"]
    assert text_client.generate(prompt, images, stream=True, **options) == expected
    for stream in (False, True):
        pieces: list[str] = []
        got = tokens_client.generate(prompt, images, stream=stream, on_text=pieces.append, **options)
        assert got == expected
        assert "".join(pieces) == expected.text
        # A request with top_logprobs is streamed by the engine either way (one row of logits per response).
        assert len(pieces) > 1 if stream or "top_logprobs" in options else len(pieces) == 1
    if options.get("return_log_probs") or options.get("top_logprobs"):
        assert len(expected.log_probs) == len(expected.token_ids)
    if options.get("top_logprobs"):
        assert [len(top) for top in expected.top] == [options["top_logprobs"]] * len(expected.token_ids)


@pytest.mark.parametrize("k, stream", [(1, False), (5, True)])
def test_top_logprobs_equal_transformers_log_softmax(dense, k, stream):
    """Each generated token's k alternatives, and its own log probability, are transformers' log-softmax of the
    model's logits at that step (greedy, so the token is the likeliest), within 1e-4."""
    client = Client(dense.url, timeout_s=120, detokenizer=Detokenizer.from_model_dir(dense.model_dir))
    answer = client.generate("Describe this picture.", [PHOTO], max_tokens=8, top_logprobs=k, stream=stream)
    tokens, log_softmax = dense.expected_log_softmax("Describe this picture.", [PHOTO], max_tokens=8)
    assert answer.token_ids == tokens
    for token, chosen, top, row in zip(tokens, answer.log_probs, answer.top, log_softmax, strict=True):
        likeliest = np.argsort(-row, kind="stable")[:k]
        assert [t for t, _ in top] == likeliest.tolist() and top[0][0] == token
        np.testing.assert_allclose([p for _, p in top], row[likeliest], atol=1e-4)
        assert chosen == pytest.approx(float(row[token]), abs=1e-4)


def test_seed_makes_sampling_reproducible(dense):
    client = dense.client()

    def sample(seed):
        return client.generate("Hello!", max_tokens=12, temperature=1.0, top_k=50, seed=seed).token_ids

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    assert sample(7) != client.generate("Hello!", max_tokens=12).token_ids


MIXED = [
    ("One image.", [jpeg(64, 96, seed=10)]),
    ("Two images.", [jpeg(32, 32, seed=11), jpeg(128, 64, seed=12)]),
    ("No image at all, just text.", []),
    ("A larger one.", [jpeg(160, 128, seed=13)]),
    ("Three small ones.", [jpeg(32, 64, seed=14), jpeg(64, 32, seed=15), jpeg(48, 48, seed=16)]),
    ("Another.", [jpeg(96, 96, seed=17)]),
]


def _concurrently(deployment, requests, **options):
    def one(request):
        return deployment.client().generate(request[0], request[1], max_tokens=8, **options)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def _largest_batch(stats: dict) -> int:
    return max((int(b["batch_size"]) for b in stats.get("batch_stats", [])), default=0)


def test_concurrent_mixed_requests_are_batched_and_equal_sequential_results(dense):
    client = dense.client()
    alone = [client.generate(prompt, images, max_tokens=8) for prompt, images in MIXED]
    # With no queue delay (the default), requests meet in a batch when they queue while the model executes; on a
    # busy machine the threads' requests can arrive one by one, so they are sent together up to a few times.
    for _ in range(5):
        together = _concurrently(dense, MIXED)
        assert [a.token_ids for a in together] == [a.token_ids for a in alone]
        assert [a.text for a in together] == [a.text for a in alone]
        if _largest_batch(dense.statistics(interface.PREPROCESSING)) > 1:
            break
    # The vision encoder gets one request per preprocessing batch, holding the images of all its requests.
    assert _largest_batch(dense.statistics(interface.PREPROCESSING)) > 1, "preprocessing never batched requests"


def test_bad_requests_fail_alone_and_the_server_stays_ready(dense):
    client = dense.client()
    good = [("Describe.", [jpeg(64, 64, seed=20)]), ("Hello there.", [])]
    expected = [client.generate(p, i, max_tokens=8).token_ids for p, i in good]
    bad = {
        "broken image": dict(prompt="Look.", images=[PHOTO[: len(PHOTO) // 3]]),
        "too many images": dict(prompt="Many.", images=[jpeg(32, 32, seed=s) for s in range(17)]),
        "too long": dict(prompt="word " * 1500, images=[]),
    }
    messages = {
        "broken image": "image",
        "too many images": "17 images",
        "too long": "limit is 1024",
    }

    def run(item):
        name, request = item
        if name in good_names:
            prompt, images = request
            return client_for().generate(prompt, images, max_tokens=8).token_ids
        try:
            client_for().generate(**{"max_tokens": 8, **request})
        except InferenceError as e:
            return str(e)
        return "no error"

    good_names = {f"good {i}" for i in range(len(good))}
    items = [*((f"good {i}", g) for i, g in enumerate(good)), *bad.items()]
    local = threading.local()

    def client_for():
        if not hasattr(local, "client"):
            local.client = dense.client()
        return local.client

    with ThreadPoolExecutor(len(items)) as pool:
        results = dict(zip([name for name, _ in items], pool.map(run, items), strict=True))
    assert [results[f"good {i}"] for i in range(len(good))] == expected
    for name, fragment in messages.items():
        assert fragment in results[name], f"{name}: {results[name]}"
    assert client.is_ready()
    assert client.generate("Still here?", max_tokens=4).token_ids


BAD_VIDEOS = {
    "truncated": (CLIP[:5000], "video 0: not a readable video container"),
    "corrupt frames": (corrupt_middle(clip("h264 portrait 30 fps, keyframe every 12, B-frames")), "video 0"),
    "zero-length": (b"", "video 0: empty bytes"),
    "audio only": (audio_only(), "no video stream (streams: audio)"),
    "unsupported codec": (ffv1_mkv(), "codec 'ffv1' is not supported"),
    "over the duration limit": (synthetic_video(3700, 32, 32, 1), "over the limit of 3600 s"),
}


def test_bad_videos_fail_alone_while_their_batch_succeeds(dense):
    good = [("What happens?", [], [CLIP]), ("Describe.", [PHOTO], [])]
    expected = [dense.client().generate(p, i, max_tokens=8, videos=v).token_ids for p, i, v in good]
    items = [("good", g) for g in good] + [(name, ("Watch.", [], [data])) for name, (data, _) in BAD_VIDEOS.items()]
    for _ in range(5):  # until some bad and good requests met in one preprocessing batch

        def run(item):
            _, (prompt, images, videos) = item
            try:
                return dense.client().generate(prompt, images, max_tokens=8, videos=videos).token_ids
            except InferenceError as e:
                return str(e)

        with ThreadPoolExecutor(len(items)) as pool:
            results = list(pool.map(run, items))
        assert results[: len(good)] == expected
        for (name, _), result in zip(items[len(good) :], results[len(good) :], strict=True):
            assert BAD_VIDEOS[name][1] in result, f"{name}: {result}"
        if _largest_batch(dense.statistics(interface.PREPROCESSING)) > 1:
            break
    assert dense.client().is_ready()


def test_infer_cli_takes_videos_and_exits_2_on_a_bad_one(dense, capsys, tmp_path):
    from qwen3vl_trt.cli import main

    good, bad = tmp_path / "clip.mp4", tmp_path / "song.mp4"
    good.write_bytes(CLIP)
    bad.write_bytes(audio_only())
    args = ["infer", "--url", dense.url, "--prompt", "What happens?", "--max-tokens", "16", "--json"]
    assert main([*args, "--video", str(good)]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == dense.expected("What happens?", videos=[CLIP])
    assert main([*args, "--video", str(bad)]) == 2
    assert "no video stream (streams: audio)" in capsys.readouterr().err


def test_load_8_clients_20_requests_no_failures_no_memory_growth(dense):
    requests = [("Describe.", [jpeg(64, 64, seed=30)]), ("Hi!", []), ("Two.", [jpeg(32, 64, seed=31)] * 2)]
    client = dense.client()
    expected = [client.generate(p, i, max_tokens=4).token_ids for p, i in requests]
    _concurrently(dense, requests * 3)  # a full batch once: buffers reach their working size
    server = psutil.Process(dense.server.pid)

    def rss() -> int:
        return sum(p.memory_info().rss for p in [server, *server.children(recursive=True)])

    done = []
    samples: dict[str, int] = {}
    lock = threading.Lock()
    total = 8 * 20

    def worker(w):
        c, failures = dense.client(), []
        for k in range(20):
            prompt, images = requests[(w + k) % len(requests)]
            if c.generate(prompt, images, max_tokens=4).token_ids != expected[(w + k) % len(requests)]:
                failures.append((w, k))
            with lock:
                done.append(1)
                if len(done) == total // 4:
                    samples["first quarter"] = rss()
        return failures

    with ThreadPoolExecutor(8) as pool:
        failures = [f for fs in pool.map(worker, range(8)) for f in fs]
    samples["end"] = rss()
    assert failures == []
    growth = samples["end"] - samples["first quarter"]
    assert growth < 0.10 * samples["first quarter"], f"memory grew by {growth / 2**20:.0f} MiB: {samples}"


def _infer_model(url, model, arrays: dict[str, np.ndarray]):
    """One request to one model, over a stream (decoupled models, preprocessing among them, answer only there)."""
    client = grpcclient.InferenceServerClient(url)
    inputs = []
    for name, array in arrays.items():
        spec = grpcclient.InferInput(
            name, list(array.shape), "BYTES" if array.dtype == object else grpcclient.np_to_triton_dtype(array.dtype)
        )
        spec.set_data_from_numpy(array)
        inputs.append(spec)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer(model, inputs)
        result, error = answers.get(timeout=120)
    finally:
        client.stop_stream()
        client.close()
    assert error is None, error
    return result


def test_tensors_cross_every_model_intact(dense):
    """Known values through each model directly: the python backend's tensors arrive and leave as sent."""
    from qwen3vl_trt.serving.stages.preprocessing import Preprocessing
    from qwen3vl_trt.serving.stages.vision_batching import VisionBatching

    sent = GenerationRequest(
        prompt="What is this?",
        max_tokens=5,
        images=(PHOTO,),
        stop_words=("stop here",),
        seed=2**63 + 5,
        temperature=0.5,
        # What the OpenAI gateway sends on to the engine: penalties, log probs, a guide, a logit bias, tools.
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        repetition_penalty=1.5,
        return_log_probs=True,
        guide=Guide("ebnf_grammar", 'root ::= "yes" | "no"'),
        tools=[{"type": "function", "function": {"name": "f"}}],
    ).named_inputs()
    # A logit bias as a gRPC client may send it, an id twice: the stage sums its biases.
    sent[LOGIT_BIAS_IDS.name] = np.array([7, 151645, 7], np.int32)
    sent[LOGIT_BIAS_WEIGHTS.name] = np.array([1.5, -100.0, 0.5], np.float32)
    request = {name: array[None] for name, array in sent.items()}
    served = _infer_model(dense.url, interface.PREPROCESSING, request)
    hidden_size = served.as_numpy(interface.PROMPT_TABLE.name).shape[-1]
    component = Preprocessing(dense.model_dir, LIMITS, torch.float32, hidden_size)
    prepared = component.execute([{k: v[0] for k, v in request.items()}])[0]
    vision_inputs = component.vision_request(prepared.to_encode)
    build_dir = dense.server.repo.parent
    batching = VisionBatching(build_dir / "vision", torch.float32, hidden_size, SETTINGS.attention_budget_bytes)
    encoded = batching.execute([vision_inputs])[0][interface.PROMPT_TABLE.name]
    local = component.finish(prepared, component.split_rows(encoded, prepared.to_encode))
    for tensor in interface.PREPROCESSING_OUTPUTS:
        ours = np.asarray(local[tensor.name])
        theirs = served.as_numpy(tensor.name)[0]
        np.testing.assert_array_equal(theirs, ours, err_msg=tensor.name)
        assert theirs.dtype == ours.dtype, tensor.name
    assert int(served.as_numpy(interface.SEED.name)[0, 0]) == 2**63 + 5
    bias = served.as_numpy(interface.EMBEDDING_BIAS.name)[0]  # one entry per vocabulary id, repeats summed
    assert bias.shape == (Preprocessor.from_pretrained(dense.model_dir).info.text.vocab_size,)
    assert (bias[7], bias[151645], np.count_nonzero(bias)) == (2.0, -100.0, 2)
    assert served.as_numpy(GUIDE_TEXT.name)[0, 0] == b'root ::= "yes" | "no"'

    sent = {name: np.asarray(value)[None] for name, value in vision_inputs.items()}
    table = _infer_model(dense.url, interface.VISION_ENCODER, sent).as_numpy(interface.PROMPT_TABLE.name)[0]
    np.testing.assert_array_equal(table, encoded.numpy())

    ids = np.array([[3, 1, 4, 1, 5, 9, 2, 6]], np.int32)
    out = _infer_model(
        dense.url,
        interface.POSTPROCESSING,
        {interface.LLM_OUTPUT_IDS.name: ids[:, None], interface.SEQUENCE_LENGTH.name: np.array([[8]], np.int32)},
    )
    tokenizer = Preprocessor.from_pretrained(dense.model_dir).prompts.tokenizer
    assert out.as_numpy(interface.TEXT_OUTPUT.name)[0, 0].decode() == tokenizer.decode(ids[0].tolist())
    np.testing.assert_array_equal(out.as_numpy(interface.OUTPUT_IDS_OUT.name)[0], ids[0])


def test_every_generated_config_parses_and_the_ensemble_routes_every_tensor(dense):
    from qwen3vl_trt.serving.repository import model_config as cfg

    repo = dense.server.repo
    configs = {name: cfg.read(repo / name) for name in interface.MODELS}
    assert {name: c.name for name, c in configs.items()} == {name: name for name in interface.MODELS}
    for name in (interface.ENSEMBLE, interface.TOKENS_ENSEMBLE):
        ensemble = configs[name]
        produced = {t.name for t in ensemble.input}
        for step in ensemble.ensemble_scheduling.step:
            model = configs[step.model_name]
            declared = {t.name for t in model.input}
            assert set(step.input_map) <= declared
            assert {t.name for t in model.input if not t.optional} <= set(step.input_map), step.model_name
            assert set(step.input_map.values()) <= produced, step.model_name
            assert set(step.output_map) <= {t.name for t in model.output}
            produced |= set(step.output_map.values())
        assert {t.name for t in ensemble.output} <= produced
    ensembles = (interface.ENSEMBLE, interface.TOKENS_ENSEMBLE)
    steps = {name: [s.model_name for s in configs[name].ensemble_scheduling.step] for name in ensembles}
    assert steps == {
        interface.ENSEMBLE: [interface.PREPROCESSING, interface.LLM, interface.POSTPROCESSING],
        interface.TOKENS_ENSEMBLE: [interface.PREPROCESSING, interface.LLM],  # no python step per streamed token
    }
    assert configs[interface.LLM].model_transaction_policy.decoupled
    record = (
        json.loads((repo / "qwen3vl_repository.json").read_text())
        if (repo / "qwen3vl_repository.json").exists()
        else None
    )
    assert record is None  # the build's own repository is recorded in its manifest
    manifest = json.loads((repo.parent / "manifest.json").read_text())
    assert manifest["target"] == "cpu" and manifest["limits"]["max_input_len"] == LIMITS.max_input_len


def test_infer_cli_prints_the_answer_as_json(dense, capsys, tmp_path):
    from qwen3vl_trt.cli import main

    photo = tmp_path / "photo.jpg"
    photo.write_bytes(PHOTO)
    assert (
        main(
            [
                "infer",
                "--url",
                dense.url,
                "--image",
                str(photo),
                "--prompt",
                "Describe this picture.",
                "--max-tokens",
                "16",
                "--json",
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed["token_ids"] == dense.expected("Describe this picture.", [PHOTO])
    time.sleep(0)
