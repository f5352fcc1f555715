"""The command lines `serve` runs: one tritonserver, or one per rank under MPI.

A repository whose `llm` is a TensorRT-LLM engine of TP x PP > 1 runs one tritonserver per rank under MPI,
the way TensorRT-LLM's `triton_backend/scripts/launch_triton_server.py` (v1.2.1) launches them. Every
endpoint binds to loopback unless another address is asked for: the bundled server listens on all
interfaces by default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ...common.fsutil import json_entry, read_json
from ...errors import ServingError
from ..interface import LLM, PREPROCESSING
from ..parameters import PreprocessingParameters
from ..ports import ServerPorts
from ..repository import model_config as serving_config
from .tritonserver_install import TritonInstall


def server_command(
    install: TritonInstall,
    repo: Path,
    ports: ServerPorts,
    address: str = "127.0.0.1",
    log_verbose: int = 0,
    extra: Sequence[str] = (),
    drain_s: float | None = None,
) -> list[str]:
    """One tritonserver's arguments (flags of tritonserver 2.51 and the NGC images'). drain_s: how long a stopping
    server waits for the requests in flight (its --exit-timeout-secs; None: its default, 30 s)."""
    command = [str(install.binary), f"--model-repository={Path(repo).absolute()}"]
    if install.backend_dir is not None:
        command.append(f"--backend-directory={install.backend_dir}")
    return [
        *command,
        f"--grpc-address={address}",
        f"--http-address={address}",
        f"--metrics-address={address}",
        f"--grpc-port={ports.grpc}",
        f"--http-port={ports.http}",
        f"--metrics-port={ports.metrics}",
        "--exit-on-error=true",
        "--strict-readiness=true",  # ready only when every model is
        f"--log-verbose={log_verbose}",
        *([] if drain_s is None else [f"--exit-timeout-secs={math.ceil(drain_s)}"]),
        *extra,
    ]


def world_size(repo: Path) -> int:
    """How many ranks the repository's `llm` runs on: the TensorRT-LLM engine's world size (TP x PP x CP, as
    its config.json records it); 1 for the CPU target's python `llm` or a repository without one."""
    if not (Path(repo) / LLM / serving_config.CONFIG_FILE).is_file():
        return 1
    llm = serving_config.read(Path(repo) / LLM)
    if llm.backend != "tensorrtllm":
        return 1
    engine = llm.parameters["gpt_model_path"].string_value if "gpt_model_path" in llm.parameters else ""
    if not engine:
        raise ServingError(
            f"{repo / LLM / serving_config.CONFIG_FILE} has no gpt_model_path parameter; write the "
            "repository again with `qwen3vl-trt write-repo`"
        )
    # Relative paths resolve against the working directory, as the backend in the launched server reads them.
    path = Path(engine) / "config.json"
    content = read_json(
        path,
        f"the LLM engine config {path} does not exist; build the engine (build-llm-engine) "
        "or point gpt_model_path at it",
    )
    where, fix = f"{path} pretrained_config.mapping", "rebuild the engine with TensorRT-LLM 1.2.1"
    mapping = json_entry(content, "pretrained_config.mapping", dict, str(path), fix)
    if "world_size" in mapping:  # tensorrt_llm/mapping.py Mapping.to_dict writes it
        return json_entry(mapping, "world_size", int, where, fix)
    sizes = [json_entry(mapping, key, int, where, fix) for key in ("tp_size", "pp_size", "cp_size") if key in mapping]
    if len(sizes) < 2:
        raise ServingError(f"{where} has neither world_size nor tp_size and pp_size; {fix}")
    return math.prod(sizes)


def mpi_command(
    install: TritonInstall,
    repo: Path,
    ports: ServerPorts,
    world: int,
    address: str = "127.0.0.1",
    log_verbose: int = 0,
    rank0_extra: Sequence[str] = (),
    drain_s: float | None = None,
    shm_prefix: str = "prefix",
    load_at_start: bool = True,
    every_rank: Sequence[str] = (),
) -> list[str]:
    """`mpirun` with one tritonserver per rank, as TensorRT-LLM v1.2.1's
    triton_backend/scripts/launch_triton_server.py (get_cmd) builds it: rank 0 serves the whole repository;
    the others load only `llm`, whose backend keeps them in its worker loop (leader mode), so they never get
    to open the ports they are given. Every rank gets its own python-backend shared-memory prefix (`shm_prefix`
    and its rank) and no config auto-completion; rank0_extra (the CUDA memory pool of the python models) goes to
    rank 0 only, as launch_triton_server.py passes --multimodal_gpu0_cuda_mem_pool_bytes. Unlike upstream's, rank 0
    runs under explicit model control (model_control_flags): in Triton's default mode the repository API refuses
    every load (core r26.04, model_repository_manager.cc: "explicit model load / unload is not allowed if polling
    is enabled"), and `serve` loads the models with config overrides through it (`load_at_start` False). every_rank:
    flags every rank gets (which configs the models load)."""
    command = ["mpirun", "--allow-run-as-root"]
    for rank in range(world):
        own = ["--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name={shm_prefix}{rank}_"]
        if rank == 0:
            own += model_control_flags(load_at_start)
        else:
            own += ["--model-control-mode=explicit", f"--load-model={LLM}"]
        verbose = log_verbose if rank == 0 else 0  # upstream logs rank 0 only
        command += [":", "-n", "1"] if rank else ["-n", "1"]
        rank_extra = [*own, *(rank0_extra if rank == 0 else ()), *every_rank]
        command += server_command(install, repo, ports, address, verbose, rank_extra, drain_s)
    return command


def cuda_pool_flags(repo: Path, config_name: str | None = None) -> list[str]:
    """`--cuda-memory-pool-byte-size=<gpu>:<bytes>` for the GPU of the repository's python models, sized by
    write-repo (serving.repository.gpu_memory) for the configs the server reads (config_name); none for the CPU
    target. Triton's default pool is 64 MB per GPU (command_line_parser.cc), below which python_backend passes device
    tensors by CUDA IPC."""
    path = Path(repo) / PREPROCESSING
    if not (path / serving_config.CONFIG_FILE).is_file():
        return []
    config = serving_config.read(path, config_name)
    pool = PreprocessingParameters.from_model_config(config).cuda_memory_pool_bytes
    if pool is None:
        return []
    gpus = [gpu for group in config.instance_group for gpu in group.gpus]
    if len(set(gpus)) != 1:
        raise ServingError(
            f"{serving_config.config_path(path, config_name)}: expected one GPU and a byte count for the CUDA memory "
            f"pool, got gpus {gpus} and {pool}; write the repository again with `qwen3vl-trt write-repo`"
        )
    return [f"--cuda-memory-pool-byte-size={gpus[0]}:{pool}"]


def model_control_flags(load_at_start: bool) -> list[str]:
    """Explicit model control, so the launcher can unload and load one stage of a running server (the
    supervisor, a config override); `load_at_start`: every model in the repository loads at start, else the
    launcher loads them through the repository API."""
    return ["--model-control-mode=explicit", *(["--load-model=*"] if load_at_start else [])]


def launch_command(
    install: TritonInstall,
    repo: Path,
    ports: ServerPorts,
    address: str = "127.0.0.1",
    log_verbose: int = 0,
    load_at_start: bool = True,
    drain_s: float | None = None,
    shm_prefix: str | None = None,
    config_name: str | None = None,
) -> list[str]:
    """One server, or one per rank under MPI when the engine is split over several GPUs. The single server and MPI's
    rank 0 run under explicit model control (model_control_flags); the other ranks as TensorRT-LLM launches them.
    shm_prefix: the python backend's shared-memory region prefix (None: its default, as upstream's launcher leaves it
    for a single rank; under MPI, upstream's `prefix`), each rank's ending in its rank. config_name: every rank reads
    the models' configs/<name>.pbtxt where they have one (serving_config.LANGUAGE_CONFIG: serve --role language)."""
    world = world_size(repo)
    pool = cuda_pool_flags(repo, config_name)
    named = [] if config_name is None else [f"--model-config-name={config_name}"]
    if world == 1:
        prefix = [] if shm_prefix is None else [f"--backend-config=python,shm-region-prefix-name={shm_prefix}"]
        flags = [*model_control_flags(load_at_start), *pool, *prefix, *named]
        return server_command(install, repo, ports, address, log_verbose, flags, drain_s)
    return mpi_command(
        install, repo, ports, world, address, log_verbose, pool, drain_s, shm_prefix or "prefix", load_at_start, named
    )


def repository_models(repo: Path) -> list[str]:
    """The models of a repository (directories with a config.pbtxt), ensembles last: loading an ensemble loads
    the models it names, which must already carry their overrides."""
    models = sorted(p.parent.name for p in Path(repo).glob(f"*/{serving_config.CONFIG_FILE}"))
    ensembles = [m for m in models if serving_config.read(Path(repo) / m).platform == "ensemble"]
    return [m for m in models if m not in ensembles] + ensembles


@dataclass(frozen=True)
class ConfigOverrides:
    """What `serve` changes in the repository's model configs when it loads them (explicit model control),
    leaving the repository as written: the queue bound of the models whose queue is bounded (write-repo bounds
    the batched models the requests enter), where preprocessing keeps the visual cache, and its vision pool."""

    max_queue_size: int | None = None
    visual_cache: str | None = None
    vision_pool: str | None = None  # the pool's target (serve --vision-pool)
    vision_fallback: str | None = None

    def apply(self, config: mc.ModelConfig) -> bool:
        """Changes `config` in place; whether any override applies to it."""
        applies = False
        policy = config.dynamic_batching.default_queue_policy
        if self.max_queue_size is not None and policy.max_queue_size:
            serving_config.queue_policy(config, self.max_queue_size, policy.default_timeout_microseconds)
            applies = True
        if config.name == PREPROCESSING:
            params = PreprocessingParameters.from_model_config(config)
            overridden = replace(
                params,
                visual_cache=_given(self.visual_cache, params.visual_cache),
                vision_pool=_given(self.vision_pool, params.vision_pool),
                vision_fallback=_given(self.vision_fallback, params.vision_fallback),
            )
            if (self.visual_cache, self.vision_pool, self.vision_fallback) != (None, None, None):
                overridden.apply(config)
                applies = True
        return applies

    def kept_by(self, served: mc.ModelConfig) -> bool:
        """Whether a model's served config carries the overrides that apply to it."""
        overridden = mc.ModelConfig()
        overridden.CopyFrom(served)
        self.apply(overridden)
        return overridden == served

    def configs(self, repo: Path, config_name: str | None = None) -> dict[str, str]:
        """The configs (JSON, as the repository API's load takes them) of the repository's models that the
        overrides apply to, overridden: those the server reads (config_name: configs/<name>.pbtxt where a model has
        one)."""
        overridden = {}
        for model in repository_models(repo):
            config = serving_config.read(Path(repo) / model, config_name)
            if self.apply(config):
                overridden[model] = serving_config.to_json(config)
        return overridden


def _given(value: str | None, default: str) -> str:
    return default if value is None else value
