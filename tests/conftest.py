"""Shared fixtures: tiny real-architecture checkpoints, their vision exports and the CPU deployment's model
repository, built once per run."""

from __future__ import annotations

import shutil
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from qwen3vl_trt.hf.checkpoint import Checkpoint
from qwen3vl_trt.hf.reference import load_hf_vision_tower, run_hf_vision_tower
from qwen3vl_trt.qa.tiny import make_tiny_checkpoint
from qwen3vl_trt.vision import OnnxVisionRunner
from qwen3vl_trt.vision.export import export_vision, parity_errors
from qwen3vl_trt.vision.metadata import num_patches

# Vision towers under test: head_dim 64 (hidden 128 / 2 heads) and 72 (hidden 144 / 2 heads, as 8B+).
CHECKPOINTS = {
    "dense": dict(moe=False),
    "moe": dict(moe=True),
    "dense-hd72": dict(moe=False, vision_overrides=dict(hidden_size=144, num_heads=2, intermediate_size=288)),
}


def _quiet(*_args, **_kwargs) -> None:
    pass


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_tiny_checkpoint(root / name, seed=i, **kw) for i, (name, kw) in enumerate(CHECKPOINTS.items())}


@pytest.fixture(scope="session")
def tiny_dense(checkpoints):
    return checkpoints["dense"]


@pytest.fixture(scope="session")
def cpu_repository(checkpoints, tmp_path_factory):
    """The CPU target's repository of the dense checkpoint (tests/deployment.py), which `serve` tests share: serving
    reads a repository, never writes it."""
    from deployment import build_cpu_repository

    return build_cpu_repository(checkpoints["dense"], tmp_path_factory.mktemp("cpu-repository"))


@pytest.fixture(scope="session")
def vision_exports(checkpoints, tmp_path_factory):
    """fp32 exports of every tiny checkpoint, keyed like CHECKPOINTS."""
    root = tmp_path_factory.mktemp("vision")
    return {
        name: export_vision(path, root / name, dtype="fp32", log=_quiet).output_dir
        for name, path in checkpoints.items()
    }


class VisionParity:
    """Runs the same inputs through our ONNX (ORT) and the transformers tower."""

    def __init__(self, model_dir, onnx_dir):
        self.encoder = OnnxVisionRunner(onnx_dir)
        self.reference = load_hf_vision_tower(Checkpoint(model_dir))

    def errors(self, pixel_values, grid_thw) -> dict[str, float]:
        ours = self.encoder.encode(pixel_values, grid_thw)
        theirs = run_hf_vision_tower(self.reference, pixel_values, grid_thw)
        assert ours[0].shape == theirs[0].shape and ours[1].shape == theirs[1].shape
        return {
            "image_embeds": parity_errors(ours[0], theirs[0])[1],
            "deepstack_embeds": parity_errors(ours[1], theirs[1])[1],
        }


@pytest.fixture(scope="session")
def parity(checkpoints, vision_exports):
    cache: dict[str, VisionParity] = {}

    def get(name: str) -> VisionParity:
        if name not in cache:
            cache[name] = VisionParity(checkpoints[name], vision_exports[name])
        return cache[name]

    return get


def random_pixels(grid_thw, patch_dim: int = 1536, seed: int = 0) -> np.ndarray:
    n = num_patches(np.asarray(grid_thw))
    return np.random.default_rng(seed).uniform(-1, 1, size=(n, patch_dim)).astype(np.float32)


# The stand-in for TensorRT-LLM 1.2.1 (tests/trtllm_standin/README.md): a package named tensorrt_llm.
TRTLLM_STANDIN = Path(__file__).parent / "trtllm_standin"


@pytest.fixture
def trtllm_standin(monkeypatch):
    """The TensorRT-LLM stand-in importable as `tensorrt_llm` for one test; its path (for subprocesses).

    The package's engine_model is imported first, so it keeps seeing TensorRT-LLM absent (tests load private copies
    of it over the stand-in); the stand-in's modules leave sys.modules with the test."""
    import qwen3vl_trt.llm.engine_model  # noqa: F401

    monkeypatch.syspath_prepend(str(TRTLLM_STANDIN))
    yield TRTLLM_STANDIN
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]


@pytest.fixture
def standin_engine_model(trtllm_standin):
    """A private copy of qwen3vl_trt.llm.engine_model imported over the TensorRT-LLM stand-in (the package's own
    module keeps seeing the real, absent TensorRT-LLM)."""
    import importlib.util

    from qwen3vl_trt.llm import engine_model

    spec = importlib.util.spec_from_file_location("standin_engine_model", engine_model.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TRTLLM_IMPORT_ERROR is None, module.TRTLLM_IMPORT_ERROR
    return module


def pytest_report_header(config):
    import onnxruntime
    import torch
    import transformers

    return f"transformers {transformers.__version__}, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}"


# A test module's own fixtures' directories (tmp_path_factory.mktemp) go when the module ends, unless a test of it
# failed: a run's tiny checkpoints, conversions, engines and repositories come to about 15 GB, and pytest's policy
# "failed" (pyproject.toml) removes a passing test's tmp_path at once but a fixture's only when the run ends. The
# shared fixtures above (this file's) stay for the whole run.
_module_dirs: defaultdict[str, list[Path]] = defaultdict(list)
_failed_modules: set[str] = set()


def _module_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope == "function" or not fixturedef.baseid.endswith(".py"):
        return (yield)
    root = request.getfixturevalue("tmp_path_factory").getbasetemp()
    before = set(root.iterdir())
    try:
        return (yield)
    finally:
        _module_dirs[fixturedef.baseid].extend(set(root.iterdir()) - before)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        _failed_modules.add(_module_of(item.nodeid))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:  # the module's fixtures are finalized by now when the next test is another module's
        module = _module_of(item.nodeid)
        if nextitem is None or _module_of(nextitem.nodeid) != module:
            for directory in _module_dirs.pop(module, []):
                if module not in _failed_modules:
                    shutil.rmtree(directory, ignore_errors=True)
