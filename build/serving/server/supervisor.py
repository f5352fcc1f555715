"""Brings back a stage whose python-backend stub died, without restarting the server.

tritonserver 2.51's python backend (python_backend r24.10) notices a dead stub only when it next talks to it:
src/stub_launcher.cc ReceiveMessageFromStub fails a waiting execute with "Stub process '<instance>' is not
healthy." within about two seconds, but nothing restarts the stub (src/python_be.cc
TRITONBACKEND_ModelInstanceExecute: "TODO: Implement restart on decoupled"), and the model and the server keep
reporting ready. So the launcher runs the server under explicit model control and this supervisor watches the
stub processes in the server's process group (/proc, Linux) and the python models' readiness: when a stub dies,
it unloads that model, which unloads the ensemble that holds it too (core r26.04 ModelsToLoadUnload), so
the model and the ensemble are not ready, and loads it again, which brings both back. A model the ensemble reaches
only through another model's BLS calls (interface.CALLED_BY) is unloaded after its callers and loaded before them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..interface import CALLED_BY

STUB_BINARY = "triton_python_backend_stub"
# A dead stub is noticed within two looks (1 s); the stage is back after that plus its own load time (its
# model.py initialize: 5-10 s for the CPU target's models on two cores), or, while loading fails, retried
# every RETRY_DELAY_S.
POLL_INTERVAL_S = 0.5
RETRY_DELAY_S = 5.0
# tritonserver itself may die too: 2.51 aborts when a stub dies holding the lock of their shared memory
# (boost::interprocess::lock_exception in TRITONBACKEND_ModelInstanceExecute, seen in tests). It is started
# again at most this often; beyond that it stays down, and `serve` exits with its status.
MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0
# Between unloading a stage and loading it again: until the old instance is torn down (its dead stub reaped), at
# most this long (the llm's may never be: its decoupled requests hold it). Loading at once, while the old
# instance was still being torn down, was seen to corrupt tritonserver 2.51's heap ("malloc(): unaligned fastbin
# chunk detected", SIGABRT).
SETTLE_S = 5.0


@dataclass(frozen=True)
class Stub:
    """A running python-backend stub: the model it serves and its instance name (`llm_0_0`)."""

    pid: int
    model: str
    instance: str


def _stat(pid: int) -> tuple[str, int, int] | None:
    """A process's state letter, process group and exit status (waitpid's form, set once it exited) from
    /proc/<pid>/stat (proc(5)); None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name in parentheses may hold spaces
    return fields[0], int(fields[2]), int(fields[-1])


def _ended(status: int) -> str:
    return f"killed by signal {status & 0x7F}" if status & 0x7F else f"exited with status {status >> 8}"


@dataclass(frozen=True)
class GroupStubs:
    live: dict[int, Stub]  # by pid
    exited: dict[int, str]  # pids of processes that exited and are not yet reaped: how they ended


def group_stubs(group: int) -> GroupStubs:
    """The python-backend stubs in process group `group`, and its exited, unreaped processes.

    The stub's arguments (python_backend r24.10 src/stub_launcher.cc Launch): the model's model.py path, the
    shared-memory region, its sizes, the parent pid, the python library, the IPC handle, the instance name."""
    live, exited = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        stat = _stat(pid)
        if stat is None or stat[1] != group:
            continue
        if stat[0] in ("Z", "X"):
            exited[pid] = _ended(stat[2])
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if len(argv) > 8 and Path(argv[0]).name == STUB_BINARY:
            live[pid] = Stub(pid, Path(argv[1]).parent.parent.name, argv[8])
    return GroupStubs(live, exited)


class StageSupervisor:
    """A thread that reloads, through the server's model repository API, every model whose stub dies.

    `unload(model)` and `load(model)` go through the repository API (raising on failure); `log` gets one line per event;
    `alive()` says whether the server still runs; `ready(model)` asks the server; `restart()` starts a server
    that died on its own again and waits until it is ready (its new process group), on this thread, which
    therefore lives until the server is gone.

    Two signals of a dead stub, for the two python backends it runs with: the stub left a zombie (r24.10,
    tritonserver 2.51: nothing reaps it and the model keeps reporting ready), or its model turned not ready
    (r26.04: TRITONBACKEND_ModelInstanceReady asks StubActive, whose waitpid reaps the zombie, so a readiness
    probe by anyone can remove the first signal before it is seen)."""

    def __init__(
        self,
        group: int,
        unload: Callable[[str], None],
        load: Callable[[str], None],
        log: Callable[[str], None],
        alive: Callable[[], bool],
        ready: Callable[[str], bool],
        restart: Callable[[], int],
    ) -> None:
        self.group = group
        self._unload, self._load = unload, load
        self._alive = alive
        self._ready = ready
        self._restart = restart
        self._restarts: list[float] = []  # when the server was started again
        self._log = log
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stage-supervisor", daemon=True)
        self.recoveries: list[tuple[str, float]] = []  # (model, seconds until it was back), for callers
        # Stages whose stub died while the server ran. The server may hold requests that such a stub had for good
        # (python_backend r24.10 never releases a dead decoupled stub's response factories), and with them the
        # ensembles and models those requests reached, which then never unload: a stop knows not to wait for them.
        self.crashed: set[str] = set()

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stops watching and restarting; `wait`: until the thread ended, which it does once the server is gone
        (a server it restarted dies with the thread that started it: serve._die_with_parent)."""
        self._stopping.set()
        if wait and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def restarting(self) -> bool:
        """Whether a server that died will be started again (this thread runs and has not given up)."""
        return self._thread.is_alive() and not self._stopping.is_set()

    def _run(self) -> None:
        try:
            self._supervise()
        except Exception as e:  # a bug here: the server runs on unsupervised, and outlives nothing of this thread
            self._log(f"the stage supervisor failed ({type(e).__name__}: {e}); the stages are no longer watched")
            self._outlive_server()

    def _supervise(self) -> None:
        while True:
            self._watch()
            if self._stopping.is_set():
                self._outlive_server()
                return
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
            if len(self._restarts) >= MAX_RESTARTS:
                self._log(f"tritonserver exited {MAX_RESTARTS} times in {RESTART_WINDOW_S:g} s; not starting it again")
                return
            self._restarts.append(now)
            try:
                self.group = self._restart()
            except Exception as e:  # the new server did not come up (or a stop ended it); it is down for good
                if self._stopping.is_set():
                    self._outlive_server()
                else:
                    self._log(f"tritonserver could not be started again: {str(e).splitlines()[0] if str(e) else e!r}")
                return
            self.recoveries.append(("tritonserver", time.monotonic() - now))
            self.crashed.clear()  # a new server holds nothing of the old one's stubs

    def _outlive_server(self) -> None:
        """Waits for the stop in progress to end the server (bounded by its grace period): a server this thread
        started again dies with it (its parent-death signal), which would cut the stop's drain."""
        while self._alive():
            time.sleep(POLL_INTERVAL_S / 5)

    def _watch(self) -> None:
        """Watches the stages until the server exits or the supervisor stops."""
        # A stub the server stops is reaped at once (stub_launcher.cc WaitForStubProcess); one that died on
        # its own stays a zombie, unreaped until its model unloads. A stub is taken as crashed when it has
        # been a zombie for two looks in a row; its pid is remembered from when it ran (a zombie's
        # command line is empty).
        known = group_stubs(self.group).live
        stages = {stub.model for stub in known.values()}  # the python models
        suspects: set[int] = set()
        unready: set[str] = set()  # stages seen not ready on the last look
        handled: set[int] = set()  # crashed stubs already dealt with (the llm's may stay zombies for good)
        while not self._stopping.wait(POLL_INTERVAL_S):
            if not self._alive():
                return
            scan = group_stubs(self.group)
            handled &= scan.exited.keys()  # a reaped pid may come back as another process
            crashed = [known[pid] for pid in scan.exited if pid in suspects and pid not in handled]
            suspects = {pid for pid in scan.exited if pid in known}
            # A stub reaped before it was seen as a zombie (the backend reaps one whose request it failed, and
            # r26.04's readiness check reaps too) is gone from /proc: crashed when its model has no stub left
            # (a reload that Triton makes starts the new instance's stub before it stops the old one).
            serving = {stub.model for stub in scan.live.values()}
            vanished = [
                stub
                for pid, stub in known.items()
                if pid not in scan.live and pid not in scan.exited and pid not in handled and stub.model not in serving
            ]
            ended = {**scan.exited, **{stub.pid: "reaped by the server" for stub in vanished}}
            crashed += vanished
            known = {**{pid: s for pid, s in known.items() if pid in scan.exited}, **scan.live}
            stages |= serving
            broken = {stub.model: f"lost its python stub {stub.instance} (pid {stub.pid}, {ended[stub.pid]})"
                      for stub in crashed}  # fmt: skip
            not_ready = {model for model in stages - broken.keys() if not self._ready(model)}
            broken.update({model: "is not ready (its python stub died)" for model in not_ready & unready})
            unready = not_ready - broken.keys()
            for model, what in broken.items():
                self._log(f"stage '{model}' {what}: unloading and loading it again")
                self.crashed.add(model)
                dead = {s.pid for s in crashed if s.model == model}
                handled.update(dead)
                self._recover(model, dead)
                if self._stopping.is_set():
                    return
                known.update(group_stubs(self.group).live)

    def _recover(self, model: str, dead: set[int]) -> None:
        started = time.monotonic()
        callers = CALLED_BY.get(model, ())
        unloaded = False
        while not self._stopping.is_set():
            if not self._alive():
                self._log(f"stage '{model}' not loaded again: tritonserver itself has exited")
                return
            try:
                if not unloaded:
                    for caller in callers:  # the ensemble turns not ready with them
                        self._unload(caller)
                    self._unload(model)  # not ready from here on, as is the server (--strict-readiness)
                    unloaded = True
                    settle = time.monotonic() + SETTLE_S
                    while dead & group_stubs(self.group).exited.keys() and time.monotonic() < settle:
                        self._stopping.wait(POLL_INTERVAL_S / 5)
                for loaded in (model, *callers):
                    self._load(loaded)
            except Exception as e:  # the server's refusal, e.g. initialize failing again; keep trying
                first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
                self._log(f"stage '{model}' failed to load again ({first_line}); retrying in {RETRY_DELAY_S:g} s")
                self._stopping.wait(RETRY_DELAY_S)
                continue
            elapsed = time.monotonic() - started
            self.recoveries.append((model, elapsed))
            self._log(f"stage '{model}' is back after {elapsed:.1f} s")
            return
