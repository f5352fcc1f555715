"""Atomic output directories: a stage writes into a temp dir beside the target, then renames it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import CheckpointError, OutputExistsError


def check_output_dir(output: Path, force: bool) -> None:
    if output.exists() and not force:
        raise OutputExistsError(f"{output} already exists; pass --force to replace it")
    if output.exists() and not output.is_dir():
        raise OutputExistsError(f"{output} exists and is not a directory")


def _publishable(root: Path) -> None:
    """Gives the tree the modes of ordinary new files: mkdtemp and some writers (ONNX external
    data, safetensors) create owner-only files, which a server running as another user cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o777 & ~umask)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~umask)


def _replace(tmp: Path, output: Path) -> None:
    """Swaps tmp in for output; on failure the previous output is put back."""
    if not output.exists():
        tmp.rename(output)
        return
    old = output.with_name(f".{output.name}.old-{uuid.uuid4().hex[:8]}")
    output.rename(old)  # readers see no directory between these two renames
    try:
        tmp.rename(output)
    except BaseException:
        old.rename(output)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(output: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """Yields a temp dir that replaces `output` only if the block finishes without an exception."""
    output = Path(output).absolute()
    check_output_dir(output, force)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        yield tmp
        check_output_dir(output, force)  # may have appeared meanwhile
        _publishable(tmp)
        _replace(tmp, output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def read_json(path: Path, missing: str) -> dict:
    """A JSON config file's content; CheckpointError(`missing`) when absent, or naming the syntax error."""
    if not path.is_file():
        raise CheckpointError(missing)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
