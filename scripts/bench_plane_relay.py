#!/usr/bin/env python3
"""The gateway route's floor for scripts/bench_plane.py: the least an HTTP front end can do per streamed
token. A bare ASGI app on uvicorn (no framework, no validation, no detokenization) that takes
`POST /` with {"max_tokens": N}, sends one request straight to the floor's `llm` over gRPC
(tritonclient's asyncio client, as the gateway uses it) and relays each response's token ids as one
server-sent event; `GET /` answers 200 once it listens.

    python scripts/bench_plane_relay.py TRITON_URL PORT
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcclient
import uvicorn
from qwen3vl_trt.serving import interface

SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def _input(name: str, value: Any, dtype: Any, triton_type: str) -> grpcclient.InferInput:
    array = np.array([[value]], dtype=dtype)
    spec = grpcclient.InferInput(name, list(array.shape), triton_type)
    spec.set_data_from_numpy(array)
    return spec


def llm_inputs(max_tokens: int) -> list[grpcclient.InferInput]:
    """The llm's required inputs for a streamed request of max_tokens tokens (one prompt token)."""
    return [
        _input(interface.INPUT_IDS.name, 1000, np.int32, "INT32"),
        _input(interface.INPUT_LENGTHS.name, 1, np.int32, "INT32"),
        _input(interface.REQUEST_OUTPUT_LEN.name, max_tokens, np.int32, "INT32"),
        _input(interface.STREAMING.name, True, bool, "BOOL"),
    ]


class Relay:
    def __init__(self, triton_url: str):
        self.triton_url = triton_url
        self.client: grpcclient.InferenceServerClient | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["method"] == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        max_tokens = int(json.loads(body)["max_tokens"])
        if self.client is None:  # on the serving loop, which grpc.aio binds the channel to
            self.client = grpcclient.InferenceServerClient(self.triton_url)

        async def one() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": interface.LLM, "inputs": llm_inputs(max_tokens)}

        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        async for result, error in self.client.stream_infer(one()):
            if error is not None:
                raise RuntimeError(str(error))
            ids = result.as_numpy(interface.LLM_OUTPUT_IDS.name)
            if ids is not None:
                event = b"data: " + json.dumps({"ids": ids.reshape(-1).tolist()}).encode() + b"\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def main() -> None:
    triton_url, port = sys.argv[1], int(sys.argv[2])
    uvicorn.run(Relay(triton_url), host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off")


if __name__ == "__main__":
    main()
