"""Every gateway's share of the batch work (BatchRunner): validating batches, running their lines through the
interactive path in the batch class (Admission.batch_slot, beneath interactive traffic), and finalizing them
(completed, cancelled, expired) into output and error files in input order.

Any gateway may do any of it: a batch's own work (validating, finalizing) is held by a lease that a dead gateway's
loses, its lines are work entries that another runner claims once their holder stops holding them, and each line's
result is recorded once (store.BatchStore.record), so that every custom_id is in the output exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from pydantic import ValidationError

from ...client import InferenceError
from ...request import BATCH_PRIORITY
from ..admission import Admission
from ..metrics import GatewayMetrics
from ..planning import Plan, Planner
from ..protocol import APIError, ChatCompletionRequest, CompletionRequest
from .files import FileStore
from .records import (
    ENDED,
    OUTPUT_PURPOSE,
    Batch,
    BatchError,
    BatchErrors,
    FileObject,
    InputLine,
    error_line,
    output_line,
)
from .store import BatchStore, new_id, now

LEASE_MS = 30_000  # a batch's own work is another gateway's once its holder has not renewed for this long
SWEEP_S = 2.0  # how often a runner looks over the active batches
GROUP_LINES = 16  # lines that share an image, run one after another by one runner
RETRY_S = 1.0  # a line the deployment refused for load (429, 503) is sent again after this
CANCEL_GRACE_S = 60.0  # a cancelled batch ends once its entries are given back, or after this
_CHAT = "/v1/chat/completions"
# A batch's lines run while it is in progress, and from the moment its validation enqueued them (its status moves on
# just after).
RUNNING = ("validating", "in_progress")


@dataclass(frozen=True)
class RunnerOptions:
    """runners: lines run at once by this gateway; share: the most of its request slots batch lines take (and only
    while no request waits); claim_s: a work entry whose runner stopped holding it for this long is another's;
    group_images: lines that share their first image run together (else each line is an entry of its own, taken in
    the file's order)."""

    runners: int = 4
    share: float = 0.5
    claim_s: float = 60.0
    group_images: bool = True


@dataclass(frozen=True)
class ParsedLine:
    index: int
    offset: int
    length: int
    line: InputLine | None  # None: not a request line
    problem: str | None  # why the line cannot run, when it cannot


def read_lines(path: Path) -> list[ParsedLine]:
    """Every non-empty line of an input file, parsed, with its place in the file."""
    parsed: list[ParsedLine] = []
    offset = 0
    with open(path, "rb") as source:
        for raw in source:
            length = len(raw)
            if raw.strip():
                try:
                    line, problem = InputLine.model_validate_json(raw), None
                except ValidationError as e:
                    line, problem = None, _first_problem(e)
                parsed.append(ParsedLine(len(parsed), offset, length, line, problem))
            offset += length
    return parsed


def _first_problem(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{where}: {first['msg']}" if where else first["msg"]


def custom_id_of(raw: bytes) -> str | None:
    """A line's custom_id, where it has one, even when the rest of it is wrong."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def image_key(body: dict[str, Any]) -> str | None:
    """What lines that share their first image have in common (the visual cache serves all but the first)."""
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = (part.get("image_url") or {}).get("url")
                if isinstance(url, str):
                    return hashlib.sha256(url.encode()).hexdigest()
    return None


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        files: FileStore,
        planner: Planner,
        complete: Any,  # GenerationDriver.complete
        admission: Admission,
        options: RunnerOptions,
        metrics: GatewayMetrics,
    ):
        self.store, self.files, self.planner, self.complete = store, files, planner, complete
        self.admission, self.options, self.metrics = admission, options, metrics
        self.consumer = f"gateway-{secrets.token_hex(6)}"
        self._tasks: list[asyncio.Task[None]] = []
        self._busy: dict[str, asyncio.Task[None]] = {}  # a batch's own work running here (validating, finalizing)

    async def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._sweep())]
        self._tasks += [asyncio.ensure_future(self._run(n)) for n in range(self.options.runners)]

    async def close(self) -> None:
        tasks = [*self._tasks, *self._busy.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def spawn(self, batch_id: str, work: Coroutine[Any, Any, None]) -> None:
        """Runs a batch's own work (validate, finalize) on a task of its own, one at a time per batch here, so that a
        long one holds up no other batch; a batch whose input cannot be read fails."""
        if batch_id in self._busy:
            work.close()
            return

        async def guarded() -> None:
            try:
                await work
            except (OSError, ValidationError) as e:  # its input file gone or unreadable: it cannot go on
                await self._fail(batch_id, f"its input file cannot be read: {e}")
            except Exception as e:  # Redis away for a moment: the next sweep tries again
                print(f"gateway: batch {batch_id}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

        task = asyncio.ensure_future(guarded())
        self._busy[batch_id] = task
        task.add_done_callback(lambda _: self._busy.pop(batch_id, None))

    # -- a batch's own work ---------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _leased(self, batch_id: str) -> AsyncIterator[bool]:
        """Holds the batch's lease while the block runs (renewed), or yields False when another holds it."""
        token = await self.store.lease(batch_id, LEASE_MS)
        if token is None:
            yield False
            return

        async def renew() -> None:
            while True:
                await asyncio.sleep(LEASE_MS / 3000)
                with contextlib.suppress(Exception):  # Redis away for a moment: the next renewal may make it
                    await self.store.renew(batch_id, token, LEASE_MS)

        renewing = asyncio.ensure_future(renew())
        try:
            yield True
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
            await self.store.release(batch_id, token)

    async def validate(self, batch_id: str) -> None:
        """Checks every line as an interactive request is checked; those that fail go to the error file; the others
        become work entries, lines that share an image together; then the batch is in progress."""
        async with self._leased(batch_id) as held:
            found = await self.store.batch(batch_id)
            if not held or found is None or found[0].status != "validating":
                return
            batch = found[0]
            lines = await anyio.to_thread.run_sync(read_lines, self.files.path(batch.input_file_id))
            groups: dict[str | None, list[list[tuple[int, int, int]]]] = {}
            for parsed in lines:
                await asyncio.sleep(0)  # planning a line may not suspend: the loop serves everything else meanwhile
                problem = parsed.problem
                if problem is None and parsed.line is not None:
                    problem = await self._check(batch, parsed.line)
                if problem is not None:
                    custom_id = await self._custom_id(batch, parsed)
                    line = error_line(new_id("batch_req"), custom_id, "invalid_request", problem)
                    await self.store.record(batch.id, parsed.index, line, "failed")
                    continue
                assert parsed.line is not None
                key = (image_key(parsed.line.body) if self.options.group_images else None) or f"line {parsed.index}"
                chunks = groups.setdefault(key, [[]])
                if len(chunks[-1]) == GROUP_LINES:
                    chunks.append([])
                chunks[-1].append((parsed.index, parsed.offset, parsed.length))
            await self.store.enqueue(batch.id, [chunk for chunks in groups.values() for chunk in chunks if chunk])
            await self.store.move(batch.id, ["validating"], status="in_progress", in_progress_at=now())

    async def _custom_id(self, batch: Batch, parsed: ParsedLine) -> str | None:
        if parsed.line is not None:
            return parsed.line.custom_id
        raw = await anyio.to_thread.run_sync(_read, self.files.path(batch.input_file_id), parsed.offset, parsed.length)
        return custom_id_of(raw)

    async def _check(self, batch: Batch, line: InputLine) -> str | None:
        """Why a line cannot run (None: it can): another endpoint, a stream, or what an interactive request of its
        body would be refused for."""
        if line.url != batch.endpoint:
            return f"the line's url {line.url} is not the batch's endpoint {batch.endpoint}"
        try:
            plan = await self._plan(batch.endpoint, line.body)
        except APIError as e:
            return e.message
        if plan.n > 1:  # each choice would be a request on the deployment that the batch class does not count
            return "a batch line takes n = 1: send one line per choice"
        return None

    async def _plan(self, endpoint: str, body: dict[str, Any]) -> Plan:
        """The line planned as an interactive request is, to run at the deployment's lowest priority."""
        started = time.monotonic()
        try:
            if endpoint == _CHAT:
                chat = ChatCompletionRequest.model_validate(body)
                _no_stream(chat.stream)
                return await self.planner.plan(chat, started, BATCH_PRIORITY)
            completion = CompletionRequest.model_validate(body)
            _no_stream(completion.stream)
            return await self.planner.plan_completion(completion, started, BATCH_PRIORITY)
        except ValidationError as e:
            raise APIError(400, _first_problem(e)) from None

    async def finalize(self, batch_id: str, ending: str) -> None:
        """Ends a batch (`ending`: completed, cancelled or expired): the lines it did not run go to the error file, the
        output and error files are written in input order (the same files again after a crash), then the status."""
        async with self._leased(batch_id) as held:
            found = await self.store.batch(batch_id)
            if not held or found is None or found[0].status in ENDED:
                return
            batch, owner = found
            if ending == "completed":
                await self.store.move(batch.id, ["in_progress", "finalizing"], status="finalizing", finalizing_at=now())
            results = await self.store.result_lines(batch.id)
            missing = batch.request_counts.total - len(results)
            if missing:
                code = "batch_cancelled" if ending == "cancelled" else "batch_expired"
                why = "the batch was cancelled" if ending == "cancelled" else "the completion window ended"
                path = self.files.path(batch.input_file_id)
                for parsed in await anyio.to_thread.run_sync(read_lines, path):
                    if parsed.index not in results:
                        custom_id = await self._custom_id(batch, parsed)
                        line = error_line(new_id("batch_req"), custom_id, code, f"not run: {why}")
                        await self.store.record(batch.id, parsed.index, line, None)
                results = await self.store.result_lines(batch.id)
            ordered = [results[i] for i in sorted(results)]
            outputs = [line + b"\n" for line in ordered if _succeeded(line)]
            errors = [line + b"\n" for line in ordered if not _succeeded(line)]
            ids = {}
            for name, lines in (("output", outputs), ("error", errors)):
                if lines:
                    file_id = f"file-{batch.id}-{name}"
                    size = await anyio.to_thread.run_sync(self.files.write, file_id, lines)
                    record = FileObject(id=file_id, bytes=size, created_at=now(), filename=f"{batch.id}_{name}.jsonl",
                                        purpose=OUTPUT_PURPOSE)  # fmt: skip
                    await self.store.add_file(owner, record)
                    ids[f"{name}_file_id"] = file_id
            stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[ending]
            allowed = ["finalizing", "in_progress", "cancelling"]
            await self.store.move(batch.id, allowed, status=ending, **{stamp: now()}, **ids)
            await self.store.ended(batch.id)

    # -- the loops ------------------------------------------------------------------------------------------

    async def _sweep(self) -> None:
        while True:
            try:
                statuses: dict[str, int] = dict.fromkeys(("validating", "in_progress", "finalizing", "cancelling"), 0)
                for batch_id in await self.store.active_batches():
                    status = await self._look_after(batch_id)
                    if status in statuses:
                        statuses[status] += 1
                for status, count in statuses.items():
                    self.metrics.batches.labels(status).set(count)
                self.metrics.batch_entries_queued.set(await self.store.entries_queued())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away for a moment: the next sweep tries again
                print(f"gateway: batch sweep: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            await asyncio.sleep(SWEEP_S)

    async def _fail(self, batch_id: str, why: str) -> None:
        errors = BatchErrors(data=[BatchError(code="invalid_file", message=why)])
        values = {"status": "failed", "failed_at": now(), "errors": errors.model_dump()}
        await self.store.move(batch_id, ["validating", "in_progress", "finalizing", "cancelling"], **values)
        await self.store.ended(batch_id)

    async def _look_after(self, batch_id: str) -> str | None:
        """Moves a batch on where it is due (validated, finalized, expired, cancelled); the status it had."""
        found = await self.store.batch(batch_id)
        if found is None:
            await self.store.ended(batch_id)
            return None
        batch = found[0]
        counts = batch.request_counts
        if batch.status == "validating":
            self.spawn(batch_id, self.validate(batch_id))  # one whose validator died (its lease lapsed), else no-op
        elif batch.status in ("in_progress", "finalizing") and counts.completed + counts.failed >= counts.total:
            self.spawn(batch_id, self.finalize(batch_id, "completed"))
        elif batch.status == "in_progress" and batch.expires_at is not None and time.time() >= batch.expires_at:
            self.spawn(batch_id, self.finalize(batch_id, "expired"))
        elif batch.status == "cancelling":
            left = await self.store.entries_left(batch_id)
            if left <= 0 or time.time() - (batch.cancelling_at or 0) >= CANCEL_GRACE_S:
                self.spawn(batch_id, self.finalize(batch_id, "cancelled"))
        elif batch.status in ENDED:
            await self.store.ended(batch_id)
        return batch.status

    async def _run(self, number: int) -> None:
        consumer = f"{self.consumer}-{number}"
        claim_ms = int(self.options.claim_s * 1000)
        while True:
            try:
                taken = await self.store.take(consumer, claim_ms, block_ms=1000)
                if taken is None:
                    continue
                entry_id, batch_id, lines = taken
                holding = asyncio.ensure_future(self._hold(consumer, entry_id, claim_ms))
                try:
                    await self._run_entry(batch_id, lines)
                finally:
                    holding.cancel()
                    await asyncio.gather(holding, return_exceptions=True)
                await self.store.done(batch_id, entry_id)
                await self._look_after(batch_id)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away for a moment; the entry is claimed again later
                print(f"gateway: batch runner: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                await asyncio.sleep(RETRY_S)

    async def _hold(self, consumer: str, entry_id: str, claim_ms: int) -> None:
        while True:
            await asyncio.sleep(claim_ms / 3000)
            with contextlib.suppress(Exception):  # Redis away for a moment: the next hold may make it
                await self.store.hold(consumer, entry_id)

    async def _run_entry(self, batch_id: str, lines: list[list[int]]) -> None:
        for index, offset, length in lines:
            found = await self.store.batch(batch_id)
            if found is None or found[0].status not in RUNNING:
                return  # cancelled or expired meanwhile: the rest is the finalizer's
            if await self.store.recorded(batch_id, index):
                continue  # a runner before this one (that died) ran it
            batch = found[0]
            try:
                raw = await anyio.to_thread.run_sync(_read, self.files.path(batch.input_file_id), offset, length)
                line = InputLine.model_validate_json(raw)
            except (OSError, ValidationError) as e:  # the input file gone or changed under the batch
                await self._fail(batch_id, f"its input file cannot be read: {e}")
                return
            self.metrics.batch_lines_running.inc()
            try:
                result, counted = await self._answer(batch, line)
            finally:
                self.metrics.batch_lines_running.dec()
            await self.store.record(batch_id, index, result, counted)
            self.metrics.batch_lines.labels(counted).inc()

    async def _answer(self, batch: Batch, line: InputLine) -> tuple[dict[str, Any], str]:
        """The line's output line and its count ("completed" or "failed"); refused for load, it is sent again."""
        request_id = new_id("batch_req")
        while True:
            try:
                wanted = time.monotonic()
                async with self.admission.batch_slot(self.options.share):
                    started = time.monotonic()
                    self.metrics.queue_wait.labels("batch").observe(started - wanted)
                    plan = await self._plan(batch.endpoint, line.body)
                    answer = await self.complete(plan)
                    self.metrics.batch_line_duration.observe(time.monotonic() - started)
                body = json.loads(answer.model_dump_json())  # as the interactive API answers it
                return output_line(request_id, line.custom_id, 200, plan.id, body), "completed"
            except APIError as e:
                if e.status in (429, 503) and (batch.expires_at is None or time.time() < batch.expires_at):
                    self.metrics.batch_lines.labels("retried").inc()
                    await asyncio.sleep(RETRY_S)
                    continue
                error = e.response().model_dump()
                return output_line(request_id, line.custom_id, e.status, request_id, error), "failed"
            except (InferenceError, ValueError) as e:  # what the interactive API would answer 500 for
                error = APIError(500, str(e), type="server_error").response().model_dump()
                return output_line(request_id, line.custom_id, 500, request_id, error), "failed"


def _no_stream(stream: bool | None) -> None:
    if stream:
        raise APIError(400, "a batch line cannot stream: leave out stream", param="stream")


def _succeeded(line: bytes) -> bool:
    value = json.loads(line)
    return value.get("error") is None and (value.get("response") or {}).get("status_code") == 200


def _read(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as source:
        source.seek(offset)
        return source.read(length)
