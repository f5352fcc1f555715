"""A replica's vision pool (`serve --vision-pool TARGET`): Triton servers of their own (`serve --role vision`) that
decode and encode the images and videos this replica's visual cache does not hold.

A pool member serves the same repository's `preprocessing` and `vision_encoder`; a request to it is a generation
request that holds the media alone (Preprocessing.pool_requests), and its answer's prompt table is their rows, in the
LLM's dtype, DeepStack rows included. Members are named as the gateway names replicas (serving.targets) and resolved
again every REFRESH_S; a batch's files go to one member, chosen round robin among those not known dead, and a call that
fails for want of a member (connection lost, the member stopping, its queue full) is sent once more to another. A
member that failed is skipped for RETRY_S, then tried again: a pool that comes back is used without a restart. Before
its first request, a member's preprocessing configuration is read and compared with this replica's
(PreprocessingParameters.pool_mismatch): a member of another repository schema, vision tower, prompt table or
limits is refused by name, logged once, and never sent a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from ...errors import StageError
from .. import interface
from ..client import CHANNEL_ARGS, ServerBusyError, ServerUnavailableError, request_inputs, rpc_errors, server_error
from ..parameters import ParameterError, PreprocessingParameters
from ..request import GenerationRequest
from ..targets import FleetTarget
from . import metrics as stage_metrics

_log = logging.getLogger(__name__)

REFRESH_S = 10.0  # how often the target's names are resolved again
RETRY_S = 5.0  # how long a member that failed is skipped
CONFIG_TIMEOUT_S = 10.0


class MemberFailed(Exception):
    """The member could not serve the call (gone, stopping, busy): another may."""


class Member(Protocol):
    """One pool member, as the pool talks to it (GrpcMember; tests stand in their own)."""

    async def parameters(self) -> PreprocessingParameters: ...

    async def table(self, request: GenerationRequest, request_id: str) -> torch.Tensor: ...

    async def close(self) -> None: ...


# A prompt table's Triton types as its raw bytes read (BF16 as its bits, which torch views as bfloat16).
_RAW_TYPES = {"BF16": np.uint16, "FP16": np.float16, "FP32": np.float32}


def table_rows(result: Any) -> torch.Tensor:
    """The prompt table a member answered ([1, rows, hidden] as Triton sends it) as a tensor of its own [rows, hidden],
    read from the response's raw bytes: tritonclient 2.68's as_numpy decodes BF16 one element at a time in Python
    (utils.deserialize_bf16_tensor: seconds for a large image's rows, on the stage's event loop), 2.73's answers it
    as ml_dtypes' bfloat16, which torch does not take."""
    response = result.get_response()
    index = next((i for i, o in enumerate(response.outputs) if o.name == interface.PROMPT_TABLE.name), None)
    if index is None:
        raise MemberFailed("the member answered no prompt table")
    output = response.outputs[index]
    raw = _RAW_TYPES.get(output.datatype)
    if raw is None:
        raise StageError(f"the member answered a prompt table of type {output.datatype}")
    bits = np.frombuffer(response.raw_output_contents[index], raw).reshape(-1, output.shape[-1])
    rows = torch.from_numpy(bits.copy())  # its own memory: the response's goes with it
    return rows.view(torch.bfloat16) if output.datatype == "BF16" else rows


class GrpcMember:
    """A member over gRPC (tritonclient's asyncio client, on the event loop that first uses it)."""

    def __init__(self, address: str):
        import tritonclient.grpc.aio as grpcclient

        self.address = address
        self.grpc = grpcclient.InferenceServerClient(address, channel_args=CHANNEL_ARGS)

    async def parameters(self) -> PreprocessingParameters:
        try:
            config = await self.grpc.get_model_config(interface.PREPROCESSING, client_timeout=CONFIG_TIMEOUT_S)
        except rpc_errors() as e:
            raise MemberFailed(f"{self.address}: {e}") from None
        return PreprocessingParameters.from_model_config(config.config)

    async def table(self, request: GenerationRequest, request_id: str) -> torch.Tensor:
        """The prompt table its preprocessing answers for the request; MemberFailed when another member may serve
        it, StageError when the request itself was refused."""

        async def one_request() -> Any:
            yield {"model_name": interface.PREPROCESSING, "inputs": request_inputs(request), "request_id": request_id}

        responses = self.grpc.stream_infer(one_request())
        table = None
        try:
            async for result, error in responses:
                if error is not None:
                    raise _member_error(self.address, error)
                if table is None:
                    table = table_rows(result)
        except rpc_errors() as e:
            raise _member_error(self.address, e) from None
        finally:
            responses.cancel()
        if table is None:
            raise MemberFailed(f"{self.address} answered no prompt table")
        return table

    async def close(self) -> None:
        await self.grpc.close()


def _member_error(address: str, error: Exception) -> Exception:
    failure = server_error(address, error)
    if isinstance(failure, (ServerBusyError, ServerUnavailableError)):
        return MemberFailed(str(failure))
    return StageError(f"the vision pool member {address} refused the images: {failure.reason or failure}")


class VisionPool:
    """The members of one target, as one preprocessing instance calls them (on its event loop)."""

    def __init__(
        self,
        target: str,
        mine: PreprocessingParameters,
        metrics: stage_metrics.MetricSink,
        connect: Callable[[str], Member] = GrpcMember,
        resolve: Callable[[], list[str]] | None = None,
    ):
        self.target = target
        self.fallback = mine.vision_fallback
        self._mine = mine
        self._metrics = metrics
        self._connect = connect
        self._resolve = resolve or FleetTarget.parse(target).resolve
        self._members: dict[str, Member] = {}  # checked and accepted
        self._refused: dict[str, str] = {}  # by address: why
        self._dead_until: dict[str, float] = {}
        self._addresses: list[str] = []
        self._resolved_at = -REFRESH_S
        self._turn = 0

    async def table(self, request: GenerationRequest, warm_up: bool) -> torch.Tensor | Exception:
        """The prompt table a member answers for the request (sent to one more member if the first failed), or why
        none did."""
        tried: list[str] = []
        why = "no member resolved"
        for _attempt in range(2):
            address = await self._next(tried)
            if address is None:
                break
            tried.append(address)
            started = time.monotonic()
            try:
                member = await self._member(address)
                if member is None:
                    continue
                if not warm_up:
                    self._metrics.add(stage_metrics.VISION_POOL_REQUESTS, 1)
                    if len(tried) > 1:
                        self._metrics.add(stage_metrics.VISION_POOL_RETRIES, 1)
                request_id = f"{interface.WARMUP_REQUEST_PREFIX}{interface.PREPROCESSING}" if warm_up else ""
                table = await member.table(request, request_id)
            except MemberFailed as e:
                why = str(e)
                self._dead_until[address] = time.monotonic() + RETRY_S
                _log.warning("vision pool member %s failed (%s); skipped for %g s", address, e, RETRY_S)
                continue
            except StageError as e:
                return e
            if not warm_up:
                sent = sum(len(source) for source in (*request.images, *request.videos))
                self._metrics.add(stage_metrics.VISION_POOL_BYTES, sent + table.numel() * table.element_size())
                self._metrics.observe(stage_metrics.VISION_POOL_SECONDS, time.monotonic() - started)
            self._dead_until.pop(address, None)
            return table
        if self._refused and all(address in self._refused for address in tried):
            refused = self._refused.items()
            why = "; ".join(f"{address} serves another repository ({reason})" for address, reason in refused)
        return StageError(f"the vision pool {self.target} did not answer: {why}")

    async def _next(self, tried: list[str]) -> str | None:
        """The next member round robin among those not tried, not refused and not known dead (the dead ones only
        when no other is left)."""
        now = time.monotonic()
        if now - self._resolved_at >= REFRESH_S:
            try:
                self._addresses = await asyncio.get_running_loop().run_in_executor(None, self._resolve)
            except Exception as e:  # the resolver failed: keep what it said last
                _log.warning("vision pool %s: cannot resolve its members (%s)", self.target, e)
            self._resolved_at = now
        candidates = [a for a in self._addresses if a not in tried and a not in self._refused]
        alive = [a for a in candidates if self._dead_until.get(a, 0.0) <= now]
        pick = alive or candidates
        if not pick:
            return None
        self._turn += 1
        return pick[self._turn % len(pick)]

    async def _member(self, address: str) -> Member | None:
        """The member at this address once its configuration matches this replica's; None when it does not."""
        member = self._members.get(address)
        if member is not None:
            return member
        member = self._connect(address)
        try:
            why = self._mine.pool_mismatch(await member.parameters())
        except ParameterError as e:  # another version's repository
            why = str(e)
        except BaseException:  # not answering: a new connection next time
            await member.close()
            raise
        if why is not None:
            self._refused[address] = why
            _log.error("vision pool member %s refused: it serves another repository (%s)", address, why)
            await member.close()
            return None
        self._members[address] = member
        return member

    def refused(self) -> dict[str, str]:
        """The members refused, by address, with why."""
        return dict(self._refused)

    async def close(self) -> None:
        for member in self._members.values():
            await member.close()
        self._members.clear()
