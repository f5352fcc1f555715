"""`qwen3vl-trt serve`: runs a tritonserver (server.tritonserver: under its guard, supervised) on a repository until
it exits or is stopped, warms it up, and serves its readiness and, with --openai-port, the OpenAI gateway.

serve's own readiness endpoint (server.readiness, --ready-port) says ready once tritonserver is ready and serve has
warmed it up (server.warmup), and while tritonserver stays ready.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from ...errors import ServingError
from ..gateway.options import DEFAULT_GATEWAY_OPTIONS, GatewayOptions
from ..interface import ENSEMBLE, PREPROCESSING, VISION_ENCODER
from ..parameters import REPOSITORY_SCHEMA, EnsembleParameters, ParameterError, PreprocessingParameters
from ..ports import (
    DEFAULT_PORTS,
    READY_TIMEOUT_S,
    STOP_GRACE_S,
    ServerPorts,
    host_port,
)
from ..repository import model_config as serving_config
from ..targets import FleetTarget
from .launch import repository_models
from .readiness import TRITON_ANSWER_S, TRITON_PROBE_TIMEOUT_S, BuildInfo, Readiness, ReadinessServer, ServeMetrics
from .tritonserver import TritonServer
from .warmup import WarmupError, WarmupRequest, plan, warm_up

if TYPE_CHECKING:
    from ..gateway.app import GatewayServer

# tritonserver looks for GPUs when it starts and logs each thing it does not find as a warning or an error.
CPU_TARGET_NOTE = (
    "a CPU target's repository: what tritonserver logs below about the CUDA driver, NVML, DCGM, pinned memory and "
    "CUDA streams says only that it found no GPU here, which this repository does not use"
)


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
    ensemble = serving_config.read(repo / ENSEMBLE)
    try:
        schema = EnsembleParameters.from_model_config(ensemble).repository_schema
    except ParameterError:
        schema = None
    if schema != REPOSITORY_SCHEMA:
        # Its model.py files and parameters are another version's: a stub would die on them at load.
        raise ServingError(
            f"{repo} was written by another version of qwen3vl-trt (repository schema {schema}, this version serves "
            f"{REPOSITORY_SCHEMA}); write it again with `qwen3vl-trt write-repo --build-dir BUILD --output {repo} "
            "--force`, or rebuild with `qwen3vl-trt build --force`"
        )


# What `serve --role` runs: the whole deployment; a vision pool member (stages.vision_pool); or a replica that leaves
# every image and video to a vision pool (no vision encoder of its own: its GPU memory goes to the KV cache).
REPLICA_ROLE, VISION_ROLE, LANGUAGE_ROLE = "replica", "vision", "language"
ROLES = (REPLICA_ROLE, VISION_ROLE, LANGUAGE_ROLE)
VISION_MODELS = (VISION_ENCODER, PREPROCESSING)  # a member's, in load order (preprocessing calls the encoder)
NO_POOL_MEMBER = "no vision pool member ready"


def role_models(repo: Path, role: str) -> list[str] | None:
    """The models a role loads (None: every model of the repository)."""
    if role == VISION_ROLE:
        return list(VISION_MODELS)
    if role == LANGUAGE_ROLE:
        return [model for model in repository_models(repo) if model != VISION_ENCODER]
    return None


def role_config(role: str) -> str | None:
    """The models' alternative configs a role loads (serving_config.LANGUAGE_CONFIG), None: config.pbtxt."""
    return serving_config.LANGUAGE_CONFIG if role == LANGUAGE_ROLE else None


class VisionPoolProbe:
    """The members of a vision pool (its target, resolved again on every look) as a replica of `repo` sees them:
    whether one answers ready now, and what a member that serves another repository differs in
    (PreprocessingParameters.pool_mismatch)."""

    def __init__(self, target: str, repo: Path):
        self.target = FleetTarget.parse(target)
        self.repo = Path(repo)
        self.mine = PreprocessingParameters.from_model_config(serving_config.read(self.repo / PREPROCESSING))
        self._missing: str | None = NO_POOL_MEMBER  # until the first look
        self._stop = threading.Event()

    def addresses(self) -> list[str]:
        try:
            return list(self.target.resolve())
        except Exception:  # a resolver that fails now: no member known, this time
            return []

    def member(self, address: str, timeout_s: float = 5.0) -> tuple[bool, str | None]:
        """Whether the member at `address` answers with its preprocessing ready, and what it does not share with this
        replica (None: it serves this repository, or does not answer)."""
        from tritonclient.grpc import InferenceServerClient

        client = InferenceServerClient(address)
        try:
            config = client.get_model_config(PREPROCESSING, client_timeout=timeout_s).config
            ready = client.is_model_ready(PREPROCESSING, client_timeout=timeout_s)
        except Exception:  # not answering (tritonclient's own error types)
            return False, None
        finally:
            client.close()
        try:
            why = self.mine.pool_mismatch(PreprocessingParameters.from_model_config(config))
        except ParameterError as e:  # another version's repository
            why = str(e)
        return ready and why is None, why

    def check(self) -> None:
        """Refuses a pool whose members that answer now serve another repository, naming the member; members that
        do not answer yet are checked by preprocessing before their first request."""
        for address in self.addresses():
            why = self.member(address)[1]
            if why is not None:
                raise ServingError(
                    f"the vision pool member {address} serves another repository than {self.repo}: {why}"
                )

    def look(self) -> str | None:
        """None when a member serving this repository is ready now, else why the pool has none (NO_POOL_MEMBER, and
        the members that serve another repository); each member given TRITON_PROBE_TIMEOUT_S."""
        others = []
        for address in self.addresses():
            ready, why = self.member(address, TRITON_PROBE_TIMEOUT_S)
            if ready:
                return None
            if why is not None:
                others.append(f"{address} serves another repository: {why}")
        return f"{NO_POOL_MEMBER} ({'; '.join(others)})" if others else NO_POOL_MEMBER

    def missing(self) -> str | None:
        """The last look's answer (a language replica's readiness needs it None): probes never wait on members."""
        return self._missing

    def watch(self) -> None:
        """Looks again every TRITON_ANSWER_S on a thread of its own, until stop()."""

        def run() -> None:
            while not self._stop.is_set():
                self._missing = self.look()
                self._stop.wait(TRITON_ANSWER_S)

        threading.Thread(target=run, name="vision-pool-probe", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()


def check_vision_pool(target: str, repo: Path) -> None:
    """Refuses, before anything starts, a vision pool whose members that answer now serve another repository
    (VisionPoolProbe.check)."""
    VisionPoolProbe(target, repo).check()


@dataclass(frozen=True)
class ServeOptions:
    """What `qwen3vl-trt serve` runs: the repository, where its endpoints listen (tritonserver's and serve's own
    readiness endpoint), which tritonserver, and the OpenAI gateway beside it when openai_port is set (with `gateway`'s
    options). stop_grace: seconds from SIGTERM to SIGKILL when stopping; max_queue_size and visual_cache: override
    the repository's queue bound and visual cache; warmup: send the warm-up requests (server.warmup) before ready.
    role (ROLES): a replica serves the whole deployment; a vision pool member (`vision`) only preprocessing and the
    vision encoder, which replicas started with vision_pool (its target) send the images and videos their visual
    cache does not hold; vision_fallback: what such a replica does when no member answers (VISION_FALLBACKS); a
    `language` replica loads no vision encoder, needs a vision pool and is ready only while a member is."""

    repo: Path
    ports: ServerPorts = DEFAULT_PORTS
    address: str = "127.0.0.1"
    tritonserver: str | None = None
    print_command: bool = False
    log_verbose: int = 0
    ready_timeout: float = READY_TIMEOUT_S
    openai_port: int | None = None
    gateway: GatewayOptions = DEFAULT_GATEWAY_OPTIONS
    stop_grace: float = STOP_GRACE_S
    max_queue_size: int | None = None
    visual_cache: str | None = None
    warmup: bool = True
    role: str = "replica"
    vision_pool: str | None = None
    vision_fallback: str | None = None


class _Warmer:
    """Warms a ready tritonserver up (server.warmup) and says so to the readiness endpoint, once at start and again
    for each server the supervisor starts again (its stages load cold)."""

    def __init__(
        self,
        server: TritonServer,
        readiness: Readiness,
        metrics: ServeMetrics,
        requests: list[WarmupRequest],
        model: str | None = None,
    ) -> None:
        self.server, self.readiness, self.metrics, self.requests = server, readiness, metrics, requests
        self.model = model  # what the requests go to (None: the ensemble)
        self.warmed: int | None = None  # the server process warmed up last

    def warm(self) -> None:
        """Warms the server up now; WarmupError when a request fails."""
        pid = self.server.pid
        self.readiness.warming_up()
        seconds = warm_up(
            self.server.url,
            self.requests,
            self.server.log,
            self.server.ready_timeout,
            answered=self.metrics.warmup_requests.inc,
            model=self.model,
        )
        self.metrics.warmup_seconds.set(seconds)
        if self.requests:
            self.server.log(f"warmed up in {seconds:.1f} s")
        self.warmed = pid
        self.readiness.warmed(pid)

    def rewarm(self) -> None:
        """Warms a server started again once it is ready; one that stops being ready meanwhile (started again once
        more, or stopped) is warmed once it is back."""
        if self.server.pid == self.warmed or not self.server.reports_ready():
            return
        try:
            self.warm()
        except WarmupError as e:
            if self.server.reports_ready():
                raise
            self.server.log(f"{e}; tritonserver is not ready now: warming up again once it is")


def serve(args: ServeOptions) -> int:
    """Runs the server in the foreground until it exits or this process gets SIGINT/SIGTERM, which stop it
    (TritonServer.stop: SIGTERM, SIGKILL after the grace period); the server's exit status. Its readiness endpoint
    (server.readiness) says ready once the server is ready and warmed up (server.warmup)."""
    check_repository(args.repo)
    vision, language = args.role == VISION_ROLE, args.role == LANGUAGE_ROLE
    if vision and (args.openai_port is not None or args.vision_pool is not None):
        raise ServingError("a vision pool member (--role vision) runs no gateway and no pool of its own")
    if language and args.vision_pool is None:
        raise ServingError(
            "a language replica (--role language) leaves its images and videos to a vision pool: give it "
            "--vision-pool TARGET, or serve the whole deployment with --role replica"
        )
    if language and args.vision_fallback not in (None, "fail"):
        raise ServingError(
            f"a language replica (--role language) has no vision encoder to fall back to (--vision-fallback "
            f"{args.vision_fallback}): its images fail while no pool member answers; --role replica encodes them here"
        )
    pool = VisionPoolProbe(args.vision_pool, args.repo) if args.vision_pool is not None else None
    if pool is not None:
        pool.check()
    server = TritonServer(
        args.repo,
        args.ports,
        args.address,
        args.tritonserver,
        ready_timeout=args.ready_timeout,
        log_verbose=args.log_verbose,
        passthrough=True,
        stop_grace=args.stop_grace,
        max_queue_size=args.max_queue_size,
        visual_cache=args.visual_cache,
        models=role_models(args.repo, args.role),
        vision_pool=args.vision_pool,
        vision_fallback="fail" if language else args.vision_fallback,  # as its language configs say
        config_name=role_config(args.role),
    )
    if args.print_command:
        env = [f"{name}={shlex.quote(value)}" for name, value in server.install.env.items()]
        print(" ".join([*env, shlex.join(server.command)]))
        return 0
    build = BuildInfo.of_repository(args.repo)
    readiness = Readiness(server.reports_ready, lambda: server.pid)
    if language and pool is not None:
        readiness.needs(pool.missing)
        pool.watch()
    metrics = ServeMetrics(readiness, build)
    requests = plan(args.repo, images=not language, text=not vision) if args.warmup else []
    warmer = _Warmer(server, readiness, metrics, requests, PREPROCESSING if vision else None)
    endpoint = ReadinessServer(readiness, metrics, build, args.address, args.ports.ready)
    stopping = threading.Event()

    def stop(_signum: int, _frame: FrameType | None) -> None:
        stopping.set()
        readiness.stopping()
        server.signal(signal.SIGTERM)  # tritonserver shuts down cleanly on SIGTERM (and SIGINT)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    gateway: GatewayServer | None = None
    try:
        endpoint.start()
        server.log(build.note)
        if build.target == "cpu":
            server.log(CPU_TARGET_NOTE)
        print(f"starting {server.install.binary} ({server.install.source})", file=sys.stderr, flush=True)
        server.start()
        if stopping.is_set():  # a signal that came before the server existed
            server.signal(signal.SIGTERM)
        try:
            server.wait_ready()
        except ServingError:
            if stopping.is_set():  # told to stop while loading: not a failure to report
                return server.stop() or 0
            raise
        ports = server.ports
        if args.openai_port is not None:
            from ..gateway.app import GatewayServer
            from ..gateway.auth import access_note
            from ..gateway.settings import GatewaySettings

            settings = GatewaySettings.from_repository(server.url, args.repo, args.gateway)
            # Its one replica is this one: it takes this process's readiness, warm-up included; this process is ready
            # once the gateway routes to it.
            gateway = GatewayServer(settings, args.address, args.openai_port, readiness=readiness.replica_ready)
            gateway.start()
            readiness.also_requires(gateway.serving)
            if note := access_note(settings.api_keys, args.gateway.open_metrics, args.address, gateway.url):
                print(note, file=sys.stderr, flush=True)
        try:
            warmer.warm()
        except WarmupError:
            if stopping.is_set():  # told to stop while warming up
                return server.stop() or 0
            raise
        print(
            f"ready: gRPC {host_port(args.address, ports.grpc)}, HTTP {host_port(args.address, ports.http)}, "
            f"metrics {host_port(args.address, ports.metrics)}, readiness {endpoint.url}/ready"
            + (f", OpenAI {gateway.url}/v1" if gateway else ""),
            flush=True,
        )
        # Waits in steps, so a stop signal leads to the bounded stop below even if the server hangs; a server
        # that exits on its own is started again by its supervisor (a few times) and warmed up again, else ends serve.
        while (status := server.ended()) is None and not stopping.wait(0.5):
            warmer.rewarm()
        if status is not None:
            return status
        return server.stop() or 0
    finally:
        readiness.stopping()
        if pool is not None:
            pool.stop()
        if gateway is not None:
            gateway.stop()
        server.stop()
        endpoint.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
