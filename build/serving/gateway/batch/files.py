"""Batch files on a directory every gateway mounts (POSIX, like the build cache): uploads streamed to disk within a
byte limit, output and error files written whole, each appearing under its id only once complete (a rename); their
metadata lives in the batch store (store.BatchStore)."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from ..protocol import APIError

UPLOAD_FIELD, PURPOSE_FIELD = "file", "purpose"
_SMALL_FIELD_BYTES = 1024  # purpose and any other form field but the file
_MAX_PARTS = 8  # the file, purpose, and a few a client may add
_FORM_SLACK_BYTES = 64 * 1024  # the form's boundaries, part headers and small fields around the file


def too_large(limit: int) -> APIError:
    return APIError(413, f"the file is over this gateway's limit of {limit:,} bytes", code="file_too_large")


@dataclass(frozen=True)
class Upload:
    """A file received whole into `path` (a temporary name in the store), with the form's purpose."""

    path: Path
    filename: str
    purpose: str
    size: int


class FileStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.files = self.root / "files"
        self.incoming = self.root / "incoming"
        for folder in (self.files, self.incoming):
            folder.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        return self.files / file_id

    async def receive(self, content_type: str, body: AsyncIterator[bytes], limit: int) -> Upload:
        """A multipart/form-data upload (OpenAI's POST /v1/files: `file` and `purpose`) streamed to a temporary file,
        refused (413) as soon as the file passes `limit` bytes, and refused (400) when a field is missing."""
        kind, params = parse_options_header(content_type)
        boundary = params.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise APIError(400, "upload the file as multipart/form-data with the fields file and purpose")
        path = self.incoming / secrets.token_hex(16)
        form = _Form(path, limit)
        parser = MultipartParser(boundary, form.callbacks())  # type: ignore[arg-type]
        received = 0
        try:
            async for chunk in body:
                received += len(chunk)
                if received > limit + _FORM_SLACK_BYTES:
                    raise too_large(limit)
                _parse(parser.write, chunk)
                if form.too_large:
                    raise too_large(limit)
                if form.problem is not None:
                    raise APIError(400, form.problem)
            _parse(lambda _: parser.finalize(), b"")
            form.close()
            if form.filename is None:
                raise APIError(400, "the form has no file: send it in the field `file`", param=UPLOAD_FIELD)
            purpose = form.fields.get(PURPOSE_FIELD)
            if purpose is None:
                raise APIError(400, "the form has no purpose: send `batch`", param=PURPOSE_FIELD)
        except BaseException:
            form.close()
            path.unlink(missing_ok=True)
            raise
        return Upload(path, form.filename, purpose, form.size)

    def keep(self, upload: Upload, file_id: str) -> None:
        """The upload under its id (a rename: never seen half-written)."""
        os.replace(upload.path, self.path(file_id))

    def discard(self, upload: Upload) -> None:
        upload.path.unlink(missing_ok=True)

    def write(self, file_id: str, lines: Iterable[bytes]) -> int:
        """An output or error file written whole under its id (again, the same content, if it exists); its size."""
        path = self.incoming / f"{file_id}.{secrets.token_hex(4)}"
        size = 0
        with open(path, "wb") as out:
            for line in lines:
                out.write(line)
                size += len(line)
            out.flush()
            os.fsync(out.fileno())
        os.replace(path, self.path(file_id))
        return size

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)


def _parse(step: Callable[[bytes], object], chunk: bytes) -> None:
    try:
        step(chunk)
    except MultipartParseError as e:
        raise APIError(400, f"the upload is not a well-formed multipart/form-data body: {e}") from None


class _Form:
    """python-multipart's callbacks: the `file` part streamed into `path`, other fields kept (small)."""

    def __init__(self, path: Path, limit: int):
        self.path, self.limit = path, limit
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.size = 0
        self.too_large = False
        self.problem: str | None = None  # why the form is refused
        self._parts = 0
        self._out: BinaryIO | None = None
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._name: str | None = None
        self._is_file = False
        self._value = bytearray()

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda data, start, end: self._header_field.extend(data[start:end]),
            "on_header_value": lambda data, start, end: self._header_value.extend(data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }

    def _part_begin(self) -> None:
        self._name, self._is_file, self._value = None, False, bytearray()
        self._parts += 1
        if self._parts > _MAX_PARTS:
            self.problem = f"the form has more than {_MAX_PARTS} fields: send file and purpose"

    def _header_end(self) -> None:
        if bytes(self._header_field).lower() == b"content-disposition":
            _, params = parse_options_header(bytes(self._header_value))
            self._name = params.get(b"name", b"").decode("utf-8", "replace")
            if self._name == UPLOAD_FIELD:
                if self.filename is not None:
                    self.problem = "the form has more than one file: upload one file a request"
                self._is_file = True
                self.filename = params.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")
        self._header_field.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        if self._is_file and self._out is None:
            self._out = open(self.path, "wb")  # noqa: SIM115 (closed by close())

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file and self._out is not None:
            self.size += end - start
            if self.size > self.limit:
                self.too_large = True
                return
            self._out.write(data[start:end])
        elif len(self._value) + end - start <= _SMALL_FIELD_BYTES:
            self._value.extend(data[start:end])

    def _part_end(self) -> None:
        if not self._is_file and self._name:
            self.fields[self._name] = self._value.decode("utf-8", "replace")

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
