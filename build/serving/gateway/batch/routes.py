"""The Batch API's routes (OpenAI's /v1/files and /v1/batches, as its official client calls them), each key seeing
only its own files and batches (another key's is a 404, as one that does not exist)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse

from ..admission import Admission
from ..auth import KEY_OWNER
from ..metrics import GatewayMetrics
from ..options import BODY_SLACK_BYTES
from ..planning import Planner
from ..protocol import APIError
from ..settings import GatewaySettings
from .files import FileStore, too_large
from .records import (
    BATCH_PURPOSE,
    ENDPOINTS,
    MAX_BATCH_LINES,
    MAX_METADATA,
    Batch,
    BatchRequestCounts,
    CreateBatch,
    FileDeleted,
    FileObject,
    Page,
    window_seconds,
)
from .runner import BatchRunner, RunnerOptions, read_lines
from .store import BatchStore, new_id, now

OPEN = "open"  # the owner of everything on a gateway without API keys
MAX_PAGE = 100


class BatchAPI:
    """The Batch API of one gateway: its store, files and runner, and the routes over them."""

    def __init__(
        self, settings: GatewaySettings, planner: Planner, complete: Any, admission: Admission, metrics: GatewayMetrics
    ):
        options = settings.options
        assert options.batch_redis is not None and options.batch_dir is not None
        self.settings = settings
        self.store = BatchStore(options.batch_redis)
        self.files = FileStore(options.batch_dir)
        runner_options = RunnerOptions(options.batch_runners, options.batch_share, options.batch_claim_s,
                                       options.batch_group_images)  # fmt: skip
        self.runner = BatchRunner(self.store, self.files, planner, complete, admission, runner_options, metrics)

    async def start(self) -> None:
        await self.store.check()
        await self.runner.start()

    async def close(self) -> None:
        await self.runner.close()
        await self.store.close()

    def mount(self, app: FastAPI) -> None:
        limit = self.settings.options.max_batch_file_bytes
        store, files = self.store, self.files

        def owner(request: Request) -> str:
            return request.scope.get(KEY_OWNER, OPEN)

        async def owned_file(request: Request, file_id: str) -> FileObject:
            file = await store.file(owner(request), file_id)
            if file is None:
                raise APIError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")
            return file

        async def owned_batch(request: Request, batch_id: str) -> Batch:
            found = await store.batch(batch_id, owner(request))
            if found is None:
                raise APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
            return found[0]

        @app.post("/v1/files")
        async def upload(request: Request) -> FileObject:
            length = request.headers.get("content-length", "")
            if length.isdigit() and int(length) > limit + BODY_SLACK_BYTES:
                raise too_large(limit)  # refused before any of it is read
            received = await files.receive(request.headers.get("content-type", ""), request.stream(), limit)
            try:
                if received.purpose != BATCH_PURPOSE:
                    raise APIError(400, f"purpose must be {BATCH_PURPOSE!r}, got {received.purpose!r}", param="purpose")
                await anyio.to_thread.run_sync(check_jsonl, received.path)
                record = FileObject(id=new_id("file"), bytes=received.size, created_at=now(),
                                    filename=received.filename, purpose=BATCH_PURPOSE)  # fmt: skip
                files.keep(received, record.id)
            except BaseException:
                files.discard(received)
                raise
            await store.add_file(owner(request), record)
            return record

        @app.get("/v1/files")
        async def list_files(request: Request, purpose: str | None = None) -> Page[FileObject]:
            found = [await store.file(owner(request), file_id) for file_id in await store.files(owner(request))]
            return Page[FileObject].of([f for f in found if f is not None and purpose in (None, f.purpose)])

        @app.get("/v1/files/{file_id}")
        async def retrieve_file(request: Request, file_id: str) -> FileObject:
            return await owned_file(request, file_id)

        @app.get("/v1/files/{file_id}/content")
        async def file_content(request: Request, file_id: str) -> FileResponse:
            file = await owned_file(request, file_id)
            return FileResponse(files.path(file.id), media_type="application/jsonl", filename=file.filename)

        @app.delete("/v1/files/{file_id}")
        async def delete_file(request: Request, file_id: str) -> FileDeleted:
            file = await owned_file(request, file_id)
            if file.id in await store.active_inputs():
                raise APIError(409, f"the file {file.id} is the input of a batch that has not ended: delete it once "
                               "the batch has", code="file_in_use")  # fmt: skip
            await store.delete_file(owner(request), file.id)
            files.delete(file.id)
            return FileDeleted(id=file.id)

        @app.post("/v1/batches")
        async def create_batch(request: Request, body: CreateBatch) -> Batch:
            if body.endpoint not in ENDPOINTS:
                raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {body.endpoint!r}",
                               param="endpoint")  # fmt: skip
            window = window_seconds(body.completion_window)
            if window is None:
                raise APIError(400, "completion_window must be 24h (or a shorter time: 90s, 30m, 2h)",
                               param="completion_window")  # fmt: skip
            if body.metadata is not None and (
                len(body.metadata) > MAX_METADATA or any(len(k) > 64 or len(v) > 512 for k, v in body.metadata.items())
            ):
                raise APIError(400, "metadata takes up to 16 pairs, keys up to 64 characters, values up to 512",
                               param="metadata")  # fmt: skip
            file = await owned_file(request, body.input_file_id)
            if file.purpose != BATCH_PURPOSE:
                raise APIError(400, f"the file {file.id} is not a batch input file", param="input_file_id")
            total = await anyio.to_thread.run_sync(count_requests, files.path(file.id))
            created = now()
            batch = Batch(
                id=new_id("batch"),
                endpoint=body.endpoint,
                input_file_id=file.id,
                completion_window=body.completion_window,
                status="validating",
                created_at=created,
                expires_at=created + window,
                model=self.settings.served_model_name,
                request_counts=BatchRequestCounts(total=total),
                metadata=body.metadata,
            )
            await store.add_batch(owner(request), batch)
            self.runner.spawn(batch.id, self.runner.validate(batch.id))
            return batch

        @app.get("/v1/batches")
        async def list_batches(
            request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=MAX_PAGE)
        ) -> Page[Batch]:
            ids = await store.batches(owner(request))  # newest first
            if after is not None:
                ids = ids[ids.index(after) + 1 :] if after in ids else []
            page = [found[0] for i in ids[:limit] if (found := await store.batch(i, owner(request)))]
            return Page[Batch].of(page, has_more=len(ids) > limit)

        @app.get("/v1/batches/{batch_id}")
        async def retrieve_batch(request: Request, batch_id: str) -> Batch:
            return await owned_batch(request, batch_id)

        @app.post("/v1/batches/{batch_id}/cancel")
        async def cancel_batch(request: Request, batch_id: str) -> Batch:
            batch = await owned_batch(request, batch_id)
            moved = await store.move(batch.id, ["validating", "in_progress"], status="cancelling", cancelling_at=now())
            if not moved and batch.status not in ("cancelling", "cancelled"):
                raise APIError(409, f"Cannot cancel a batch with status {batch.status}", code="batch_not_cancellable")
            return await owned_batch(request, batch_id)


def check_jsonl(path: Path) -> None:
    """Refuses a file that is not JSONL (a JSON object a line, blank lines aside) or holds too many lines."""
    lines = 0
    with open(path, "rb") as source:
        for number, raw in enumerate(source, 1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw)
            except ValueError:
                value = None
            if not isinstance(value, dict):
                raise APIError(400, f"line {number} is not a JSON object: a batch file is JSONL, one request a line",
                               param="file")  # fmt: skip
            lines += 1
            if lines > MAX_BATCH_LINES:
                raise APIError(400, f"a batch file holds at most {MAX_BATCH_LINES:,} requests", param="file")
    if not lines:
        raise APIError(400, "the file holds no request", param="file")


def count_requests(path: Path) -> int:
    """The requests of an input file, refusing the batch for custom_ids that are not unique."""
    parsed = read_lines(path)
    seen = Counter(p.line.custom_id for p in parsed if p.line is not None)
    duplicated = [custom_id for custom_id, count in seen.items() if count > 1]
    if duplicated:
        raise APIError(400, f"custom_id must be unique in a batch: {duplicated[0]!r} is on {seen[duplicated[0]]} "
                       "lines", param="input_file_id", code="duplicate_custom_id")  # fmt: skip
    return len(parsed)
