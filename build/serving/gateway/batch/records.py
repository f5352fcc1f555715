"""The Batch API's objects as OpenAI defines them (the official client's openai.types.FileObject, Batch,
BatchRequestCounts; its batch input and output lines), and the limits a batch is held to."""

from __future__ import annotations

import re
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

# OpenAI's own bound on a batch input file's requests ("up to 50,000"; its bytes: options.MAX_BATCH_FILE_BYTES).
MAX_BATCH_LINES = 50_000
MAX_METADATA = 16  # key-value pairs, keys up to 64 characters, values up to 512 (OpenAI's metadata)
BATCH_PURPOSE, OUTPUT_PURPOSE = "batch", "batch_output"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
# OpenAI takes "24h" only; shorter windows ("90s", "30m", "2h") are this gateway's, for work that must end sooner.
DEFAULT_WINDOW = "24h"
_WINDOW = re.compile(r"^([1-9][0-9]*)([smh])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 24 * 3600
Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]
ENDED = ("failed", "completed", "expired", "cancelled")
Item = TypeVar("Item", "FileObject", "Batch")


def window_seconds(window: str) -> int | None:
    """A completion window's seconds ("24h", or shorter), None when it is not one."""
    match = _WINDOW.match(window)
    if match is None:
        return None
    seconds = int(match.group(1)) * _SECONDS[match.group(2)]
    return seconds if seconds <= MAX_WINDOW_S else None


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchRequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: Status
    created_at: int
    model: str | None = None
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = BatchRequestCounts()
    metadata: dict[str, str] | None = None


class Page(BaseModel, Generic[Item]):
    """A page of a list (GET /v1/files, /v1/batches), as OpenAI's cursor pages are."""

    object: Literal["list"] = "list"
    data: list[Item]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False

    @classmethod
    def of(cls, data: list[Item], has_more: bool = False) -> Page[Item]:
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        return cls(data=data, first_id=first, last_id=last, has_more=has_more)


class CreateBatch(BaseModel):
    """POST /v1/batches' body."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str = DEFAULT_WINDOW
    metadata: dict[str, str] | None = None


class InputLine(BaseModel):
    """One line of a batch input file: its request to `url`, named by custom_id."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


def output_line(line_id: str, custom_id: str, status: int, request_id: str, body: Any) -> dict[str, Any]:
    """A line of the output or error file for a request that ran: OpenAI's {id, custom_id, response, error}."""
    response = {"status_code": status, "request_id": request_id, "body": body}
    return {"id": line_id, "custom_id": custom_id, "response": response, "error": None}


def error_line(line_id: str, custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """A line of the error file for a request that never ran (invalid, cancelled, expired)."""
    return {"id": line_id, "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}
