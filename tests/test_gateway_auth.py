"""Who may call the gateway (serving.gateway.auth): API keys loaded from the command line and key files, compared in
constant time; the middleware that requires `Authorization: Bearer <key>` on /v1/* (and /metrics unless opened) and
answers 401 with an OpenAI error body otherwise; the warning serve and openai print for an open API beyond
loopback. The official client against `serve --api-key-file` on the CPU deployment, its log scanned for the key:
tests/test_openai_agents.py."""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

import httpx
import pytest
from qwen3vl_trt.cli import _gateway_options, parser
from qwen3vl_trt.serving.gateway.auth import (
    API_KEY,
    KEY_OWNER,
    APIKeyError,
    APIKeyGuard,
    APIKeys,
    access_note,
    is_loopback,
    key_id,
    key_owner,
)
from qwen3vl_trt.serving.gateway.metrics import GatewayMetrics
from qwen3vl_trt.serving.gateway.options import GatewayOptions
from starlette.testclient import TestClient

KEY = "sk-qwen3vl-test-Zx81Qa"  # given on the command line
FILE_KEYS = ["sk-file-one-9f3b2c", "sk-file-two-a71e00"]  # in a key file
ALL_KEYS = [KEY, *FILE_KEYS]


def _key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(f"# the gateway's keys\n\n  {FILE_KEYS[0]}  \r\n{FILE_KEYS[1]}\n{FILE_KEYS[0]}\n")
    return path


# -- keys ---------------------------------------------------------------------------------------------------------


def test_keys_load_from_flags_and_files_and_match_bearer_headers_only(tmp_path):
    keys = APIKeys.load([KEY], [_key_file(tmp_path)])
    assert keys.ids == tuple(key_id(k) for k in ALL_KEYS)  # the file's duplicate once
    assert all(re.fullmatch(r"key-[0-9a-f]{8}", name) for name in keys.ids)
    assert keys.match(f"Bearer {KEY}") == hashlib.sha256(KEY.encode()).digest()
    # The scheme is case-insensitive.
    assert keys.match(f"bearer   {FILE_KEYS[1]} ".encode()) == hashlib.sha256(FILE_KEYS[1].encode()).digest()
    for refused in (None, "", "Bearer", "Bearer ", f"Bearer {KEY}x", f"Basic {KEY}", KEY, f"Token {KEY}"):
        assert keys.match(refused) is None, refused
    # No key in its repr, nor in the options' (the settings' repr holds APIKeys's).
    assert not any(k in repr(keys) for k in ALL_KEYS) and key_id(KEY) in repr(keys)
    options = GatewayOptions(api_keys=(KEY,), api_key_files=(tmp_path / "keys",))
    assert KEY not in repr(options) and KEY not in str(options)
    assert not APIKeys.load() and APIKeys.load([KEY])


def test_every_key_is_compared_in_constant_time(monkeypatch):
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def counting(a, b):
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    keys = APIKeys.load(ALL_KEYS)
    assert keys.match(f"Bearer {ALL_KEYS[0]}") == hashlib.sha256(ALL_KEYS[0].encode()).digest()
    # What a key owns: 64 hex digits of its own, not the digest keys are checked against.
    owners = {key_owner(hashlib.sha256(k.encode()).digest()) for k in ALL_KEYS}
    assert len(owners) == len(set(ALL_KEYS)) and all(re.fullmatch(r"owner-[0-9a-f]{64}", o) for o in owners)
    assert not any(hashlib.sha256(k.encode()).hexdigest() in o for k in ALL_KEYS for o in owners)
    # The first key matched, and the others were compared all the same (no early exit), digests of equal length.
    assert len(calls) == len(ALL_KEYS) and {len(a) for pair in calls for a in pair} == {32}


def test_bad_keys_and_key_files_are_refused_without_repeating_the_key(tmp_path):
    secret = "sk-oops-secret"
    cases = {
        "spaces.keys": f"{secret} and more\n",
        "tab.keys": f"{secret}\tx\n",
        "comments.keys": "# only comments\n\n   \n",
    }
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(APIKeyError) as raised:
            APIKeys.load(files=[path])
        assert str(path) in str(raised.value) and secret not in str(raised.value), name
    assert "line 1" in str(pytest.raises(APIKeyError, APIKeys.load, files=[tmp_path / "spaces.keys"]).value)
    for key in (f"{secret} x", "", f"{secret}\n"):
        with pytest.raises(APIKeyError) as raised:
            APIKeys.load([KEY, key])
        assert "--api-key #2" in str(raised.value) and (not key or secret not in str(raised.value))
    with pytest.raises(APIKeyError, match="cannot read the API key file"):
        APIKeys.load(files=[tmp_path / "missing"])


def test_flags_of_serve_and_openai_become_options(tmp_path):
    path = _key_file(tmp_path)
    keys = ["--api-key", KEY, "--api-key-file", str(path)]
    openai_args = parser().parse_args(["openai", *keys, "--open-metrics"])
    serve_args = parser().parse_args(["serve", "--repo", str(tmp_path), "--openai-port", "9000", *keys])
    for args, open_metrics in ((openai_args, True), (serve_args, False)):
        options = _gateway_options(args)
        assert (options.api_keys, options.api_key_files, options.open_metrics) == ((KEY,), (path,), open_metrics)
    assert _gateway_options(parser().parse_args(["openai"])).api_keys == ()


def test_an_open_api_beyond_loopback_is_warned_of():
    assert all(is_loopback(host) for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"))
    assert not any(is_loopback(host) for host in ("0.0.0.0", "::", "10.0.0.5", "gateway.example.com"))
    assert access_note(APIKeys(), False, "127.0.0.1", "http://127.0.0.1:9000") is None
    warning = access_note(APIKeys(), False, "0.0.0.0", "http://0.0.0.0:9000")
    assert warning is not None and warning.startswith("warning: the OpenAI API on http://0.0.0.0:9000 is open")
    assert "--api-key-file" in warning
    note = access_note(APIKeys.load([KEY]), True, "0.0.0.0", "http://0.0.0.0:9000")
    assert note is not None and key_id(KEY) in note and KEY not in note and "/metrics" not in note


# -- the middleware -------------------------------------------------------------------------------------------------


async def _echo_app(scope, receive, send):
    """What got through: the path and the key id and owner the guard put in the scope."""
    if scope["type"] != "http":
        return
    body = f"{scope['path']} {scope.get(API_KEY)} {scope.get(KEY_OWNER)}".encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})


def _guarded(keys: APIKeys, open_metrics: bool = False) -> tuple[TestClient, GatewayMetrics]:
    metrics = GatewayMetrics()
    return TestClient(APIKeyGuard(_echo_app, keys, open_metrics=open_metrics, metrics=metrics)), metrics


def _assert_401(response: httpx.Response, message: str) -> None:
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_api_key", None)
    assert message in error["message"]
    assert not any(k in response.text for k in ALL_KEYS)


def test_the_guard_requires_a_bearer_key_on_v1_and_metrics():
    keys = APIKeys.load(ALL_KEYS)
    client, metrics = _guarded(keys)
    _assert_401(client.get("/v1/models"), "no API key")
    _assert_401(client.post("/v1/chat/completions", json={}, headers={"Authorization": f"Bearer {KEY}-"}), "not valid")
    _assert_401(client.get("/v1/models", headers={"Authorization": f"Basic {KEY}"}), "not Bearer")
    _assert_401(client.get("/metrics"), "no API key")
    for path in ("/v1/models", "/v1/chat/completions", "/metrics"):
        response = client.get(path, headers={"Authorization": f"Bearer {FILE_KEYS[1]}"})
        owner = key_owner(hashlib.sha256(FILE_KEYS[1].encode()).digest())
        assert (response.status_code, response.text) == (200, f"{path} {key_id(FILE_KEYS[1])} {owner}")
    assert client.get("/health").text == "/health None None"  # open: probes carry no key
    refused = metrics.refusals.labels("unauthorized")._value.get()
    admitted = {name: metrics.registry.get_sample_value("qwen3vl_gateway_api_key_requests_total", {"key": name})
                for name in keys.ids}  # fmt: skip
    assert (refused, admitted) == (4, {key_id(KEY): 0, key_id(FILE_KEYS[0]): 0, key_id(FILE_KEYS[1]): 3})
    assert not any(k in metrics.render().decode() for k in ALL_KEYS)


def test_open_metrics_and_no_keys():
    client, _ = _guarded(APIKeys.load([KEY]), open_metrics=True)
    assert client.get("/metrics").status_code == 200
    _assert_401(client.get("/v1/models"), "no API key")
    client, metrics = _guarded(APIKeys())  # no keys: the API is open
    assert client.get("/v1/models").status_code == client.get("/metrics").status_code == 200
    assert metrics.registry.get_sample_value("qwen3vl_gateway_api_key_requests_total", {"key": "x"}) is None
