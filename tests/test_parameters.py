"""Each python model's config.pbtxt parameters, one declaration each (serving.parameters): what the repository
writes its stage reads back, and no key of ours is spelled anywhere else."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import pytest
from qwen3vl_trt.common.contracts import BuildLayout
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.llm.checkpoint_format import read_trtllm_config
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.parameters import (
    DECLARATIONS,
    REPOSITORY_SCHEMA,
    EnsembleParameters,
    LLMParameters,
    ParameterError,
    PostprocessingParameters,
    PreprocessingParameters,
    VisionEncoderParameters,
)
from qwen3vl_trt.serving.repository import model_config as cfg
from qwen3vl_trt.serving.repository.settings import RepositorySettings
from qwen3vl_trt.serving.repository.writer import model_configs
from test_repository import MEMORY, built  # noqa: F401, F811 (the build fixture)

REPO = Path(__file__).resolve().parents[1]
BY_MODEL = {declaration.model: declaration for declaration in DECLARATIONS}


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_what_the_repository_writes_each_stage_reads_back(built, tiny_dense, target):  # noqa: F811
    layout = BuildLayout(built)
    _, llm = read_trtllm_config(layout.llm_checkpoint)
    limits = EngineLimits(max_batch_size=3)
    settings = RepositorySettings(visual_cache="redis://cache:6379/2", visual_cache_ttl_s=77)
    configs = model_configs(layout, tiny_dense, target, limits, llm, settings, memory=MEMORY)
    python_models = [name for name, config in configs.items() if config.backend == "python"]
    assert set(python_models) == set(BY_MODEL) - {interface.ENSEMBLE} - ({interface.LLM} if target == "gpu" else set())
    for name in [*python_models, interface.ENSEMBLE]:
        declaration = BY_MODEL[name]
        written = cfg.parse(cfg.to_text(configs[name]))
        # From the config.pbtxt as serve and the gateway read it, and from the JSON python_backend hands a stub.
        ours = declaration.from_model_config(written)
        stub_json = json.loads(cfg.to_json(written))
        assert declaration.from_stub_config(stub_json) == ours
        assert ours.as_strings() == {k: written.parameters[k].string_value for k in ours.as_strings()}
        if isinstance(ours, (PreprocessingParameters, VisionEncoderParameters, LLMParameters)):
            assert ours.limits == limits and ours.model_dir == tiny_dense
    pre = PreprocessingParameters.from_model_config(configs[interface.PREPROCESSING])
    assert (pre.visual_cache, pre.visual_cache_ttl_s) == ("redis://cache:6379/2", 77)
    assert pre.vision_dir == layout.vision and pre.llm_dtype == llm.dtype
    assert (pre.vision_engine_dir, pre.cuda_memory_pool_bytes) == (
        (layout.vision_engine, MEMORY.transfer_pool_bytes) if target == "gpu" else (None, None)
    )
    assert EnsembleParameters.from_model_config(configs[interface.ENSEMBLE]).repository_schema == REPOSITORY_SCHEMA


def test_every_type_round_trips_through_strings(tmp_path):
    encoder = VisionEncoderParameters(
        model_dir=tmp_path / "model",
        limits=EngineLimits(max_batch_size=2, max_visual_tokens=1024),
        vision_dir=tmp_path / "vision",
        vision_engine_dir=None,
        llm_dtype="bfloat16",
        llm_hidden_size=2048,
        vision_digest="0123",
        attention_budget_bytes=1 << 30,
    )
    strings = encoder.as_strings()
    assert strings["vision_engine_dir"] == "" and json.loads(strings["limits"])["max_visual_tokens"] == 1024
    assert VisionEncoderParameters.from_strings(strings) == encoder
    engine = VisionEncoderParameters.from_strings({**strings, "vision_engine_dir": str(tmp_path / "engine")})
    assert engine.vision_engine_dir == tmp_path / "engine"
    post = PostprocessingParameters(tmp_path, EngineLimits())
    assert PostprocessingParameters.from_strings(post.as_strings()) == post


def test_missing_or_unparsable_parameters_say_which():
    post = PostprocessingParameters(Path("/m"), EngineLimits()).as_strings()
    with pytest.raises(ParameterError, match="postprocessing model's configuration lacks the parameter.s. limits"):
        PostprocessingParameters.from_strings({"model_dir": "/m"})
    with pytest.raises(ParameterError, match="do not parse"):
        PostprocessingParameters.from_strings({**post, "limits": '{"max_batch_size": "many"}'})
    with pytest.raises(ParameterError, match=f"the {interface.ENSEMBLE} model's parameters do not parse"):
        EnsembleParameters.from_strings({"repository_schema": "two"})


def _keys() -> set[str]:
    return {f.name for declaration in DECLARATIONS for f in fields(declaration)}


# Where the declared keys would be written or read by hand: the serving code, the build and acceptance that use a
# repository, the python models and the scripts. (manifest.json's own "limits" entry is the build manifest's, in
# manifest.py, outside this set.)
SCANNED = [
    *sorted((REPO / "build" / "serving").rglob("*.py")),
    REPO / "build" / "pipeline" / "build.py",
    REPO / "build" / "qa" / "acceptance.py",
    REPO / "build" / "cli.py",
    *sorted((REPO / "triton_models").rglob("*.py")),
    *sorted((REPO / "scripts").rglob("*.py")),
]
DECLARED_IN = REPO / "build" / "serving" / "parameters.py"


def _bare_keys(text: str) -> set[str]:
    return {m.group(2) for m in re.finditer(r"""(["'])([a-z_]+)\1""", text)} & _keys()


def test_no_parameter_key_is_spelled_outside_its_declaration():
    found = {
        str(path.relative_to(REPO)): sorted(_bare_keys(path.read_text()))
        for path in SCANNED
        if path != DECLARED_IN and _bare_keys(path.read_text())
    }
    assert found == {}


def test_the_scan_finds_a_planted_key():
    assert _bare_keys('config.parameters["visual_cache_ttl_s"].string_value') == {"visual_cache_ttl_s"}
    assert _bare_keys("params.get('checkpoint_dir')") == {"checkpoint_dir"}
    assert _bare_keys('"kv_cache_free_gpu_mem_fraction"') == set()  # the tensorrtllm backend's own
