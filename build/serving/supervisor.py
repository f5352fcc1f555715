"""Brings back a stage whose python-backend stub died, without restarting the server.

tritonserver 2.51's python backend (python_backend r24.10) notices a dead stub only when it next talks to it:
src/stub_launcher.cc ReceiveMessageFromStub fails a waiting execute with "Stub process '<instance>' is not
healthy." within about two seconds, but nothing restarts the stub (src/python_be.cc
TRITONBACKEND_ModelInstanceExecute: "TODO: Implement restart on decoupled"), and the model and the server keep
reporting ready. So the launcher runs the server under explicit model control and this supervisor watches the
stub processes in the server's process group (/proc, Linux): when one exits, it unloads that model, which makes
the model and (with --strict-readiness) the server not ready, and loads it again, which brings readiness back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

STUB_BINARY = "triton_python_backend_stub"
POLL_INTERVAL_S = 0.5  # how soon a dead stub is noticed
RETRY_DELAY_S = 5.0  # between failed loads of a broken stage
# The recovery time bound `serve` states: noticed within POLL_INTERVAL_S, then the stage's own load time
# (its model.py initialize) on top of this.
RECOVERY_OVERHEAD_S = 5.0


@dataclass(frozen=True)
class Stub:
    """A running python-backend stub: the model it serves and its instance name (`llm_0_0`)."""

    pid: int
    model: str
    instance: str


def _stat(pid: int) -> tuple[str, int] | None:
    """A process's state letter and process group, from /proc/<pid>/stat; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name in parentheses may hold spaces
    return fields[0], int(fields[2])


def group_stubs(group: int) -> dict[int, Stub]:
    """The live (not exited) python-backend stubs in process group `group`, by pid.

    The stub's arguments (python_backend r24.10 src/stub_launcher.cc Launch): the model's model.py path, the
    shared-memory region, its sizes, the parent pid, the python library, the IPC handle, the instance name."""
    stubs = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        stat = _stat(pid)
        if stat is None or stat[1] != group or stat[0] in ("Z", "X"):
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if len(argv) > 8 and Path(argv[0]).name == STUB_BINARY:
            stubs[pid] = Stub(pid, Path(argv[1]).parent.parent.name, argv[8])
    return stubs


class StageSupervisor:
    """A thread that reloads, through the server's model repository API, every model whose stub exits.

    `reload(model)` unloads and loads the model again (raising on failure); `log` gets one line per event."""

    def __init__(self, group: int, reload: Callable[[str], None], log: Callable[[str], None]) -> None:
        self.group = group
        self._reload = reload
        self._log = log
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stage-supervisor", daemon=True)
        self.recoveries: list[tuple[str, float]] = []  # (model, seconds until it was back), for callers

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stops watching; `wait`: until a reload in progress has ended too (it ends with the server)."""
        self._stopping.set()
        if wait and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        known = group_stubs(self.group)
        while not self._stopping.wait(POLL_INTERVAL_S):
            live = group_stubs(self.group)
            lost = [stub for pid, stub in known.items() if pid not in live]
            known = live
            for model in dict.fromkeys(stub.model for stub in lost):
                gone = ", ".join(f"{s.instance} (pid {s.pid})" for s in lost if s.model == model)
                self._log(f"stage '{model}' lost its python stub {gone}: unloading and loading it again")
                self._recover(model)
                if self._stopping.is_set():
                    return
                # The model's instances are all new now; another model's stub that died meanwhile is still
                # in `known`, so the next look finds it gone.
                fresh = {pid: s for pid, s in group_stubs(self.group).items() if s.model == model}
                known = {pid: s for pid, s in known.items() if s.model != model} | fresh

    def _recover(self, model: str) -> None:
        started = time.monotonic()
        while not self._stopping.is_set():
            try:
                self._reload(model)
            except Exception as e:  # the server's refusal, e.g. initialize failing again; keep trying
                self._log(f"stage '{model}' failed to load again ({e}); retrying in {RETRY_DELAY_S:g} s")
                self._stopping.wait(RETRY_DELAY_S)
                continue
            elapsed = time.monotonic() - started
            self.recoveries.append((model, elapsed))
            self._log(f"stage '{model}' is back after {elapsed:.1f} s")
            return


def reload_model(url: str, configs: Mapping[str, str]) -> Callable[[str], None]:
    """Unloads and loads a model over gRPC (tritonclient), with its config override from `configs` if any."""

    def reload(model: str) -> None:
        from tritonclient.grpc import InferenceServerClient

        client = InferenceServerClient(url)
        try:
            # Unloading returns at once (the old instance finishes, or stays with requests its dead stub
            # held); the model is then not ready until the load below completes.
            client.unload_model(model)
            client.load_model(model, config=configs.get(model))
        finally:
            client.close()

    return reload
