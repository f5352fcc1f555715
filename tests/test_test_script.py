"""scripts/test.sh run on a selection, as the README tells a developer to: a selection that some pass runs and that
passes exits 0 though the other passes select none of it; a selection that no pass runs fails."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.once, pytest.mark.slow]  # the script picks its transformers for each pass itself

ROOT = Path(__file__).resolve().parents[1]


def _test_sh(basetemp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "QWEN3VL_TEST_WORKERS": "0"}
    script = str(ROOT / "scripts" / "test.sh")
    # Its own basetemp: the inner runs' start-up cleanup of old numbered directories stays away from this run's.
    command = [script, *args, "--basetemp", str(basetemp)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def test_a_selection_of_one_pass_passes_and_one_of_none_fails(tmp_path):
    # test_triton_adapters.py is marked once: the second and third passes select none of it.
    one = _test_sh(tmp_path, "tests/test_triton_adapters.py", "-k", "test_a_host_output_is_copied_without_cuda_calls")
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert one.stdout.count("(no test of this selection runs in this pass)") == 2, one.stdout[-3000:]

    none = _test_sh(tmp_path, "tests/test_triton_adapters.py", "-k", "no_test_has_this_name")
    assert none.returncode == 5 and "no pass selected a test of" in none.stderr, none.stderr[-3000:]
