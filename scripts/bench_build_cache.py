#!/usr/bin/env python
"""The build cache's hit against its miss: two `qwen3vl-trt build --cache` runs of one checkpoint and options into
two output directories, each a fresh process timed from start to exit (what a replica's init container pays).

The checkpoint is the 2b-vision preset (the released 2B vision tower, a small language model), so the build costs
what the vision export and its parity check cost at that size. Prints both times and their ratio (aim: the hit at
most 0.3x the miss), checks that the hit's artifacts hash the same as the miss's and that its repository is its own.
On a GPU host the miss also builds both engines, and the ratio is far smaller.

    .venv/bin/python scripts/bench_build_cache.py [--preset 2b-vision] [--pull link|copy] [--keep DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qwen3vl_trt.build_cache.store import ARTIFACTS


def _run(*args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "qwen3vl_trt.cli", *args], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _hashes(build: Path) -> dict[str, str]:
    found = {}
    for name in ARTIFACTS:
        for path in sorted(p for p in (build / name).rglob("*") if p.is_file()):
            found[str(path.relative_to(build))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="2b-vision")
    parser.add_argument("--pull", choices=["link", "copy"], default="copy", help="how the hit takes the artifacts")
    parser.add_argument("--keep", type=Path, help="keep the checkpoint, cache and builds here")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-build-cache-"))
    try:
        ckpt, cache = work / "checkpoint", work / "cache"
        subprocess.run(
            [sys.executable, "-m", "qwen3vl_trt.cli", "make-tiny", "--preset", args.preset, "--output", str(ckpt)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        common = ["build", "--model", str(ckpt), "--cache", str(cache), "--cache-pull", args.pull]
        miss = _run(*common, "--output", str(work / "miss"))
        # Another repository setting: a hit all the same (the key is the artifacts', not the repository's).
        hit = _run(*common, "--output", str(work / "hit"), "--max-queue-delay-us", "500")
        manifests = [json.loads((work / b / "manifest.json").read_text())["cache"] for b in ("miss", "hit")]
        assert [m["source"] for m in manifests] == ["built", "pulled"], manifests
        assert manifests[0]["key"] == manifests[1]["key"]
        same = _hashes(work / "miss") == _hashes(work / "hit")
        repo = (work / "hit" / "triton_repo" / "llm" / "config.pbtxt").read_text()
        own = str(work / "hit") in repo and "max_queue_delay_microseconds: 500" in repo
        entry_gib = manifests[1]["pull_bytes"] / 2**30
        print(f"build cache, {args.preset} checkpoint, key {manifests[0]['key']} ({entry_gib:.2f} GiB of artifacts)")
        print(f"  miss (build and publish):     {miss:7.1f} s   (the build itself {manifests[0]['build_s']} s)")
        print(f"  hit ({args.pull}, own repository): {hit:7.1f} s   (pull {manifests[1]['pull_s']} s)")
        print(f"  hit / miss: {hit / miss:.2f} (aim <= 0.30); artifacts identical: {same}; own repository: {own}")
        if not (same and own):
            sys.exit(1)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
