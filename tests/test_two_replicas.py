"""scripts/two_replicas.py for two rounds: two `serve` replicas of one repository sharing a redis-server, Redis
stopped mid-run, both stopped by SIGTERM to their process groups; every stop within the grace, nothing of either
left, no model unavailable while its server says ready (the script's own checks, its exit status)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.server]

SCRIPT = Path(__file__).parent.parent / "scripts" / "two_replicas.py"


def test_two_replicas_stop_within_the_grace_and_leave_nothing(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "2", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "2/2 rounds passed" in run.stdout
