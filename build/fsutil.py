"""Atomic output directories: a stage writes into a temp dir beside the target, then renames it."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import OutputExistsError


def check_output_dir(output: Path, force: bool) -> None:
    if output.exists() and not force:
        raise OutputExistsError(f"{output} already exists; pass --force to replace it")
    if output.exists() and not output.is_dir():
        raise OutputExistsError(f"{output} exists and is not a directory")


@contextlib.contextmanager
def atomic_output_dir(output: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """Yields a temp dir that replaces `output` only if the block finishes without an exception."""
    output = Path(output).absolute()
    check_output_dir(output, force)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would make the published directory private
    try:
        yield tmp
        check_output_dir(output, force)  # may have appeared meanwhile
        if output.exists():
            old = output.with_name(f".{output.name}.old-{os.getpid()}")
            output.rename(old)
            tmp.rename(output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
