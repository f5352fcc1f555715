"""Atomic output directories: a stage writes into a temp dir beside the target, then renames it.

Every directory published this way carries a marker file, so `--force` replaces only what this
tool wrote; and an output may never equal, contain or lie inside one of the stage's inputs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import CheckpointError, OutputExistsError, OutputOverlapError

OUTPUT_MARKER = ".qwen3vl-trt-output"


def check_no_overlap(output: Path, inputs: Iterable[str | os.PathLike[str]]) -> None:
    """Refuses an output that is, contains or lies inside an input (replacing it would delete the input)."""
    target = output.resolve()
    for given in inputs:
        source = Path(given).resolve()
        if source.is_relative_to(target) or target.is_relative_to(source):
            raise OutputOverlapError(
                f"output {output} overlaps the input {given} (the same directory, inside it or around it); "
                "choose an --output outside the input"
            )


def check_output_dir(output: Path, force: bool) -> None:
    if not output.exists() and not output.is_symlink():
        return
    if not force:
        raise OutputExistsError(f"{output} already exists; pass --force to replace it")
    if not output.is_dir() or output.is_symlink():
        raise OutputExistsError(f"{output} exists and is not a directory; --force replaces only qwen3vl-trt outputs")
    if not (output / OUTPUT_MARKER).is_file():
        raise OutputExistsError(
            f"{output} was not written by qwen3vl-trt (it has no {OUTPUT_MARKER} file), so --force does not replace "
            "it: delete it yourself if it is disposable (outputs of earlier qwen3vl-trt versions carry no marker "
            "either) or choose another --output"
        )


def fsync(path: str | os.PathLike[str], directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finalize_tree(root: Path) -> None:
    """Gives the tree the modes of ordinary new files (mkdtemp and some writers, ONNX external data and
    safetensors, create owner-only files, which a server running as another user cannot read) and
    flushes every file and directory to disk, so the rename that publishes it cannot outrun its data."""
    umask = os.umask(0)
    os.umask(umask)
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            os.chmod(path, 0o666 & ~umask)
            fsync(path)
        os.chmod(dirpath, 0o777 & ~umask)
        fsync(dirpath, directory=True)


def _replace(tmp: Path, output: Path) -> None:
    """Swaps tmp in for output; on failure the previous output is put back."""
    if not output.exists():
        tmp.rename(output)
        fsync(str(output.parent), directory=True)
        return
    old = output.with_name(f".{output.name}.old-{uuid.uuid4().hex[:8]}")
    output.rename(old)  # readers see no directory between these two renames
    try:
        tmp.rename(output)
    except BaseException:
        old.rename(output)
        raise
    fsync(str(output.parent), directory=True)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(
    output: str | os.PathLike[str], force: bool = False, inputs: Iterable[str | os.PathLike[str]] = ()
) -> Iterator[Path]:
    """Yields a temp dir that replaces `output` only if the block finishes without an exception.
    `inputs`: the directories the stage reads, which the output must stay clear of."""
    output = Path(output).absolute()
    inputs = tuple(inputs)
    check_no_overlap(output, inputs)
    check_output_dir(output, force)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        yield tmp
        (tmp / OUTPUT_MARKER).write_text(json.dumps({"written_by": "qwen3vl-trt", "version": __version__}) + "\n")
        check_output_dir(output, force)  # may have appeared meanwhile
        _finalize_tree(tmp)
        _replace(tmp, output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def read_json(path: Path, missing: str) -> dict:
    """A JSON object file's content; CheckpointError(`missing`) when absent, or naming what is wrong with it."""
    if not path.is_file():
        raise CheckpointError(missing)
    try:
        content = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(content, dict):
        raise CheckpointError(f"{path} holds a JSON {type(content).__name__}, not an object")
    return content


def json_entry(content: dict, key: str, kind: type, where: str, fix: str) -> Any:
    """content's entry at the dotted `key` ("a.b": entry b of object a), checked to be a `kind`: a float
    may be written as an integer, booleans are not numbers, integers must be positive. Otherwise a
    CheckpointError naming `where` and saying `fix`."""
    value: Any = content
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise CheckpointError(f"{where} lacks '{key}'; {fix}")
        value = value[part]
    valid = isinstance(value, kind) or (kind is float and isinstance(value, int))
    if isinstance(value, bool) or not valid or (kind is int and value < 1):
        expected = {int: "a positive integer", float: "a number", str: "a string"}.get(kind, kind.__name__)
        raise CheckpointError(f"{where}: '{key}' must be {expected}, got {value!r}; {fix}")
    return float(value) if kind is float else value
