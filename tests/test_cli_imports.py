"""The command line's light paths start without what they do not use: --help and --version without torch,
transformers, FastAPI or gRPC; infer without torch or transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from qwen3vl_trt.serving.ports import free_ports

HEAVY = ("torch", "transformers")
SERVING = ("fastapi", "grpc", "tritonclient")

# Runs the CLI's main in a fresh interpreter; prints its exit status and the heavy modules it loaded.
PROBE = """
import json, sys
from qwen3vl_trt.cli import main
try:
    status = main({argv!r})
except SystemExit as e:
    status = e.code
print(json.dumps([status, [m for m in {heavy!r} if m in sys.modules]]))
"""


def _run_main(argv: list[str], heavy: tuple[str, ...] = HEAVY) -> tuple[int, list[str]]:
    code = PROBE.format(argv=argv, heavy=heavy)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    status, loaded = json.loads(done.stdout.splitlines()[-1])
    return status, loaded


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["infer", "--help"]])
def test_light_commands_start_without_torch_or_the_serving_stack(argv):
    assert _run_main(argv, HEAVY + SERVING) == (0, [])


def test_infer_runs_without_torch():
    # The whole request path up to the gRPC call: files read, client made, the (absent) server asked.
    url = f"127.0.0.1:{free_ports().grpc}"
    status, loaded = _run_main(["infer", "--url", url, "--prompt", "hi", "--timeout", "5"])
    assert status == 2 and loaded == []
