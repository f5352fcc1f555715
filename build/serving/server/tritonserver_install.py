"""Where `serve` finds a tritonserver: --tritonserver, $QWEN3VL_TRITONSERVER, PATH, the NGC image's, else the
one the nvidia-pytriton wheel bundles, whose python backend directory is prepared to run this interpreter."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import ServingError

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
