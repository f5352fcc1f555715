"""The Batch API from a client's side (`qwen3vl-trt batch`): submit a JSONL file of requests to a gateway, watch the
batch's progress, fetch its output and error files, cancel it; over HTTP with the gateway's API key, as OpenAI's
client would (docs/batch.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ..errors import ServingError

ENDED = ("completed", "failed", "expired", "cancelled")
POLL_S = 2.0


@dataclass(frozen=True)
class BatchClient:
    """A gateway's Batch API at `url` (http://HOST:PORT), with `api_key` where it requires one."""

    url: str
    api_key: str | None = None
    timeout_s: float = 300.0

    def _http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url.rstrip("/") + "/v1", headers=headers, timeout=self.timeout_s)

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            with self._http() as http:
                response = http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise ServingError(f"the gateway at {self.url} cannot be reached: {e}") from None
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:500]
            raise ServingError(f"{method} /v1{path}: {response.status_code}: {message}")
        return response

    def submit(self, requests: Path, endpoint: str, window: str, metadata: dict[str, str] | None = None) -> dict:
        """Uploads the file and creates a batch of it; the batch."""
        with open(requests, "rb") as source:
            files = {"file": (requests.name, source, "application/jsonl")}
            uploaded = self._call("POST", "/files", data={"purpose": "batch"}, files=files).json()
        body = {"input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": window}
        if metadata:
            body["metadata"] = metadata
        return self._call("POST", "/batches", json=body).json()

    def batch(self, batch_id: str) -> dict:
        return self._call("GET", f"/batches/{batch_id}").json()

    def cancel(self, batch_id: str) -> dict:
        return self._call("POST", f"/batches/{batch_id}/cancel").json()

    def wait(self, batch_id: str, progress: Callable[[dict], None] = lambda _: None, poll_s: float = POLL_S) -> dict:
        """The batch once it has ended, `progress` called with it on every look."""
        while True:
            batch = self.batch(batch_id)
            progress(batch)
            if batch["status"] in ENDED:
                return batch
            time.sleep(poll_s)

    def fetch(self, batch: dict, output: Path, errors: Path | None = None) -> list[Path]:
        """The batch's output file (and its error file, when it has one) written to `output` (and `errors`, else
        beside it as <output>.errors.jsonl); the paths written."""
        written = []
        for key, path in (("output_file_id", output), ("error_file_id", errors or output.with_suffix(".errors.jsonl"))):
            if batch.get(key):
                content = self._call("GET", f"/files/{batch[key]}/content").content
                path.write_bytes(content)
                written.append(path)
        return written
