"""The vision pool's client (stages.vision_pool.VisionPool) against members stood in here: round robin, a failed
call sent once more to another member, a dead member skipped and then tried again, a member of another repository
refused by name and never called, a refused request not sent again; and the check that refuses a mismatched member
(PreprocessingParameters.pool_mismatch)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from deployment import LIMITS
from qwen3vl_trt.errors import StageError
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.parameters import ParameterError, PreprocessingParameters
from qwen3vl_trt.serving.request import GenerationRequest
from qwen3vl_trt.serving.stages import metrics as stage_metrics
from qwen3vl_trt.serving.stages import vision_pool
from qwen3vl_trt.serving.stages.vision_pool import MemberFailed, VisionPool

MINE = PreprocessingParameters(
    model_dir=Path("/models/ckpt"),
    limits=LIMITS,
    vision_dir=Path("/build/vision"),
    vision_engine_dir=None,
    llm_dtype="float32",
    llm_hidden_size=64,
    vision_digest="abc",
    preprocess_device="cpu",
    mrope_positions=0,
    visual_cache="off",
    visual_cache_bytes=0,
    visual_cache_ttl_s=1,
    vision_pool="a:1,b:1",
)
REQUEST = GenerationRequest(prompt="", images=[b"\xff\xd8 an image"], max_tokens=1)


class Counts:
    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def add(self, metric: stage_metrics.Metric, value: float) -> None:
        self.values[metric.name] = self.values.get(metric.name, 0) + value

    def observe(self, metric: stage_metrics.Metric, value: float) -> None:
        self.add(metric, 1)


class Member:
    """A stood-in member: answers a table of its own number, or fails as told."""

    def __init__(self, address: str, members: dict[str, Member]):
        self.address, self.calls = address, 0
        self.params = MINE
        self.fail: Exception | None = None
        members[address] = self

    async def parameters(self) -> PreprocessingParameters:
        return self.params

    async def table(self, request: GenerationRequest, request_id: str) -> torch.Tensor:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        return torch.full((2, 3), float(ord(self.address[0])))

    async def close(self) -> None:
        pass


def _pool(addresses: list[str]) -> tuple[VisionPool, dict[str, Member], Counts]:
    members: dict[str, Member] = {}
    for address in addresses:
        Member(address, members)
    counts = Counts()
    pool = VisionPool(",".join(addresses), MINE, counts, connect=members.__getitem__, resolve=lambda: addresses)
    return pool, members, counts


def _run(pool: VisionPool, warm_up: bool = False):
    return asyncio.run(pool.table(REQUEST, warm_up))


def test_calls_go_round_robin_and_come_back_as_the_members_rows():
    pool, members, counts = _pool(["a:1", "b:1"])
    tables = [_run(pool) for _ in range(4)]
    assert [members["a:1"].calls, members["b:1"].calls] == [2, 2]
    assert all(isinstance(t, torch.Tensor) and tuple(t.shape) == (2, 3) for t in tables)
    assert {float(t[0, 0]) for t in tables} == {float(ord("a")), float(ord("b"))}
    assert counts.values[stage_metrics.VISION_POOL_REQUESTS.name] == 4
    assert stage_metrics.VISION_POOL_RETRIES.name not in counts.values
    assert counts.values[stage_metrics.VISION_POOL_BYTES.name] == 4 * (len(REQUEST.images[0]) + 6 * 4)


def test_a_failed_member_is_retried_on_another_skipped_and_used_again_later(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(vision_pool.time, "monotonic", lambda: now[0])
    pool, members, counts = _pool(["a:1", "b:1"])
    members["a:1"].fail = MemberFailed("a:1 is unavailable")
    for _ in range(4):
        assert isinstance(_run(pool), torch.Tensor)  # every call answered: b took a's
    assert members["a:1"].calls == 1  # tried once, then skipped
    assert counts.values[stage_metrics.VISION_POOL_RETRIES.name] == 1
    members["a:1"].fail = None
    now[0] += vision_pool.RETRY_S + 1  # back: tried again after RETRY_S, without a restart
    for _ in range(2):
        _run(pool)
    assert members["a:1"].calls == 2


def test_every_member_down_is_an_error_naming_the_pool():
    pool, members, _ = _pool(["a:1", "b:1"])
    for member in members.values():
        member.fail = MemberFailed(f"{member.address} is unavailable")
    error = _run(pool)
    assert isinstance(error, StageError) and "the vision pool a:1,b:1 did not answer" in str(error)
    assert sum(m.calls for m in members.values()) == 2  # the first and one retry


def test_a_refused_request_is_not_sent_again():
    pool, members, counts = _pool(["a:1", "b:1"])
    for member in members.values():
        member.fail = StageError("the vision pool member refused the images: not an image")
    error = _run(pool)
    assert isinstance(error, StageError) and "not an image" in str(error)
    assert sum(m.calls for m in members.values()) == 1


def test_a_member_of_another_repository_is_refused_by_name_and_never_called():
    pool, members, _ = _pool(["a:1", "b:1"])
    members["a:1"].params = dataclasses.replace(MINE, vision_digest="other")
    for _ in range(3):
        assert isinstance(_run(pool), torch.Tensor)
    assert members["a:1"].calls == 0 and members["b:1"].calls == 3
    assert pool.refused() == {"a:1": "its vision_digest is other, this replica's abc"}


def test_warm_up_calls_are_not_counted():
    pool, _, counts = _pool(["a:1"])
    _run(pool, warm_up=True)
    assert counts.values == {}


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(vision_digest="other"), "vision_digest"),
        (dict(llm_dtype="bfloat16"), "llm_dtype"),
        (dict(llm_hidden_size=128), "llm_hidden_size"),
        (dict(repository_schema=1), "repository_schema"),
        (dict(limits=dataclasses.replace(LIMITS, max_visual_tokens=64)), "limits"),
    ],
)
def test_pool_mismatch_names_what_differs(change, named):
    assert MINE.pool_mismatch(MINE) is None
    assert MINE.pool_mismatch(dataclasses.replace(MINE, vision_pool="", visual_cache="memory")) is None
    assert MINE.pool_mismatch(dataclasses.replace(MINE, **change)).startswith(f"its {named} is ")


def test_parameters_of_another_version_do_not_parse():
    strings = MINE.as_strings()
    del strings["vision_digest"]
    with pytest.raises(ParameterError, match="vision_digest"):
        PreprocessingParameters.from_strings(strings)
    with pytest.raises(Exception, match="vision_fallback"):
        dataclasses.replace(MINE, vision_fallback="sometimes")


def test_serve_takes_the_roles_and_the_pool_on_its_command_line(tmp_path):
    from deployment import echo_repository
    from qwen3vl_trt.cli import parser, serve_options
    from qwen3vl_trt.errors import ServingError
    from qwen3vl_trt.serving.server.serve import serve

    options = serve_options(parser().parse_args(["serve", "--repo", "r", "--role", "vision"]))
    assert (options.role, options.vision_pool, options.vision_fallback) == ("vision", None, None)
    flags = ["serve", "--repo", "r", "--vision-pool", "pool-0:8101,pool-1:8101", "--vision-fallback", "fail"]
    options = serve_options(parser().parse_args(flags))
    assert (options.role, options.vision_pool, options.vision_fallback) == (
        "replica",
        "pool-0:8101,pool-1:8101",
        "fail",
    )
    for bad in (["--vision-pool", "not a target"], ["--vision-fallback", "sometimes"], ["--role", "llm"]):
        with pytest.raises(SystemExit):
            parser().parse_args(["serve", "--repo", "r", *bad])
    repo = echo_repository(tmp_path / "repo")
    for mixed in (dict(openai_port=9000, vision_pool=None), dict(vision_pool="pool:8101")):
        with pytest.raises(ServingError, match="a vision pool member .* runs no gateway and no pool of its own"):
            serve(dataclasses.replace(options, repo=repo, role="vision", **mixed))


def test_pool_requests_keep_within_one_requests_limits(checkpoints):
    """A batch's misses may be more than one request may bring: they go in requests within the limits (images
    first, each request's in the order of its rows), every item once."""
    from qwen3vl_trt.serving.stages.preprocessing import Preprocessing, VisualFeatures

    limits = dataclasses.replace(LIMITS, max_visual_tokens=100)
    stage = Preprocessing(checkpoints["dense"], limits, torch.float32, 64)
    request = limits.request_limits()

    def item(kind: str, n: int, tokens: int) -> VisualFeatures:
        return VisualFeatures(kind, bytes([n]), (1, 2, 2), tokens, None, None, source=b"file %d" % n)

    items = [item("video", 90, 30)] + [item("image", n, 30 if n % 2 else 60) for n in range(request.max_images + 3)]
    chunks = stage.pool_requests(items)
    assert sorted(i.digest for _, chunk in chunks for i in chunk) == sorted(i.digest for i in items)
    for sent, chunk in chunks:
        assert sum(i.tokens for i in chunk) <= request.max_visual_tokens
        assert len(sent.images) <= request.max_images and len(sent.videos) <= request.max_videos
        assert [i.kind for i in chunk] == sorted((i.kind for i in chunk), key=lambda kind: kind == "video")
        assert [*sent.images, *sent.videos] == [i.source for i in chunk]
    assert len(chunks) > 1


def test_a_pool_of_members_all_refused_says_so():
    pool, members, _ = _pool(["a:1"])
    members["a:1"].params = dataclasses.replace(MINE, llm_hidden_size=128)
    error = _run(pool)
    assert isinstance(error, StageError) and "a:1 serves another repository (its llm_hidden_size is 128" in str(error)
    assert members["a:1"].calls == 0


@pytest.mark.parametrize("datatype", ["BF16", "FP16", "FP32"])
def test_a_members_table_is_read_from_its_raw_bytes(datatype):
    """The prompt table as the member's response carries it ([1, rows, hidden], raw bytes), read without
    tritonclient's as_numpy (2.68 decodes BF16 element by element in Python; 2.73 answers ml_dtypes' bfloat16)."""
    from tritonclient.grpc import InferResult, service_pb2

    dtype = {"BF16": torch.bfloat16, "FP16": torch.float16, "FP32": torch.float32}[datatype]
    rows = torch.randn(6, 4).to(dtype)
    response = service_pb2.ModelInferResponse(model_name=interface.PREPROCESSING)
    response.outputs.add(name=interface.PROMPT_TABLE.name, datatype=datatype, shape=[1, 6, 4])
    response.raw_output_contents.append(
        rows.view(torch.int16 if rows.element_size() == 2 else torch.int32).numpy().tobytes()
    )
    got = vision_pool.table_rows(InferResult(response))
    assert got.dtype == dtype and torch.equal(got, rows)
    del response.outputs[0]
    with pytest.raises(MemberFailed):
        vision_pool.table_rows(InferResult(response))
