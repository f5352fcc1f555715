"""`qwen3vl-trt serve`: finds a tritonserver, builds its command line and runs it until it exits or is stopped.

A repository whose `llm` is a TensorRT-LLM engine of TP x PP > 1 runs one tritonserver per rank under MPI,
the way TensorRT-LLM's `triton_backend/scripts/launch_triton_server.py` (v1.2.1) launches them. Every
endpoint binds to loopback unless another address is asked for: the bundled server listens on all
interfaces by default.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING

from ..errors import ServingError
from ..fsutil import json_entry, read_json
from . import config as serving_config
from .endpoints import DEFAULT_PORTS, NO_GATEWAY_OPTIONS, GatewayOptions, ServerPorts, host_port
from .gpu_memory import CUDA_POOL_PARAMETER
from .interface import ENSEMBLE, LLM, PREPROCESSING

if TYPE_CHECKING:
    from .gateway import GatewayServer

ENV_VAR = "QWEN3VL_TRITONSERVER"
NGC_INSTALL = Path("/opt/tritonserver")  # where the NGC images install the server
PYTRITON_VERSION = "0.7.0"  # the wheel whose bundled server (2.51) this package is tested with
NGC_IMAGE = "nvcr.io/nvidia/tritonserver:<tag>-trtllm-python-py3"
INSTALL_HINT = (
    f'install the bundled server with `pip install nvidia-pytriton=={PYTRITON_VERSION} "numpy<2"`, pass '
    f"--tritonserver PATH or set ${ENV_VAR}, or run in the NGC image {NGC_IMAGE}"
)
# The tritonserver files the python backend needs in its backend directory (names as the server expects).
_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
_STUB = "triton_python_backend_stub"


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path | None  # None: the server's default (/opt/tritonserver/backends)
    env: dict[str, str] = field(default_factory=dict)  # variables to set for the server (full values)
    source: str = ""  # where it was found, for messages


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _given(path: str, source: str) -> TritonInstall:
    binary = Path(path).expanduser()
    if not _executable(binary):
        raise ServingError(f"{source} names {path}, which is not an executable file; point it at a tritonserver binary")
    return TritonInstall(binary.absolute(), None, {}, source)


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _numpy_version() -> str | None:
    return _installed_version("numpy")


def _interpreter_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _pytriton_dir() -> Path | None:
    """The installed `pytriton` package directory, found without importing it."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _links_match(directory: Path, links: dict[str, Path]) -> bool:
    return all(
        (directory / name).is_symlink() and (directory / name).resolve() == target for name, target in links.items()
    )


def _prepare_backends(root: Path, links: dict[str, Path]) -> Path:
    """A backend directory whose python/ holds `links`; built beside its final place and renamed in, so a
    server never sees it half made, and reused while its links still point at these files."""
    backends = root / "backends"
    if _links_match(backends / "python", links):
        return backends
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".backends.tmp-", dir=root))
    except OSError as e:
        raise ServingError(
            f"cannot prepare the tritonserver backend directory in {root}: {e}; set XDG_CACHE_HOME to a "
            "writable directory"
        ) from None
    try:
        (tmp / "python").mkdir()
        for name, target in links.items():
            (tmp / "python" / name).symlink_to(target)
        if backends.exists() or backends.is_symlink():  # links to an older or moved install
            stale = root / f".backends.old-{uuid.uuid4().hex[:8]}"
            backends.rename(stale)
            if stale.is_symlink():
                stale.unlink()
            else:
                shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(backends)
    except OSError as e:
        if not _links_match(backends / "python", links):  # else another process published the same links
            raise ServingError(f"cannot prepare the tritonserver backend directory {backends}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return backends


def _wheel_install(package: Path) -> TritonInstall:
    """The server bundled in the nvidia-pytriton wheel, set up to run this interpreter's python backend stub."""
    numpy = _numpy_version()
    if numpy is not None and int(numpy.split(".")[0]) >= 2:
        raise ServingError(
            f"numpy {numpy} is installed in this Python, and the python backend stub bundled with nvidia-pytriton "
            'silently corrupts tensors under numpy 2: run `pip install "numpy<2"`'
        )
    server = package / "tritonserver"
    python = _interpreter_version()
    stub = server / "python_backend_stubs" / python / _STUB
    if not stub.is_file():
        have = sorted(p.parent.name for p in (server / "python_backend_stubs").glob(f"*/{_STUB}"))
        raise ServingError(
            f"the nvidia-pytriton wheel has no python backend stub for Python {python} (it has {', '.join(have)}); "
            "run qwen3vl-trt from one of those Python versions, or pass --tritonserver PATH"
        )
    version = _installed_version("nvidia-pytriton") or "unknown"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    links = {name: (server / "backends" / "python" / name).resolve() for name in _BACKEND_FILES}
    links[_STUB] = stub.resolve()
    backends = _prepare_backends(cache / "qwen3vl-trt" / "tritonserver" / f"{version}-py{python}", links)
    # The stub links libpython3.X.so (the interpreter's LIBDIR) and runs the first python on PATH, so this
    # interpreter, with this environment's packages, runs the models.
    libs = [sysconfig.get_config_var("LIBDIR"), str(package.parent / "nvidia_pytriton.libs")]
    env = {
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in [*libs, os.environ.get("LD_LIBRARY_PATH")] if p),
        "PATH": os.pathsep.join(p for p in [os.path.dirname(sys.executable), os.environ.get("PATH")] if p),
    }
    return TritonInstall(server / "bin" / "tritonserver", backends, env, f"nvidia-pytriton {version} wheel")


def find_tritonserver(explicit: str | None = None) -> TritonInstall:
    """The server to run: `explicit`, $QWEN3VL_TRITONSERVER, `tritonserver` on PATH, the NGC image's, else the
    one in the nvidia-pytriton wheel."""
    if explicit:
        return _given(explicit, "--tritonserver")
    if os.environ.get(ENV_VAR):
        return _given(os.environ[ENV_VAR], f"${ENV_VAR}")
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path).absolute(), None, {}, "PATH")
    if _executable(NGC_INSTALL / "bin" / "tritonserver"):
        return TritonInstall(NGC_INSTALL / "bin" / "tritonserver", None, {}, str(NGC_INSTALL))
    package = _pytriton_dir()
    if package is not None and _executable(package / "tritonserver" / "bin" / "tritonserver"):
        return _wheel_install(package)
    raise ServingError(
        f"no tritonserver found (searched --tritonserver, ${ENV_VAR}, PATH, {NGC_INSTALL}/bin/tritonserver and the "
        f"nvidia-pytriton wheel); {INSTALL_HINT}"
    )


def server_command(
    install: TritonInstall,
    repo: Path,
    ports: ServerPorts,
    address: str = "127.0.0.1",
    log_verbose: int = 0,
    extra: Sequence[str] = (),
) -> list[str]:
    """One tritonserver's arguments (flags of tritonserver 2.51 and the NGC images')."""
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
) -> list[str]:
    """`mpirun` with one tritonserver per rank, as TensorRT-LLM v1.2.1's
    triton_backend/scripts/launch_triton_server.py (get_cmd) builds it: rank 0 serves the whole repository;
    the others load only `llm`, whose backend keeps them in its worker loop (leader mode), so they never get
    to open the ports they are given. Every rank gets its own python-backend shared-memory prefix and no
    config auto-completion; rank0_extra (the CUDA memory pool of the python models) goes to rank 0 only, as
    launch_triton_server.py passes --multimodal_gpu0_cuda_mem_pool_bytes."""
    command = ["mpirun", "--allow-run-as-root"]
    for rank in range(world):
        own = ["--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]
        if rank > 0:
            own += ["--model-control-mode=explicit", f"--load-model={LLM}"]
        verbose = log_verbose if rank == 0 else 0  # upstream logs rank 0 only
        command += [":", "-n", "1"] if rank else ["-n", "1"]
        command += server_command(install, repo, ports, address, verbose, [*own, *(rank0_extra if rank == 0 else ())])
    return command


def cuda_pool_flags(repo: Path) -> list[str]:
    """`--cuda-memory-pool-byte-size=<gpu>:<bytes>` for the GPU of the repository's python models, sized by
    write-repo (serving.gpu_memory); none for the CPU target. Triton's default pool is 64 MB per GPU
    (command_line_parser.cc), below which python_backend passes device tensors by CUDA IPC."""
    path = Path(repo) / PREPROCESSING
    if not (path / serving_config.CONFIG_FILE).is_file():
        return []
    config = serving_config.read(path)
    if CUDA_POOL_PARAMETER not in config.parameters:
        return []
    gpus = [gpu for group in config.instance_group for gpu in group.gpus]
    pool = config.parameters[CUDA_POOL_PARAMETER].string_value
    if len(set(gpus)) != 1 or not pool.isdigit():
        raise ServingError(
            f"{path / serving_config.CONFIG_FILE}: expected one GPU and a byte count for the CUDA memory pool, "
            f"got gpus {gpus} and {pool!r}; write the repository again with `qwen3vl-trt write-repo`"
        )
    return [f"--cuda-memory-pool-byte-size={gpus[0]}:{int(pool)}"]


def launch_command(
    install: TritonInstall, repo: Path, ports: ServerPorts, address: str = "127.0.0.1", log_verbose: int = 0
) -> list[str]:
    """One server, or one per rank under MPI when the engine is split over several GPUs."""
    world = world_size(repo)
    pool = cuda_pool_flags(repo)
    if world == 1:
        return server_command(install, repo, ports, address, log_verbose, pool)
    return mpi_command(install, repo, ports, world, address, log_verbose, pool)


class TritonServer:
    """A tritonserver (or its MPI ranks) in its own process group; as a context manager, started and ready."""

    stop_timeout = 30.0  # seconds between SIGTERM and SIGKILL
    log_tail_lines = 30

    def __init__(
        self,
        repo: Path,
        ports: ServerPorts = DEFAULT_PORTS,
        address: str = "127.0.0.1",
        tritonserver: str | None = None,
        log_path: Path | None = None,
        ready_timeout: float = 300.0,
        *,
        log_verbose: int = 0,
        passthrough: bool = False,  # output to this process's stdout/stderr instead of log_path
    ) -> None:
        self.repo = Path(repo)
        self.ports = ports
        self.address = address
        self.install = find_tritonserver(tritonserver)
        self.command = launch_command(self.install, self.repo, ports, address, log_verbose)
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.passthrough = passthrough
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """Where a gRPC client reaches the server."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.address, self.address)
        return host_port(host, self.ports.grpc)

    @property
    def pid(self) -> int:
        if self._process is None:
            raise ServingError("the server has not been started")
        return self._process.pid

    def start(self) -> None:
        if self._process is not None:
            raise ServingError("the server was started already")
        if self.command[0] == "mpirun" and shutil.which("mpirun") is None:
            raise ServingError(
                "the LLM engine is split over several GPUs, which needs mpirun (Open MPI) on PATH; "
                f"run in the NGC image {NGC_IMAGE}"
            )
        output: IO[bytes] | None = None
        if not self.passthrough:
            if self.log_path is None:
                fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
                os.close(fd)
                self.log_path = Path(name)
            self._log = output = open(self.log_path, "wb")
        # A new session makes the server a process-group leader: stop() reaches its python stubs and MPI
        # ranks too, and a terminal's Ctrl-C reaches it only through serve()'s forwarding.
        self._process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
            env={**os.environ, **self.install.env},
            start_new_session=True,
        )

    def _log_tail(self) -> str:
        if self.passthrough or self.log_path is None:
            return "see its output above"
        lines = self.log_path.read_text(errors="replace").splitlines()[-self.log_tail_lines :]
        return f"the last lines of its log {self.log_path}:\n" + "\n".join(lines)

    def wait_ready(self) -> None:
        """Polls gRPC readiness (every model loaded) until ready; ServingError if the server exits first or the
        timeout passes."""
        from tritonclient.grpc import InferenceServerClient
        from tritonclient.utils import InferenceServerException

        if self._process is None:
            raise ServingError("the server has not been started")
        deadline = time.monotonic() + self.ready_timeout
        client = InferenceServerClient(self.url)
        try:
            while True:
                status = self._process.poll()
                if status is not None:
                    ended = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
                    raise ServingError(f"tritonserver {ended} before it was ready; {self._log_tail()}")
                try:
                    if client.is_server_ready(client_timeout=2.0):
                        return
                except InferenceServerException:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise ServingError(
                        f"tritonserver was not ready after {self.ready_timeout:g} s (models still "
                        f"loading, or stuck); {self._log_tail()}"
                    )
                time.sleep(0.2)
        finally:
            client.close()

    def signal(self, signum: int) -> None:
        """Sends `signum` to the server's process group."""
        if self._process is None:
            return
        try:
            os.killpg(self._process.pid, signum)
        except ProcessLookupError:
            pass  # the group is gone already

    def wait(self) -> int:
        """Waits for the server to exit; its exit status, 128 + N when signal N ended it (as a shell reports)."""
        if self._process is None:
            raise ServingError("the server has not been started")
        status = self._process.wait()
        return 128 - status if status < 0 else status

    def stop(self) -> None:
        """SIGTERM to the group (a clean shutdown), SIGKILL to what is left after stop_timeout seconds."""
        process = self._process
        if process is None:
            return
        self.signal(signal.SIGTERM)
        try:
            process.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            pass
        self.signal(signal.SIGKILL)  # the server if it hung, or whatever of its group outlived it
        process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def check_repository(repo: Path) -> None:
    """Refuses a directory that is not a qwen3vl-trt model repository (no `qwen3vl` ensemble config)."""
    if not repo.is_dir():
        raise ServingError(
            f"model repository {repo} is not a directory; write one with `qwen3vl-trt build` or "
            "`qwen3vl-trt write-repo`"
        )
    if not (repo / ENSEMBLE / serving_config.CONFIG_FILE).is_file():
        raise ServingError(
            f"{repo} is not a qwen3vl-trt model repository: it has no {ENSEMBLE}/"
            f"{serving_config.CONFIG_FILE}; write one with `qwen3vl-trt write-repo`"
        )
    serving_config.read(repo / ENSEMBLE)


@dataclass(frozen=True)
class ServeOptions:
    """What `qwen3vl-trt serve` runs: the repository, where its endpoints listen, which tritonserver, and the
    OpenAI gateway beside it when openai_port is set (with `gateway`'s options)."""

    repo: Path
    ports: ServerPorts = DEFAULT_PORTS
    address: str = "127.0.0.1"
    tritonserver: str | None = None
    print_command: bool = False
    log_verbose: int = 0
    ready_timeout: float = 300.0
    openai_port: int | None = None
    gateway: GatewayOptions = NO_GATEWAY_OPTIONS


def serve(args: ServeOptions) -> int:
    """Runs the server in the foreground until it exits or this process gets SIGINT/SIGTERM (forwarded to
    the server for a clean shutdown); the server's exit status."""
    check_repository(args.repo)
    server = TritonServer(
        args.repo,
        args.ports,
        args.address,
        args.tritonserver,
        ready_timeout=args.ready_timeout,
        log_verbose=args.log_verbose,
        passthrough=True,
    )
    if args.print_command:
        env = [f"{name}={shlex.quote(value)}" for name, value in server.install.env.items()]
        print(" ".join([*env, shlex.join(server.command)]))
        return 0
    stopping: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)
        server.signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
    gateway: GatewayServer | None = None
    try:
        print(f"starting {server.install.binary} ({server.install.source})", file=sys.stderr, flush=True)
        server.start()
        if stopping:  # a signal that came before the server existed
            server.signal(stopping[0])
        try:
            server.wait_ready()
        except ServingError:
            if stopping:  # told to stop while loading: not a failure to report
                return server.wait()
            raise
        ports = server.ports
        if args.openai_port is not None:
            from .gateway import GatewayServer, GatewaySettings

            settings = GatewaySettings.from_repository(server.url, args.repo, args.gateway)
            gateway = GatewayServer(settings, args.address, args.openai_port)
            gateway.start()
        print(
            f"ready: gRPC {host_port(args.address, ports.grpc)}, HTTP {host_port(args.address, ports.http)}, "
            f"metrics {host_port(args.address, ports.metrics)}" + (f", OpenAI {gateway.url}/v1" if gateway else ""),
            flush=True,
        )
        return server.wait()
    finally:
        if gateway is not None:
            gateway.stop()
        server.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
