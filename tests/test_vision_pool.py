"""The vision pool on real tritonservers (the CPU target): two members serving only preprocessing and the vision
encoder (`serve --role vision`'s models) and a replica sending them what its visual cache does not hold
(`--vision-pool`): the replica's answers equal transformers' greedy tokens for an image, several images, a video
and text, through gRPC (both ensembles) and the OpenAI gateway, with the replica decoding nothing itself; a member
killed under load fails no request; the whole pool down, the replica encodes locally (fallback) with the same
tokens; a member back is used again without a restart; a pool of another repository is refused by name. A replica
without a vision encoder (`serve --role language`, its visual cache in Redis) answers the same tokens, and is ready
only while a member is."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace

import pytest
from deployment import Gateway, TransformersGreedy, build_cpu_repository, cli, port_flags, user
from images import jpeg
from qwen3vl_trt.decoding.detokenize import Detokenizer
from qwen3vl_trt.errors import ServingError
from qwen3vl_trt.qa.redis_server import RedisServer
from qwen3vl_trt.qa.tiny import ENDOFTEXT_ID, IM_END_ID, synthetic_video
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.client import Client, InferenceError
from qwen3vl_trt.serving.parameters import PreprocessingParameters
from qwen3vl_trt.serving.ports import free_ports
from qwen3vl_trt.serving.repository import model_config as serving_config
from qwen3vl_trt.serving.server.serve import NO_POOL_MEMBER, VISION_MODELS, check_vision_pool
from qwen3vl_trt.serving.server.tritonserver import TritonServer
from qwen3vl_trt.serving.server.warmup import plan, warm_up
from qwen3vl_trt.serving.stages import metrics as stage_metrics
from tritonclient.grpc import InferenceServerClient

pytestmark = [pytest.mark.slow, pytest.mark.server]

PHOTO, OTHER = jpeg(64, 96, seed=1), jpeg(96, 64, seed=2)
CLIP = synthetic_video(8, 64, 64, 4)
BACK_S = 60.0  # a member started again is used within its retry delay plus its own start


class Split:
    """Two pool members and a replica sending them its misses (its visual cache in memory)."""

    def __init__(self, repo, root):
        self.repo, self.root = repo, root
        self.members = [self.member(n) for n in range(2)]
        target = ",".join(member.url for member in self.members)
        self.replica = TritonServer(
            repo, free_ports(), log_path=root / "replica.log", vision_pool=target, visual_cache="memory"
        )
        self.replica.start()
        self.replica.wait_ready()

    def member(self, n: int, ports=None) -> TritonServer:
        # Unsupervised: a member killed stays down (serve's supervisor would start it again).
        log = self.root / f"pool-{n}.log"
        server = TritonServer(self.repo, ports or free_ports(), log_path=log, models=VISION_MODELS, supervise=False)
        server.start()
        server.wait_ready()
        return server

    def counts(self, server: TritonServer) -> dict[str, float]:
        samples = stage_metrics.read(server.metrics_url)
        return {name: value for (name, model), value in samples.items() if model == interface.PREPROCESSING}

    def stop(self) -> None:
        for server in (self.replica, *self.members):
            server.stop()


@pytest.fixture(scope="module")
def split(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-pool")
    deployment = Split(build_cpu_repository(checkpoints["dense"], root), root)
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def greedy(checkpoints):
    return TransformersGreedy(checkpoints["dense"], (IM_END_ID, ENDOFTEXT_ID))


CASES = {
    "an image": ([PHOTO], []),
    "two images": ([PHOTO, OTHER], []),
    "a video": ([OTHER], [CLIP]),
    "text": ([], []),
}


def test_the_split_answers_as_transformers_and_the_replica_decodes_nothing(split, greedy, checkpoints, tmp_path):
    before = split.counts(split.replica)
    decoding = Client(split.replica.url, timeout_s=120, detokenizer=Detokenizer.from_model_dir(checkpoints["dense"]))
    for name, (images, videos) in CASES.items():
        expected = greedy.tokens("Describe.", images, 12, videos)
        answer = Client(split.replica.url, timeout_s=120).generate("Describe.", images, 12, videos=videos)
        assert answer.token_ids == expected, name
        assert decoding.generate("Describe.", images, 12, videos=videos).token_ids == expected, name
    after = split.counts(split.replica)
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    assert delta[stage_metrics.IMAGES_DECODED.name] == delta[stage_metrics.VIDEOS_DECODED.name] == 0
    # Each distinct image and video once (the replica's visual cache holds them after): PHOTO, OTHER, CLIP.
    assert delta[stage_metrics.VISION_POOL_ENCODES.name] == 3
    assert delta[stage_metrics.VISUAL_CACHE_HITS.name] >= 2
    decoded = sum(split.counts(m).get(stage_metrics.IMAGES_DECODED.name, 0) for m in split.members)
    assert decoded >= 2

    # The gateway in front of the replica: the same text as the replica's own client gives.
    gateway_port = free_ports().grpc
    gateway = Gateway(
        ["openai", "--triton-url", split.replica.url, "--repo", str(split.repo), "--port", str(gateway_port)]
        + ["--replica-ready-port", "0"],
        gateway_port,
        tmp_path / "gateway.log",
    )
    try:
        image = jpeg(80, 80, seed=7)
        text = Client(split.replica.url, timeout_s=120).generate("What is it?", [image], 10).text
        reply = gateway.client().chat.completions.create(
            model=checkpoints["dense"].name, messages=user("What is it?", image), max_tokens=10, temperature=0
        )
        assert reply.choices[0].message.content == text
    finally:
        gateway.stop()


def _load(url: str, seeds: range) -> list[list[int] | Exception]:
    """One request per seed at once, each with an image of its own (the visual cache holds none of them)."""
    results: list[list[int] | Exception] = [Exception("not answered")] * len(seeds)

    def one(i: int, seed: int) -> None:
        try:
            results[i] = Client(url, timeout_s=120).generate("What is it?", [jpeg(72, 72, seed=seed)], 6).token_ids
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i, seed)) for i, seed in enumerate(seeds)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return results


def test_members_killed_and_back_fail_no_request(split, greedy):
    replica = split.replica
    expected = {seed: greedy.tokens("What is it?", [jpeg(72, 72, seed=seed)], 6) for seed in range(100, 124)}

    # One member killed under load: every request answers (a failed call is sent to the other member).
    before = split.counts(replica)
    killer = threading.Timer(0.5, split.members[0].signal, args=(9,))
    killer.start()
    results = _load(replica.url, range(100, 108))
    killer.join()
    results += _load(replica.url, range(108, 109)) + _load(replica.url, range(109, 110))  # round robin: one to it
    assert results == [expected[seed] for seed in range(100, 110)]
    after = split.counts(replica)
    fallbacks = stage_metrics.VISION_POOL_FALLBACKS.name
    assert after.get(fallbacks, 0) == before.get(fallbacks, 0)
    assert after[stage_metrics.VISION_POOL_RETRIES.name] >= 1

    # The whole pool down: the replica encodes the images itself (fallback local), the same tokens.
    split.members[1].signal(9)
    results = _load(replica.url, range(110, 116))
    assert results == [expected[seed] for seed in range(110, 116)]
    down = split.counts(replica)
    assert down[fallbacks] > after.get(fallbacks, 0)
    assert down[stage_metrics.IMAGES_DECODED.name] > after.get(stage_metrics.IMAGES_DECODED.name, 0)

    # A member back on its address: used again, the replica not restarted.
    ports = split.members[0].ports
    for member in split.members:
        member.stop()
    split.members = [split.member(0, ports)]
    deadline = time.monotonic() + BACK_S
    seed = 116
    while split.counts(replica)[stage_metrics.VISION_POOL_ENCODES.name] == down[stage_metrics.VISION_POOL_ENCODES.name]:
        assert time.monotonic() < deadline, "the replica did not use the pool again"
        assert _load(replica.url, range(seed, seed + 1)) == [expected[seed]]
        seed += 1
        time.sleep(1.0)


def test_a_pool_of_another_repository_is_refused_by_name(split, tmp_path):
    other = tmp_path / "repo"
    shutil.copytree(split.repo, other, symlinks=True)
    config = serving_config.read(other / interface.PREPROCESSING)
    params = PreprocessingParameters.from_model_config(config)
    replace(params, vision_digest="another tower").apply(config)
    serving_config.write(other / interface.PREPROCESSING, config)
    member = split.members[0].url
    with pytest.raises(
        ServingError, match=f"the vision pool member {member} serves another repository .*vision_digest"
    ):
        check_vision_pool(member, other)
    check_vision_pool(member, split.repo)  # its own repository's: accepted


def test_a_member_warms_up_on_images_alone(split):
    """serve --role vision's warm-up: the plan's image requests, sent to preprocessing (a member has no ensemble),
    kept out of the member's metrics as every warm-up is."""
    member = split.members[0]
    requests = plan(split.repo, text=False)
    assert requests and all(request.images for request in requests)
    before = split.counts(member)
    lines: list[str] = []
    warm_up(member.url, requests, lines.append, 120, model=interface.PREPROCESSING)
    assert len(lines) == len(requests)
    assert split.counts(member)[stage_metrics.REQUESTS.name] == before[stage_metrics.REQUESTS.name]


def _readiness(url: str) -> tuple[int, str]:
    """serve's /ready: its status and the reason it gives."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read()).get("reason", "")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()).get("reason", "")
    except OSError:
        return 0, "not answering"


def _await_readiness(url: str, status: int, process: subprocess.Popen, log, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while (answer := _readiness(url))[0] != status:
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"serve's /ready answered {answer}, not {status}; its output:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return answer[1]


def test_a_language_replica_encodes_nothing_and_is_ready_only_while_a_member_is(split, greedy, tmp_path):
    """serve --role language with its visual cache in Redis: no vision encoder loaded, the same tokens as
    transformers; with no member answering it is not ready, its images' requests end naming the pool, text and
    cached images are served; a member back makes it ready again (run last: the fault test left one member)."""
    member = split.members[0]
    ports = free_ports()
    ready_url = f"http://127.0.0.1:{ports.ready}/ready"
    log = tmp_path / "language.log"
    with RedisServer(tmp_path / "redis") as redis:
        args = ["--repo", str(split.repo), "--role", "language", "--vision-pool", member.url]
        process = cli("serve", *args, "--visual-cache", redis.url, *port_flags(ports),
                      stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
        try:
            _await_readiness(ready_url, 200, process, log)
            url = f"127.0.0.1:{ports.grpc}"
            triton = InferenceServerClient(url)
            assert not triton.is_model_ready(interface.VISION_ENCODER) and triton.is_model_ready(interface.ENSEMBLE)
            triton.close()
            expected = {name: greedy.tokens("Describe.", media[0], 12, media[1]) for name, media in CASES.items()}
            for name, (images, videos) in CASES.items():
                answer = Client(url, timeout_s=120).generate("Describe.", images, 12, videos=videos)
                assert answer.token_ids == expected[name], name
            assert len(list(redis.client().scan_iter(match="qwen3vl:features:*"))) == 3  # PHOTO, OTHER, CLIP

            # No member: not ready; an image it has not seen fails naming the pool; text and a cached image answer.
            member.signal(signal.SIGKILL)
            assert _await_readiness(ready_url, 503, process, log, 30) == NO_POOL_MEMBER
            assert _readiness(ready_url.replace("/ready", "/started")) == (200, "")  # no restart for the pool
            with pytest.raises(InferenceError, match=f"the vision pool {member.url} did not answer"):
                Client(url, timeout_s=120).generate("What is it?", [jpeg(72, 72, seed=300)], 6)
            for name in ("text", "an image"):
                images, videos = CASES[name]
                assert Client(url, timeout_s=120).generate("Describe.", images, 12).token_ids == expected[name]

            # A member back on its address: ready again, images encoded by it.
            member.stop()
            split.members = [split.member(0, member.ports)]
            _await_readiness(ready_url, 200, process, log, 120)
            image = [jpeg(72, 72, seed=300)]
            answer = Client(url, timeout_s=120).generate("What is it?", image, 6)
            assert answer.token_ids == greedy.tokens("What is it?", image, 6)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
