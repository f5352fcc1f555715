"""The tritonserver that `serve` runs: under a small guard process that leads its process group, so that a stop is
SIGTERM to the group, then SIGKILL after the grace period, and the launching process's death, however it dies, kills
the whole group, python stubs included (PR_SET_PDEATHSIG). The stubs would outlive a dead server where nothing reaps
it (python_backend r24.10 src/pb_stub.cc polls `kill(parent_pid, 0)`, which a zombie passes). While it runs,
server.supervisor brings back a stage whose python stub died, and a server that exits on its own is started again.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ...errors import ServingError
from ..ports import DEFAULT_PORTS, READY_TIMEOUT_S, STOP_GRACE_S, ServerPorts, host_port
from .launch import ConfigOverrides, launch_command, repository_models
from .supervisor import StageSupervisor, group_stubs
from .tritonserver_install import NGC_IMAGE, find_tritonserver

if TYPE_CHECKING:
    from tritonclient.grpc import InferenceServerClient


ABORTED = 128 + signal.SIGABRT  # the guard's status for a server that aborted
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# The guard: forwards nothing itself (the group gets the signals), waits for the server and exits with its
# status; SIGUSR1, its parent-death signal, kills the group. `trap :` rather than ignoring: a signal ignored
# in the shell would stay ignored in the server it starts (bash(1), COMMAND EXECUTION ENVIRONMENT).
_GUARD = (
    'trap : TERM INT; trap "kill -KILL 0" USR1; "$@" & server=$!; '
    'while :; do wait "$server"; status=$?; kill -0 "$server" 2>/dev/null || exit "$status"; done'
)


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGUSR1 when the thread that started it exits (prctl(2))."""

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os.kill(os.getpid(), signal.SIGUSR1)

    return preexec


# Python-backend shared-memory regions are named by a prefix and a UUID (python_backend r24.10 src/stub_launcher.cc);
# a server killed with SIGKILL leaves them in /dev/shm. Each server gets a prefix of its own, so that what it leaves
# is removed once its group is gone, and nothing of another server's.
SHM_DIR = Path("/dev/shm")
_SERVER_NUMBERS = itertools.count()


def process_shm_prefix(pid: int) -> str:
    """What the shared-memory regions of every server that process `pid` starts begin with."""
    return f"qwen3vl_{pid}_"


# How long a failed load call waits to see whether the server died under it (an abort is started once more).
LOAD_EXIT_S = 5.0
# How long `wait_ready` waits for superseded instances' stubs to end (seen: 1.7 s for the decoupled preprocessing).
SUPERSEDED_STUBS_S = 30.0


# A stopping server one of whose stages crashed is ended once its stubs have not changed for this long in the
# unloading phase (TritonServer._unloaded_but_held): a model with nothing in flight unloads within a second or
# two (its stub's finalize), one held by a dead stub's requests never does.
UNLOAD_STALL_S = 2.0
UNLOAD_POLL_S = 0.2


class TritonServer:
    """A tritonserver (or its MPI ranks) under its guard, in its own process group; as a context manager,
    started and ready. A single server is supervised (server.supervisor): a stage whose python stub dies is
    unloaded and loaded again, and a server that exits on its own is started again (a few times).
    max_queue_size, visual_cache, vision_pool and vision_fallback override the repository's queue bound, visual cache
    and vision pool (ConfigOverrides); `models` loads only those (serve's role's), not every model; config_name: the
    models' alternative configs it loads (serving_config.LANGUAGE_CONFIG: serve --role language)."""

    log_tail_lines = 30

    def __init__(
        self,
        repo: Path,
        ports: ServerPorts = DEFAULT_PORTS,
        address: str = "127.0.0.1",
        tritonserver: str | None = None,
        log_path: Path | None = None,
        ready_timeout: float = READY_TIMEOUT_S,
        *,
        log_verbose: int = 0,
        passthrough: bool = False,  # output to this process's stdout/stderr instead of log_path
        stop_grace: float = STOP_GRACE_S,
        max_queue_size: int | None = None,
        visual_cache: str | None = None,
        supervise: bool = True,
        models: Sequence[str] | None = None,
        vision_pool: str | None = None,
        vision_fallback: str | None = None,
        config_name: str | None = None,
    ) -> None:
        self.repo = Path(repo)
        self.ports = ports
        self.address = address
        self.install = find_tritonserver(tritonserver)
        self.config_overrides = ConfigOverrides(max_queue_size, visual_cache, vision_pool, vision_fallback)
        self.overrides = self.config_overrides.configs(self.repo, config_name)
        # The models to load (serve's role's: serving.server.serve), None: every model of the repository.
        self.models = list(models) if models is not None else None
        # A random part too: servers in other PID namespaces may share this /dev/shm (a container with --ipc=host).
        self.shm_prefix = f"{process_shm_prefix(os.getpid())}{next(_SERVER_NUMBERS)}_{secrets.token_hex(4)}_"
        # Requests in flight at a stop get the whole grace to finish (a pod's drain), not tritonserver's 30 s.
        self.command = launch_command(
            self.install,
            self.repo,
            ports,
            address,
            log_verbose,
            load_at_start=not self.overrides and self.models is None,
            drain_s=stop_grace,
            shm_prefix=self.shm_prefix,
            config_name=config_name,
        )
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.passthrough = passthrough
        self.stop_grace = stop_grace
        # Explicit model control, which the supervisor needs, is the single server's (launch_command).
        self.supervisor_enabled = supervise and self.command[0] != "mpirun"
        self.supervisor: StageSupervisor | None = None
        self._probe: InferenceServerClient | None = None
        self._ready_probe: InferenceServerClient | None = None  # reports_ready's, on the threads that ask
        self._ready_probe_lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_lock = threading.Lock()
        self._restarting = threading.Lock()  # held while a restart replaces the process; a stop waits for that
        self._stopping = threading.Event()  # set by stop(): a restart in progress gives up waiting for readiness
        self._stubs_at_stop: set[int] | None = None  # the stubs' pids when the server was first told to stop

    @property
    def _explicit(self) -> bool:
        """Whether serve loads the models itself (through the repository API) rather than the server at start."""
        return bool(self.overrides) or self.models is not None

    @property
    def url(self) -> str:
        """Where a gRPC client reaches the server."""
        return host_port(self._host, self.ports.grpc)

    @property
    def metrics_url(self) -> str:
        """Where the server publishes its metrics (Prometheus text), the stages' own among them (stages.metrics)."""
        return f"http://{host_port(self._host, self.ports.metrics)}/metrics"

    @property
    def _host(self) -> str:
        return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.address, self.address)

    @property
    def pid(self) -> int:
        """The guard's pid, which is also the process group of the server and its stubs."""
        if self._process is None:
            raise ServingError("the server has not been started")
        return self._process.pid

    def log(self, line: str) -> None:
        """One line in the server's log (stderr when passing its output through)."""
        with self._log_lock:
            if self._log is None:
                print(f"qwen3vl-trt: {line}", file=sys.stderr, flush=True)
            else:
                self._log.write(f"qwen3vl-trt: {line}\n".encode())
                self._log.flush()

    def start(self) -> None:
        """Starts the server. The thread calling this must live as long as the server: the server is killed
        when it exits (PR_SET_PDEATHSIG is tied to the starting thread)."""
        if self._process is not None:
            raise ServingError("the server was started already")
        self._process = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        """A new server process under its guard (the old one, if any, stays `_process` until this returns: a
        restart never leaves the server without one)."""
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
            # Appending: the server and log() write to the same file.
            self._log = output = open(self.log_path, "ab")
        # A new session makes the guard a process-group leader: stop() reaches the server, its python stubs
        # and MPI ranks, and a terminal's Ctrl-C reaches them only through serve()'s handling.
        return subprocess.Popen(
            ["bash", "-c", _GUARD, "tritonserver-guard", *self.command],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
            env={**os.environ, **self.install.env},
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()),
        )

    def _log_tail(self) -> str:
        if self.passthrough or self.log_path is None:
            return "see its output above"
        lines = self.log_path.read_text(errors="replace").splitlines()[-self.log_tail_lines :]
        return f"the last lines of its log {self.log_path}:\n" + "\n".join(lines)

    def _exited(self, status: int) -> str:
        return f"was killed by signal {status - 128}" if status > 128 else f"exited with status {status}"

    def wait_ready(self) -> None:
        """Loads the models with config overrides once the server is up, then polls gRPC readiness (every
        model loaded) until ready and starts the supervisor; ServingError if the server exits first or the
        timeout passes."""
        self._await_ready()
        if self.supervisor_enabled and self.supervisor is None:
            self.supervisor = StageSupervisor(
                self.pid,
                self._unload,
                self._load_stage,
                self.log,
                lambda: self.poll() is None,
                self._model_ready,
                self._restart,
            )
            self.supervisor.start()

    def _restart(self) -> int:
        """Starts the server again after it exited on its own and waits until it is ready (the supervisor's
        remedy, on its thread); the new process group. A stop meanwhile waits only for the new process to exist
        (then stops it like any), not for it to be ready: a restart loads every model again, for minutes."""
        with self._restarting:
            if self._stopping.is_set():
                raise ServingError("the server is stopping")
            status = self.poll()
            self.log(f"tritonserver {self._exited(status or 0)} on its own; starting it again")
            self._respawn()
        self._await_ready()
        self.log("tritonserver is ready again")
        return self.pid

    def _respawn(self) -> None:
        """A new server process in place of the one that exited."""
        self.signal(signal.SIGKILL)  # what is left of its group: its python stubs outlive it a while
        self._remove_shared_memory()  # the new server's regions are not made yet
        if self._log is not None:
            with self._log_lock:
                self._log.close()
                self._log = None
        self._process = self._spawn()

    def ended(self) -> int | None:
        """The server's exit status once it is down for good (exited, and not being started again), else None."""
        status = self.poll()
        if status is None or (self.supervisor is not None and self.supervisor.restarting):
            return None
        return status

    def _await_ready(self) -> None:
        from tritonclient.grpc import InferenceServerClient
        from tritonclient.utils import InferenceServerException

        if self._process is None:
            raise ServingError("the server has not been started")
        deadline = time.monotonic() + self.ready_timeout
        client = InferenceServerClient(self.url)
        loaded = not self._explicit
        aborted = False
        try:
            while True:
                if self._stopping.is_set():
                    raise ServingError("tritonserver was stopped before it was ready")
                status = self.poll()
                if status == ABORTED and not aborted:
                    # tritonserver 2.51's python backend now and then aborts as stubs start side by side
                    # (boost::interprocess::lock_exception in TRITONBACKEND_ModelInstanceFinalize): once, start again.
                    aborted = True
                    self.log("tritonserver aborted while loading the models; starting it once more")
                    self._respawn()
                    client.close()
                    client = InferenceServerClient(self.url)  # not one in gRPC's reconnect backoff
                    loaded = not self._explicit
                    continue
                if status is not None:
                    raise ServingError(f"tritonserver {self._exited(status)} before it was ready; {self._log_tail()}")
                try:
                    if not loaded and client.is_server_live(client_timeout=2.0):
                        try:
                            models = self.models or repository_models(self.repo)
                            self._load(client, models, deadline - time.monotonic())
                        except ServingError:
                            if self._ended_within(LOAD_EXIT_S) is None:
                                raise
                            continue  # it ended during a load call: the status check tells an abort from an exit
                        loaded = True
                    if loaded and client.is_server_ready(client_timeout=2.0):
                        break
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
        if self.overrides:
            self._await_superseded_stubs(deadline)

    def _ended_within(self, seconds: float) -> int | None:
        """The server's exit status if it ends within `seconds` (a load call fails as the server dies, before the
        guard has reaped it), else None."""
        deadline = time.monotonic() + seconds
        while (status := self.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return status

    def _await_superseded_stubs(self, deadline: float) -> None:
        """Waits (until `deadline`) for the stubs of the instances that loading with overrides superseded to end:
        Triton unloads an old instance after the new one is ready, a decoupled one seconds later, and a stub that
        ends while the supervisor watches is one it must tell from a crash (a model left with no stub). Ready
        means one stub per python model."""
        deadline = min(deadline, time.monotonic() + SUPERSEDED_STUBS_S)
        while time.monotonic() < deadline and self.poll() is None:
            models = [stub.model for stub in group_stubs(self.pid).live.values()]
            if len(models) == len(set(models)):
                return
            time.sleep(0.1)

    def _load(self, client: InferenceServerClient, models: list[str], timeout: float) -> None:
        """Loads `models` through the repository API, each with its config override if it has one. Loading an
        ensemble may load its composing models again from their config.pbtxt (seen with tritonserver 2.51),
        so overrides are checked after and applied once more where that happened."""
        from tritonclient.utils import InferenceServerException

        deadline = time.monotonic() + timeout
        try:
            for model in models:
                client.load_model(
                    model, config=self.overrides.get(model), client_timeout=max(1.0, deadline - time.monotonic())
                )
            for model in [m for m in self.overrides if not self._overridden(client, m)]:
                client.load_model(
                    model, config=self.overrides[model], client_timeout=max(1.0, deadline - time.monotonic())
                )
        except InferenceServerException as e:
            raise ServingError(f"tritonserver could not load {model}: {e.message()}; {self._log_tail()}") from None
        reverted = [m for m in self.overrides if not self._overridden(client, m)]
        if reverted:
            raise ServingError(f"tritonserver did not keep the config override of {', '.join(reverted)}")

    def _overridden(self, client: InferenceServerClient, model: str) -> bool:
        """Whether a model carries its override; one not loaded now (a stage being reloaded) has none to carry."""
        if not client.is_model_ready(model):
            return True
        return self.config_overrides.kept_by(client.get_model_config(model).config)

    def _model_ready(self, model: str) -> bool:
        """Whether the server says the model is ready (the supervisor's second signal of a dead stub); True when
        the server does not answer: a server that is gone or busy is not a stage's crash."""
        from tritonclient.grpc import InferenceServerClient

        if self._probe is None:  # the supervisor thread's own, for as long as the server runs
            self._probe = InferenceServerClient(self.url)
        try:
            return bool(self._probe.is_model_ready(model, client_timeout=2.0))
        except Exception:  # tritonclient's own error types
            return True

    def reports_ready(self, timeout_s: float = 1.0) -> bool:
        """Whether tritonserver answers that it is ready (every model loaded and ready: --strict-readiness); False
        when it does not answer within timeout_s (gone, being started again, or hung)."""
        from tritonclient.grpc import InferenceServerClient

        with self._ready_probe_lock:
            if self._ready_probe is None:
                self._ready_probe = InferenceServerClient(self.url)
            probe = self._ready_probe
        try:
            return bool(probe.is_server_ready(client_timeout=timeout_s))
        except Exception:  # tritonclient's own error types, or a probe closed by stop()
            # A new channel next time: this one may sit in gRPC's reconnect backoff (up to 120 s) while a restarted
            # server is up already.
            with self._ready_probe_lock:
                if self._ready_probe is probe:
                    self._ready_probe = None
            with contextlib.suppress(Exception):
                probe.close()
            return False

    def _unload(self, model: str) -> None:
        """Unloads a stage (the supervisor's first step for a dead stub). Returns at once: the old instance
        finishes, or stays with the requests its dead stub held; the stage is not ready until loaded again."""
        from tritonclient.grpc import InferenceServerClient

        client = InferenceServerClient(self.url)
        try:
            client.unload_model(model)
        finally:
            client.close()

    def _load_stage(self, model: str) -> None:
        """Loads a stage again, with its config override (the supervisor's second step)."""
        from tritonclient.grpc import InferenceServerClient

        client = InferenceServerClient(self.url)
        try:
            self._load(client, [model], self.ready_timeout)
        finally:
            client.close()

    def signal(self, signum: int) -> None:
        """Sends `signum` to the server's process group; the first SIGTERM notes the stubs that ran then."""
        if self._process is None:
            return
        if signum == signal.SIGTERM and self._stubs_at_stop is None:
            self._stubs_at_stop = set(group_stubs(self._process.pid).live)
        try:
            os.killpg(self._process.pid, signum)
        except ProcessLookupError:
            pass  # the group is gone already

    def poll(self) -> int | None:
        """The server's exit status (as wait() gives it) if it has exited, else None."""
        if self._process is None:
            raise ServingError("the server has not been started")
        status = self._process.poll()
        return None if status is None else (128 - status if status < 0 else status)

    def wait(self) -> int:
        """Waits for the server to exit; its exit status, 128 + N when signal N ended it (as a shell reports)."""
        if self._process is None:
            raise ServingError("the server has not been started")
        status = self._process.wait()
        return 128 - status if status < 0 else status

    def stop(self) -> int | None:
        """SIGTERM to the group (a clean shutdown), SIGKILL to what is left after stop_grace seconds, or as soon
        as what is left waits only for requests a crashed stage's stub held (_unloaded_but_held). The server's exit
        status (0 for the second); None if it was never started."""
        self._stopping.set()
        if self.supervisor is not None:
            self.supervisor.stop(wait=False)  # a reload in progress ends with the server
        with self._restarting:  # a restart replacing the process ends first (seconds), then its server is stopped
            process = self._process
        if process is None:
            return None
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace
        held = self._unloaded_but_held(process, deadline) if self.supervisor and self.supervisor.crashed else False
        if not held:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log(f"tritonserver did not stop within {self.stop_grace:g} s of SIGTERM; killing it")
        self.signal(signal.SIGKILL)  # the server if it hung, or whatever of its group outlived it
        status = self.wait()
        if held:
            status = 0  # nothing was left but what the crashed stage held: a completed stop
        self._remove_shared_memory()
        if self.supervisor is not None:
            self.supervisor.stop()
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        with self._ready_probe_lock:
            if self._ready_probe is not None:
                self._ready_probe.close()
                self._ready_probe = None
        if self._log is not None:
            with self._log_lock:
                self._log.close()
                self._log = None
        return status

    def _unloaded_but_held(self, process: subprocess.Popen[bytes], deadline: float) -> bool:
        """After SIGTERM to a server one of whose stages crashed: whether it came to wait only for what that stage's
        dead stub held (then it is to be ended), rather than exiting or reaching the deadline.

        tritonserver 2.51 stops in two phases (core r24.10 server.cc InferenceServer::Stop): it waits for the
        requests in flight, then unloads every model and waits for each to be gone. Every model's stub is
        stopped in the second phase only, so the first stub to exit says the first is over: no request is in
        flight any more. A model that requests of a crashed stub reached (its ensembles, the steps before it) is
        never gone: those requests are never released. So once a stub has exited and the stubs left have stayed
        the same for UNLOAD_STALL_S, nothing is left to wait for."""
        supervisor = self.supervisor
        assert supervisor is not None
        stubs = self._stubs_at_stop or set()
        unloading, since = False, time.monotonic()
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(UNLOAD_POLL_S)
            now, live = time.monotonic(), set(group_stubs(process.pid).live)
            if live != stubs:
                unloading = unloading or bool(stubs - live)
                stubs, since = live, now
            elif unloading and now - since >= UNLOAD_STALL_S:
                crashed = ", ".join(sorted(supervisor.crashed))
                self.log(
                    f"tritonserver has unloaded its models but those that requests of the crashed stage ({crashed}) "
                    "still hold, which its dead stub never ends; ending it"
                )
                return True
        return False

    def _remove_shared_memory(self) -> None:
        """Removes the python-backend regions this server's stubs left (a killed server's; a clean stop leaves
        none). Their names go; a process still mapping one keeps it until it exits."""
        for region in SHM_DIR.glob(f"{self.shm_prefix}*"):
            region.unlink(missing_ok=True)

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
