"""The `serve` launcher: where tritonserver is found, the commands it builds (one process, or one per rank
under MPI), and real starts of the bundled tritonserver that become ready and stop with their whole
process group."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from deployment import SERVE_SCRIPT, echo_repository, group_gone, http_status, port_flags
from google.protobuf import json_format
from qwen3vl_trt.cli import add_serve_arguments, serve_options
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.errors import CheckpointError, ServingError
from qwen3vl_trt.serving.interface import ENSEMBLE, LLM, PREPROCESSING, TEXT_OUTPUT
from qwen3vl_trt.serving.parameters import REPOSITORY_SCHEMA, EnsembleParameters, PreprocessingParameters
from qwen3vl_trt.serving.ports import ServerPorts, free_ports
from qwen3vl_trt.serving.repository import model_config as serving_config
from qwen3vl_trt.serving.request import TEXT_INPUT
from qwen3vl_trt.serving.server import serve as serve_module
from qwen3vl_trt.serving.server import tritonserver_install
from qwen3vl_trt.serving.server.launch import (
    ConfigOverrides,
    cuda_pool_flags,
    launch_command,
    model_control_flags,
    mpi_command,
    repository_models,
    server_command,
    world_size,
)
from qwen3vl_trt.serving.server.serve import ServeOptions, check_repository, serve
from qwen3vl_trt.serving.server.supervisor import group_stubs
from qwen3vl_trt.serving.server.tritonserver import SHM_DIR, TritonServer
from qwen3vl_trt.serving.server.tritonserver_install import TritonInstall, find_tritonserver
from qwen3vl_trt.serving.server.warmup import WarmupError, WarmupRequest
from tritonclient.grpc import model_config_pb2 as mc

# The launcher and the bundled tritonserver over an echo repository: nothing here reads transformers.
pytestmark = pytest.mark.once

WHEEL_ROOT = tritonserver_install._pytriton_dir()


def _script(path: Path, body: str = "exec sleep 60") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """No tritonserver on PATH, in the environment or in /opt: discovery falls through to the wheel."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", os.pathsep.join([str(empty), "/usr/bin", "/bin"]))  # the python backend runs bash
    monkeypatch.delenv(tritonserver_install.ENV_VAR, raising=False)
    monkeypatch.setattr(tritonserver_install, "NGC_INSTALL", tmp_path / "no-opt")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def test_discovery_order(nowhere, monkeypatch):
    on_path = _script(nowhere / "path-bin" / "tritonserver")
    from_env = _script(nowhere / "env-bin" / "tritonserver")
    explicit = _script(nowhere / "explicit-bin" / "tritonserver")
    opt = _script(nowhere / "opt" / "bin" / "tritonserver")
    monkeypatch.setattr(tritonserver_install, "NGC_INSTALL", nowhere / "opt")
    assert find_tritonserver() == TritonInstall(opt, None, {}, str(nowhere / "opt"))
    monkeypatch.setenv("PATH", str(on_path.parent))  # first on PATH
    assert find_tritonserver() == TritonInstall(on_path, None, {}, "PATH")
    monkeypatch.setenv(tritonserver_install.ENV_VAR, str(from_env))
    assert find_tritonserver() == TritonInstall(from_env, None, {}, "$QWEN3VL_TRITONSERVER")
    assert find_tritonserver(str(explicit)) == TritonInstall(explicit, None, {}, "--tritonserver")
    with pytest.raises(ServingError, match="--tritonserver names .*/missing, which is not an executable file"):
        find_tritonserver(str(nowhere / "missing"))
    monkeypatch.setenv(tritonserver_install.ENV_VAR, str(nowhere))  # a directory
    with pytest.raises(ServingError, match=r"\$QWEN3VL_TRITONSERVER names .* not an executable file"):
        find_tritonserver()


def test_wheel_fallback_prepares_a_backend_directory_for_this_interpreter(nowhere, monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", "/already/there")
    install = find_tritonserver()
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert install.source == "nvidia-pytriton 0.7.0 wheel"
    assert install.binary == WHEEL_ROOT / "tritonserver" / "bin" / "tritonserver"
    assert install.backend_dir == nowhere / "cache" / "qwen3vl-trt" / "tritonserver" / f"0.7.0-py{python}" / "backends"
    python_dir = install.backend_dir / "python"
    assert sorted(p.name for p in python_dir.iterdir()) == [
        "libtriton_python.so",
        "triton_python_backend_stub",
        "triton_python_backend_utils.py",
    ]
    stub = (python_dir / "triton_python_backend_stub").resolve()
    assert stub == (WHEEL_ROOT / "tritonserver" / "python_backend_stubs" / python / "triton_python_backend_stub")
    assert install.env["LD_LIBRARY_PATH"].split(os.pathsep) == [
        sysconfig.get_config_var("LIBDIR"),
        str(WHEEL_ROOT.parent / "nvidia_pytriton.libs"),
        "/already/there",
    ]
    assert install.env["PATH"] == os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
    # Idempotent: the same directory again, nothing left behind beside it.
    assert find_tritonserver() == install
    assert [p.name for p in install.backend_dir.parent.iterdir()] == ["backends"]
    # Links into another (moved, upgraded) install are replaced.
    (python_dir / "triton_python_backend_stub").unlink()
    (python_dir / "triton_python_backend_stub").symlink_to(nowhere / "gone")
    assert find_tritonserver() == install
    assert (python_dir / "triton_python_backend_stub").resolve() == stub
    assert [p.name for p in install.backend_dir.parent.iterdir()] == ["backends"]
    shutil.rmtree(install.backend_dir)
    install.backend_dir.symlink_to(nowhere)  # a foreign link in its place
    assert find_tritonserver() == install and not install.backend_dir.is_symlink()
    assert [p.name for p in install.backend_dir.parent.iterdir()] == ["backends"]


def test_wheel_refusals(nowhere, monkeypatch):
    monkeypatch.setattr(tritonserver_install, "_numpy_version", lambda: "2.1.3")
    with pytest.raises(ServingError, match=r'numpy 2\.1\.3 .* corrupts tensors .*`pip install "numpy<2"`'):
        find_tritonserver()
    monkeypatch.setattr(tritonserver_install, "_numpy_version", lambda: "1.26.4")
    monkeypatch.setattr(tritonserver_install, "_interpreter_version", lambda: "3.7")
    with pytest.raises(ServingError, match=r"no python backend stub for Python 3\.7 \(it has 3\.10, 3\.11, .*3\.8"):
        find_tritonserver()
    monkeypatch.setattr(tritonserver_install, "_pytriton_dir", lambda: None)
    with pytest.raises(ServingError) as e:
        find_tritonserver()
    message = str(e.value)
    assert message.startswith("no tritonserver found (searched --tritonserver, $QWEN3VL_TRITONSERVER, PATH, ")
    assert "pip install nvidia-pytriton==0.7.0" in message and "nvcr.io/nvidia/tritonserver:" in message
    assert e.value.exit_code == 3


INSTALL = TritonInstall(Path("/srv/triton/bin/tritonserver"), Path("/srv/backends"), {}, "test")


def test_server_command(tmp_path):
    ports = ServerPorts(grpc=9001, http=9000, metrics=9002)
    assert server_command(INSTALL, tmp_path, ports, log_verbose=1, extra=["--exit-timeout-secs=5"]) == [
        "/srv/triton/bin/tritonserver",
        f"--model-repository={tmp_path}",
        "--backend-directory=/srv/backends",
        "--grpc-address=127.0.0.1",
        "--http-address=127.0.0.1",
        "--metrics-address=127.0.0.1",
        "--grpc-port=9001",
        "--http-port=9000",
        "--metrics-port=9002",
        "--exit-on-error=true",
        "--strict-readiness=true",
        "--log-verbose=1",
        "--exit-timeout-secs=5",
    ]
    default = TritonInstall(INSTALL.binary, None, {}, "PATH")
    command = server_command(default, tmp_path, ServerPorts(), address="0.0.0.0")
    assert not any(arg.startswith("--backend-directory") for arg in command)
    assert "--grpc-address=0.0.0.0" in command and "--grpc-port=8001" in command and "--http-port=8000" in command


def _llm_repo(root: Path, backend: str, engine: Path | None = None, mapping: dict | None = None) -> Path:
    config = mc.ModelConfig(name=LLM, backend=backend, max_batch_size=8)
    if engine is not None:
        serving_config.parameters(config, {"gpt_model_path": engine})
        engine.mkdir(parents=True)
        (engine / "config.json").write_text(
            json.dumps({"version": "1.2.1", "pretrained_config": {"mapping": mapping}, "build_config": {}})
        )
    (root / LLM).mkdir(parents=True)
    serving_config.write(root / LLM, config)
    return root


def _preprocessing_parameters(**values) -> PreprocessingParameters:
    """Preprocessing's parameters as write-repo declares them, with `values` changed."""
    base = PreprocessingParameters(
        model_dir=Path("/checkpoint"),
        limits=EngineLimits(),
        vision_dir=Path("/build/vision"),
        vision_engine_dir=None,
        llm_dtype="bfloat16",
        llm_hidden_size=64,
        vision_digest="0123",
        preprocess_device="cpu",
        mrope_positions=0,
        visual_cache="memory",
        visual_cache_bytes=1 << 20,
        visual_cache_ttl_s=60,
    )
    return replace(base, **values)


def _pool_repo(repo: Path, gpus: list[int], pool: str) -> Path:
    """A GPU-target preprocessing config as write-repo makes it: instances on stated GPUs, the pool's size."""
    config = mc.ModelConfig(name=PREPROCESSING, backend="python", max_batch_size=8)
    config.instance_group.append(serving_config.instance_group("gpu", gpus=gpus))
    _preprocessing_parameters(cuda_memory_pool_bytes=int(pool)).apply(config)
    (repo / PREPROCESSING).mkdir(parents=True)
    serving_config.write(repo / PREPROCESSING, config)
    return repo


def test_cuda_memory_pool_of_the_python_models_gpu_on_rank_0_only(tmp_path):
    """Triton's 64 MB default pool makes python_backend pass device tensors by CUDA IPC: `serve` sizes the pool of
    the python models' GPU as write-repo planned it, on the rank that runs them."""
    ports = ServerPorts(grpc=9001, http=9000, metrics=9002)
    assert cuda_pool_flags(tmp_path / "none") == []
    single = _pool_repo(tmp_path / "single", [1], "123456")
    assert cuda_pool_flags(single) == ["--cuda-memory-pool-byte-size=1:123456"]
    assert launch_command(INSTALL, single, ports)[-1] == "--cuda-memory-pool-byte-size=1:123456"
    mapping = {"world_size": 2, "tp_size": 2, "pp_size": 1, "cp_size": 1}
    repo = _pool_repo(_llm_repo(tmp_path / "mpi", "tensorrtllm", tmp_path / "engine", mapping), [0], "4096")
    command = launch_command(INSTALL, repo, ports)
    separator = command.index(":")
    assert command[4:separator].count("--cuda-memory-pool-byte-size=0:4096") == 1
    assert not [arg for arg in command[separator:] if arg.startswith("--cuda-memory-pool")]
    with pytest.raises(ServingError, match="one GPU and a byte count"):
        cuda_pool_flags(_pool_repo(tmp_path / "bad", [0, 1], "4096"))


def test_the_language_role_reads_its_own_configs_on_every_rank_and_sizes_the_pool_from_them(tmp_path):
    """serve --role language: every rank's tritonserver gets --model-config-name=language (rank > 0 loads the llm from
    its files, not through serve's overrides), and the CUDA memory pool and the overrides start from the language
    configs (configs/language.pbtxt) where a model has one."""
    ports = ServerPorts(grpc=9001, http=9000, metrics=9002)
    mapping = {"world_size": 2, "tp_size": 2, "pp_size": 1, "cp_size": 1}
    repo = _pool_repo(_llm_repo(tmp_path / "mpi", "tensorrtllm", tmp_path / "engine", mapping), [0], "4096")
    language = serving_config.read(repo / PREPROCESSING)
    replace(PreprocessingParameters.from_model_config(language), vision_fallback="fail", cuda_memory_pool_bytes=1024)\
        .apply(language)  # fmt: skip
    serving_config.write(repo / PREPROCESSING, language, serving_config.LANGUAGE_CONFIG)
    assert serving_config.config_path(repo / PREPROCESSING, "other").name == serving_config.CONFIG_FILE
    assert cuda_pool_flags(repo, serving_config.LANGUAGE_CONFIG) == ["--cuda-memory-pool-byte-size=0:1024"]
    command = launch_command(INSTALL, repo, ports, config_name=serving_config.LANGUAGE_CONFIG)
    separator = command.index(":")
    for rank in (command[4:separator], command[separator:]):
        assert rank.count("--model-config-name=language") == 1
    assert command[4:separator].count("--cuda-memory-pool-byte-size=0:1024") == 1
    assert "--model-config-name=language" not in launch_command(INSTALL, repo, ports)
    single = _pool_repo(tmp_path / "single", [1], "4096")
    language.instance_group[0].gpus[:] = [1]
    serving_config.write(single / PREPROCESSING, language, serving_config.LANGUAGE_CONFIG)
    assert launch_command(INSTALL, single, ports, config_name="language")[-2:] == [
        "--cuda-memory-pool-byte-size=1:1024",
        "--model-config-name=language",
    ]
    # An override (--visual-cache) is made of the config the server reads.
    overridden = ConfigOverrides(visual_cache="off").configs(single, serving_config.LANGUAGE_CONFIG)[PREPROCESSING]
    served = PreprocessingParameters.from_model_config(json_format.Parse(overridden, mc.ModelConfig()))
    assert (served.visual_cache, served.vision_fallback, served.cuda_memory_pool_bytes) == ("off", "fail", 1024)


def test_world_size_and_mpi_command(tmp_path):
    assert world_size(tmp_path / "empty") == 1
    assert world_size(_llm_repo(tmp_path / "cpu", "python")) == 1
    mapping = {"world_size": 2, "tp_size": 2, "pp_size": 1, "cp_size": 1}
    repo = _llm_repo(tmp_path / "gpu", "tensorrtllm", tmp_path / "engine", mapping)
    assert world_size(repo) == 2
    assert world_size(_llm_repo(tmp_path / "old", "tensorrtllm", tmp_path / "e2", {"tp_size": 2, "pp_size": 2})) == 4

    ports = ServerPorts(grpc=9001, http=9000, metrics=9002)
    command = launch_command(INSTALL, repo, ports, log_verbose=2)
    assert command == mpi_command(INSTALL, repo, ports, 2, log_verbose=2)
    assert command[:4] == ["mpirun", "--allow-run-as-root", "-n", "1"]
    separator = command.index(":")
    rank0, rank1 = command[4:separator], command[separator + 3 :]
    assert command[separator : separator + 3] == [":", "-n", "1"] and ":" not in rank1
    shared = server_command(INSTALL, repo, ports)
    assert rank0 == [
        *server_command(INSTALL, repo, ports, log_verbose=2),
        "--disable-auto-complete-config",
        "--backend-config=python,shm-region-prefix-name=prefix0_",
        "--model-control-mode=explicit",
        "--load-model=*",
    ]
    # serve loads the models with config overrides (--max-queue-size, --visual-cache) through the repository API,
    # which Triton's default model control refuses: rank 0 starts under explicit control with nothing loaded.
    later = launch_command(INSTALL, repo, ports, load_at_start=False)
    later_rank0 = later[4 : later.index(":")]
    assert "--model-control-mode=explicit" in later_rank0 and not any(a.startswith("--load-model") for a in later_rank0)
    assert later[later.index(":") :] == command[separator:]
    assert rank1 == [
        *shared,
        "--disable-auto-complete-config",
        "--backend-config=python,shm-region-prefix-name=prefix1_",
        "--model-control-mode=explicit",
        f"--load-model={LLM}",
    ]
    explicit = ["--model-control-mode=explicit", "--load-model=*"]
    assert model_control_flags(True) == explicit and model_control_flags(False) == explicit[:1]
    single = server_command(INSTALL, tmp_path / "cpu", ports, extra=explicit)
    assert launch_command(INSTALL, tmp_path / "cpu", ports) == single
    loaded_later = server_command(INSTALL, tmp_path / "cpu", ports, extra=explicit[:1])
    assert launch_command(INSTALL, tmp_path / "cpu", ports, load_at_start=False) == loaded_later
    drained = launch_command(INSTALL, repo, ports, drain_s=120)
    assert drained.count("--exit-timeout-secs=120") == 2  # every rank drains as long
    own = launch_command(INSTALL, repo, ports, shm_prefix="qwen3vl_7_0_")
    assert [f for f in own if "shm-region" in f] == [
        f"--backend-config=python,shm-region-prefix-name=qwen3vl_7_0_{rank}_" for rank in (0, 1)
    ]
    assert launch_command(INSTALL, tmp_path / "cpu", ports, shm_prefix="qwen3vl_7_0_") == [
        *single,
        "--backend-config=python,shm-region-prefix-name=qwen3vl_7_0_",
    ]


def test_world_size_errors(tmp_path):
    no_path = _llm_repo(tmp_path / "a", "tensorrtllm")
    with pytest.raises(ServingError, match="has no gpt_model_path parameter"):
        world_size(no_path)
    missing = tmp_path / "b"
    (missing / LLM).mkdir(parents=True)
    config = mc.ModelConfig(name=LLM, backend="tensorrtllm")
    serving_config.parameters(config, {"gpt_model_path": tmp_path / "no-engine"})
    serving_config.write(missing / LLM, config)
    with pytest.raises(CheckpointError, match="LLM engine config .*no-engine/config.json does not exist"):
        world_size(missing)
    with pytest.raises(ServingError, match="has neither world_size nor tp_size and pp_size"):
        world_size(_llm_repo(tmp_path / "c", "tensorrtllm", tmp_path / "e3", {"tp_size": 2}))


def test_not_ready_in_time_and_a_server_that_ignores_sigterm(tmp_path):
    # A "server" that never listens and ignores SIGTERM, with a child in its group: the readiness timeout
    # names its log, and stop() escalates to SIGKILL for the whole group.
    stubborn = _script(tmp_path / "tritonserver", "trap '' TERM\necho loading\nsleep 60 &\nsleep 60")
    launched = TritonServer(tmp_path, free_ports(), tritonserver=str(stubborn), ready_timeout=0.5, stop_grace=0.5)
    with pytest.raises(ServingError, match=r"not ready after 0\.5 s .*\n.*loading"):
        with launched:
            pass
    assert group_gone(launched.pid)


def test_server_that_exits_reports_its_log(tmp_path, nowhere):
    with pytest.raises(ServingError, match=r"exited with status 1 before it was ready; the last lines of its log") as e:
        with TritonServer(tmp_path / "no-such-repo", free_ports(), log_path=tmp_path / "server.log"):
            pass
    assert "no-such-repo" in str(e.value) and (tmp_path / "server.log").is_file()


def test_a_server_that_aborts_while_loading_is_started_once_more(tmp_path, nowhere):
    """tritonserver 2.51's python backend now and then aborts as its stubs start: serve starts it again, once."""
    wheel = find_tritonserver()
    aborts = tmp_path / "aborts"
    script = tmp_path / "tritonserver"
    script.write_text(
        "#!/bin/bash\n"
        f"if [ ! -e {aborts} ]; then touch {aborts}; kill -ABRT $$; fi\n"
        f'LD_LIBRARY_PATH={wheel.env["LD_LIBRARY_PATH"]} exec {wheel.binary} "$@"\n'
    )
    script.chmod(0o755)
    (tmp_path / "repo").mkdir()
    log = tmp_path / "server.log"
    with TritonServer(tmp_path / "repo", free_ports(), tritonserver=str(script), log_path=log) as running:
        assert running.reports_ready()
    assert "tritonserver aborted while loading the models; starting it once more" in log.read_text()

    script.write_text("#!/bin/bash\nkill -ABRT $$\n")  # every time: the second is reported
    with pytest.raises(ServingError, match="was killed by signal 6 before it was ready"):
        with TritonServer(tmp_path / "repo", free_ports(), tritonserver=str(script), log_path=tmp_path / "again.log"):
            pass


def test_a_server_that_aborts_under_a_load_call_is_started_once_more(tmp_path, nowhere, monkeypatch):
    """The abort can also end a model's load call (its gRPC stream removed) before serve sees the exit: the load's
    failure is taken for the abort it is, and the server started once more, as an abort between calls is."""
    (tmp_path / "repo").mkdir()
    log = tmp_path / "server.log"
    server = TritonServer(tmp_path / "repo", free_ports(), log_path=log)
    server.overrides = {"a model with an override": None}  # so that serve loads the models itself
    calls = []

    def load(_client, _models, _timeout):
        calls.append(server.pid)
        if len(calls) == 1:  # tritonserver aborts while the call is in flight
            (tritonserver,) = psutil.Process(server.pid).children()
            tritonserver.send_signal(signal.SIGABRT)
            raise ServingError("tritonserver could not load a model: Stream removed (Socket closed)")

    monkeypatch.setattr(server, "_load", load)
    with server:
        assert server.reports_ready()
    assert len(calls) == 2 and calls[0] != calls[1]
    assert "tritonserver aborted while loading the models; starting it once more" in log.read_text()


def test_bundled_server_on_an_empty_repository(tmp_path, nowhere):
    (tmp_path / "repo").mkdir()
    with TritonServer(tmp_path / "repo", free_ports()) as running:
        client = grpcclient.InferenceServerClient(running.url)
        assert client.is_server_live() and client.is_server_ready()
        client.close()
        (tritonserver,) = psutil.Process(running.pid).children()  # under its guard
        listening = [c.laddr.ip for c in tritonserver.net_connections("inet") if c.status == "LISTEN"]
        assert len(listening) == 3 and all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip in listening)
    assert running.wait() == 0 and group_gone(running.pid)


def test_serve_runs_in_the_foreground_and_stops_cleanly_on_sigterm(tmp_path, nowhere):
    repo = echo_repository(tmp_path / "repo")
    ports = free_ports()
    flags = ["--repo", str(repo), *port_flags(ports)]
    serving = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT, *flags], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        lines = []
        while not lines or not lines[-1].startswith("ready: "):
            assert time.monotonic() < deadline and serving.poll() is None, lines
            lines.append(serving.stdout.readline())
        assert lines[-1] == (
            f"ready: gRPC 127.0.0.1:{ports.grpc}, HTTP 127.0.0.1:{ports.http}, metrics 127.0.0.1:{ports.metrics}, "
            f"readiness http://127.0.0.1:{ports.ready}/ready\n"
        )
        (guard,) = psutil.Process(serving.pid).children()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports.grpc}")
        text = grpcclient.InferInput(TEXT_INPUT.name, [1], "BYTES")
        sent = np.array(["Qwen3-VL über Triton ✓".encode()], dtype=object)
        text.set_data_from_numpy(sent)
        result = client.infer(ENSEMBLE, [text]).as_numpy(TEXT_OUTPUT.name)
        client.close()
        assert result.tolist() == sent.tolist()  # the python stub under this interpreter's numpy keeps tensors intact
        serving.send_signal(signal.SIGTERM)
        assert serving.wait(timeout=60) == 0
        assert group_gone(guard.pid)
    finally:
        serving.kill()
        serving.wait()
        serving.stdout.close()


def _serve_args(*argv: str) -> ServeOptions:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return serve_options(parser.parse_args(argv))


def test_serve_print_command(tmp_path, nowhere, capsys):
    repo = echo_repository(tmp_path / "repo")
    assert (
        serve(_serve_args("--repo", str(repo), "--grpc-port", "9101", "--address", "0.0.0.0", "--print-command")) == 0
    )
    printed = shlex.split(capsys.readouterr().out)
    install = find_tritonserver()
    assert printed[:2] == [f"{name}={value}" for name, value in install.env.items()]
    # Each server's python stubs name their shared memory with a prefix of its own (removed after a killed server).
    (prefix,) = [a.split("=", 2)[2] for a in printed if a.startswith("--backend-config=python,shm-region-prefix-name")]
    assert prefix.startswith(f"qwen3vl_{os.getpid()}_")
    # Requests in flight at a stop get the whole --stop-grace (default 30 s) to finish: tritonserver's exit timeout.
    assert printed[2:] == launch_command(
        install, repo, ServerPorts(grpc=9101), address="0.0.0.0", drain_s=30, shm_prefix=prefix
    )
    assert "--exit-timeout-secs=30" in printed
    serve(_serve_args("--repo", str(repo), "--stop-grace", "90.5", "--print-command"))
    assert "--exit-timeout-secs=91" in shlex.split(capsys.readouterr().out)

    with pytest.raises(ServingError, match="has no qwen3vl/config.pbtxt; write one with `qwen3vl-trt write-repo`"):
        serve(_serve_args("--repo", str(tmp_path), "--print-command"))
    with pytest.raises(ServingError, match="is not a directory"):
        serve(_serve_args("--repo", str(tmp_path / "missing")))
    with pytest.raises(SystemExit):
        _serve_args("--repo", str(repo), "--http-port", "70000")


def test_serve_options_for_faults_and_back_pressure(tmp_path):
    options = _serve_args("--repo", str(tmp_path), "--stop-grace", "7.5", "--max-queue-size", "3")
    assert options.stop_grace == 7.5 and options.max_queue_size == 3
    defaults = _serve_args("--repo", str(tmp_path))
    assert defaults.stop_grace == 30.0 and defaults.max_queue_size is None
    with pytest.raises(SystemExit):
        _serve_args("--repo", str(tmp_path), "--max-queue-size", "0")
    assert defaults.visual_cache is None
    assert _serve_args("--repo", str(tmp_path), "--visual-cache", "redis://r:6379/1").visual_cache == "redis://r:6379/1"
    assert defaults.ports.ready == 8003 and defaults.warmup
    cold = _serve_args("--repo", str(tmp_path), "--ready-port", "9103", "--no-warmup")
    assert cold.ports == ServerPorts(ready=9103) and not cold.warmup
    with pytest.raises(SystemExit):
        _serve_args("--repo", str(tmp_path), "--visual-cache", "disk")


def test_config_overrides_reach_only_the_models_they_apply_to(tmp_path):
    """serve --max-queue-size replaces the bound write-repo set, on the models that have one, and serve
    --visual-cache the cache of the model that has one; the ensemble loads last, after the models it names."""
    bounded = mc.ModelConfig(name=PREPROCESSING, backend="python", max_batch_size=8)
    serving_config.queue_policy(bounded, 32, timeout_us=500)
    _preprocessing_parameters(visual_cache="memory").apply(bounded)
    serving_config.parameters(bounded, {"other": "kept"})
    unbounded = mc.ModelConfig(name="postprocessing", backend="python", max_batch_size=8)
    unbounded.dynamic_batching.max_queue_delay_microseconds = 100
    ensemble = mc.ModelConfig(name=ENSEMBLE, platform="ensemble", max_batch_size=8)
    for config in (bounded, unbounded, ensemble):
        (tmp_path / config.name).mkdir()
        serving_config.write(tmp_path / config.name, config)
    assert repository_models(tmp_path) == ["postprocessing", PREPROCESSING, ENSEMBLE]
    assert ConfigOverrides().configs(tmp_path) == {}  # nothing to override
    overrides = ConfigOverrides(max_queue_size=2, visual_cache="redis://cache:6379/0")
    configs = overrides.configs(tmp_path)
    assert list(configs) == [PREPROCESSING]
    served = json_format.Parse(configs[PREPROCESSING], mc.ModelConfig())
    policy = served.dynamic_batching.default_queue_policy
    assert (policy.max_queue_size, policy.default_timeout_microseconds) == (2, 500)
    assert policy.timeout_action == mc.ModelQueuePolicy.REJECT
    assert PreprocessingParameters.from_model_config(served).visual_cache == "redis://cache:6379/0"
    assert overrides.kept_by(served) and not overrides.kept_by(bounded)
    assert overrides.kept_by(unbounded)  # nothing to keep
    served.dynamic_batching.default_queue_policy.max_queue_size = 32
    replace(PreprocessingParameters.from_model_config(served), visual_cache="memory").apply(served)
    assert served == bounded  # nothing else changes


def test_a_repository_of_another_layout_is_refused_before_tritonserver_starts(tmp_path):
    """A repository written before this layout holds model.py files that import modules that moved: serve refuses
    it by its schema, saying what to rerun, instead of letting a stub die on it."""
    repo = echo_repository(tmp_path / "repo")
    check_repository(repo)
    ensemble = serving_config.read(repo / ENSEMBLE)
    EnsembleParameters(repository_schema=REPOSITORY_SCHEMA - 1).apply(ensemble)
    serving_config.write(repo / ENSEMBLE, ensemble)
    with pytest.raises(ServingError, match=f"repository schema {REPOSITORY_SCHEMA - 1}.*write-repo .*--force"):
        check_repository(repo)
    del ensemble.parameters["repository_schema"]
    serving_config.write(repo / ENSEMBLE, ensemble)
    with pytest.raises(ServingError, match="repository schema None"):
        check_repository(repo)


def test_a_language_replica_without_a_pool_or_with_a_local_fallback_is_refused_before_tritonserver_starts(tmp_path):
    """--role language has no vision encoder: it needs --vision-pool, and nothing to fall back to locally."""
    repo = echo_repository(tmp_path / "repo")
    with pytest.raises(ServingError, match="give it --vision-pool TARGET"):
        serve(ServeOptions(repo, role="language"))
    with pytest.raises(ServingError, match="no vision encoder to fall back to .*--vision-fallback local"):
        serve(ServeOptions(repo, role="language", vision_pool="127.0.0.1:1", vision_fallback="local"))
    options = _serve_args("--repo", str(repo), "--role", "language", "--vision-pool", "pool:8001")
    assert (options.role, options.vision_pool, options.vision_fallback) == ("language", "pool:8001", None)


def test_a_failed_warm_up_request_ends_serve_naming_it(tmp_path, nowhere, monkeypatch):
    """serve exits (3) when a warm-up request fails: the deployment would fail real requests like it."""
    repo = echo_repository(tmp_path / "repo")
    refused = WarmupRequest("an image for an ensemble without images", "hi", (b"\xff\xd8",))
    monkeypatch.setattr(serve_module, "plan", lambda _repo, images=True, text=True: [refused])
    ports = free_ports()
    with pytest.raises(
        WarmupError, match=r"^warm-up request 1/1 \(an image for an ensemble without images\) failed: "
    ) as e:
        serve(ServeOptions(repo, ports))
    assert e.value.exit_code == 3 and "images" in str(e.value)
    with socket.create_server(("127.0.0.1", ports.ready)):  # the readiness endpoint is closed
        pass


def test_serve_is_ready_again_once_it_warmed_up_a_tritonserver_started_again(tmp_path, nowhere):
    """A tritonserver that exits on its own is started again by the supervisor: serve's /ready says 503 until it is
    ready and warmed up (an echo repository has nothing to warm), then 200 again."""
    repo = echo_repository(tmp_path / "repo")
    ports = free_ports()
    ready = f"http://127.0.0.1:{ports.ready}/ready"
    with (tmp_path / "serve.log").open("w") as log:
        serving = subprocess.Popen(
            [sys.executable, "-c", SERVE_SCRIPT, "--repo", str(repo), *port_flags(ports)], stdout=log, stderr=log
        )
    try:
        _wait_until(lambda: http_status(ready) == 200, serving)
        (guard,) = psutil.Process(serving.pid).children()
        (tritonserver,) = guard.children()
        tritonserver.kill()
        _wait_until(lambda: http_status(ready) == 503, serving, within=10)
        _wait_until(lambda: http_status(ready) == 200, serving)
        (again,) = psutil.Process(serving.pid).children()
        assert again.pid != guard.pid
    finally:
        serving.terminate()
        assert serving.wait(timeout=60) == 0


def _wait_until(condition, process: subprocess.Popen, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)


# A python model that loads for a minute once `marker` exists: a restarted server that is slow to be ready.
SLOW_MODEL = """
import os
import time


class TritonPythonModel:
    def initialize(self, args):
        if os.path.exists({marker!r}):
            time.sleep(60)

    def execute(self, requests):
        return []
"""


def _pid(server: TritonServer) -> int | None:
    try:
        return server.pid
    except ServingError:  # between a restart's two processes
        return None


def test_a_stop_while_the_supervisor_restarts_the_server_is_bounded_and_leaves_nothing(tmp_path, nowhere):
    """A server that exits on its own is started again by the supervisor, which loads every model again (minutes for
    a real LLM engine). A stop meanwhile stops the new server within the grace instead of waiting for it to be
    ready, and the shared memory the killed server's stubs left in /dev/shm is removed."""
    repo = echo_repository(tmp_path / "repo")
    marker = tmp_path / "slow"
    io = dict(input=[serving_config.model_input(TEXT_INPUT)], output=[serving_config.model_output(TEXT_OUTPUT)])
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "1" / "model.py").write_text(SLOW_MODEL.format(marker=str(marker)))
    serving_config.write(repo / "slow", mc.ModelConfig(name="slow", backend="python", max_batch_size=0, **io))
    server = TritonServer(repo, free_ports(), stop_grace=3.0)
    with server:
        regions = lambda: sorted(SHM_DIR.glob(f"{server.shm_prefix}*"))  # noqa: E731
        assert regions()  # the stubs' regions carry this server's prefix
        first = server.pid
        marker.touch()
        (tritonserver,) = psutil.Process(first).children()
        tritonserver.kill()  # SIGKILL: its stubs' regions stay behind
        deadline = time.monotonic() + 30
        while _pid(server) in (first, None) or len(group_stubs(server.pid).live) < 2:  # the new one is loading
            assert time.monotonic() < deadline
            time.sleep(0.1)
        started = time.monotonic()
        server.stop()
        stopped = time.monotonic() - started
        assert stopped < 3.0 + 5.0, stopped  # not the slow model's minute
        assert server.supervisor is not None and not server.supervisor.restarting
    assert group_gone(first) and group_gone(server.pid)
    assert regions() == []
