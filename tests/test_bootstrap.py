"""scripts/bootstrap.sh's torch: PyTorch's CPU-only wheels on a host without an NVIDIA GPU when PyTorch's index
answers (here a local index), PyPI's pins when it does not, TORCH_SPEC when given."""

from __future__ import annotations

import functools
import http.server
import os
import platform
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PINS = "torch==2.14.1 torchvision==0.29.1"

pytestmark = pytest.mark.once  # a shell script's choice: no transformers in it


def _torch_spec(tmp_path: Path, **env: str) -> str:
    # A PATH without nvidia-smi, whatever the machine has.
    path = tmp_path / "bin"
    path.mkdir(exist_ok=True)
    base = {"PATH": f"{path}:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": "python3"}
    done = subprocess.run(
        [str(ROOT / "scripts" / "bootstrap.sh"), "--torch-spec"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def index(tmp_path):
    """A package index that answers for torch, as PyTorch's CPU index does."""
    root = tmp_path / "index"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "index.html").write_text("<html></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="PyPI's CUDA build is x86_64's")
def test_a_host_without_a_gpu_takes_the_cpu_wheels_where_the_index_answers(tmp_path, index):
    assert _torch_spec(tmp_path, TORCH_CPU_INDEX=index) == f"{PINS} --index-url {index}"


def test_pypis_pins_where_the_index_does_not_answer_or_a_gpu_is_there(tmp_path, index):
    assert _torch_spec(tmp_path, TORCH_CPU_INDEX="http://127.0.0.1:9/whl/cpu") == PINS
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir(exist_ok=True)
    smi.write_text("#!/bin/sh\n")
    os.chmod(smi, 0o755)
    assert _torch_spec(tmp_path, TORCH_CPU_INDEX=index) == PINS


def test_torch_spec_chooses_otherwise(tmp_path, index):
    assert _torch_spec(tmp_path, TORCH_SPEC="torch==2.9.1", TORCH_CPU_INDEX=index) == "torch==2.9.1"
