"""The gateway's settings: what a deployment it fronts runs with (read from its model repository or asked of a
replica) and the bounds the gateway keeps, as given (GatewayOptions) or else defaulted here and from the engine
limits (serving.backpressure)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...limits import EngineLimits
from .. import interface
from ..backpressure import BackPressure
from ..client import Client, ServerUnavailableError
from ..parameters import PreprocessingParameters
from ..ports import (
    BODY_SLACK_BYTES,
    DEFAULT_MAX_QUEUE_WAIT_S,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_REMOTE_MEDIA_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_STREAM_INTERVAL_MS,
    DEFAULT_TRITON_REFRESH_S,
    NO_GATEWAY_OPTIONS,
    GatewayOptions,
)
from ..repository import model_config as serving_config
from .auth import NO_API_KEYS, APIKeys
from .fleet import FleetTarget


@dataclass(frozen=True)
class GatewaySettings:
    """triton_url: the deployment's gRPC endpoints (one, or a fleet of replicas: see fleet.FleetTarget), names
    among them resolved again every triton_refresh_s. model_dir and limits: the checkpoint and engine limits
    the deployment's preprocessing runs with (read from its model config). served_model_name: the
    `model` clients ask for. remote_media_timeout_s: how long fetching one remote image or video may take.
    replica_ready_port: where each replica's `serve` answers whether it is ready (fleet.ServeProbe); 0 asks
    tritonserver's own gRPC readiness instead (fleet.GrpcProbe, for plain tritonservers).
    The rest as GatewayOptions describes them; resolve gives every field its default."""

    triton_url: str
    model_dir: Path
    limits: EngineLimits
    served_model_name: str
    allow_remote_media: bool
    remote_media_timeout_s: float
    request_timeout_s: float
    max_concurrent_requests: int
    max_queued_requests: int
    max_queue_wait_s: float
    max_request_bytes: int
    triton_refresh_s: float
    api_keys: APIKeys = NO_API_KEYS  # its repr: key ids only
    open_metrics: bool = False
    reasoning_parser: str = "auto"
    replica_ready_port: int = 0
    stream_interval_s: float = DEFAULT_STREAM_INTERVAL_MS / 1000

    @classmethod
    def resolve(
        cls, triton_url: str, model_dir: Path, limits: EngineLimits, options: GatewayOptions = NO_GATEWAY_OPTIONS
    ) -> GatewaySettings:
        """Options as given, else the defaults: requests in flight and queued as BackPressure plans them for the
        limits; bodies up to max_images images of max_image_bytes each as base64, plus BODY_SLACK_BYTES, and at
        most DEFAULT_MAX_REQUEST_BYTES."""
        images = limits.request_limits()
        base64_image = 4 * -(-images.max_image_bytes // 3)
        plan = BackPressure.plan(limits)
        return cls(
            triton_url,
            model_dir,
            limits,
            options.served_model_name or model_dir.name,
            allow_remote_media=options.allow_remote_media,
            remote_media_timeout_s=DEFAULT_REMOTE_MEDIA_TIMEOUT_S,
            request_timeout_s=_given(options.request_timeout_s, DEFAULT_REQUEST_TIMEOUT_S),
            max_concurrent_requests=_given(options.max_concurrent_requests, plan.gateway_in_flight),
            max_queued_requests=_given(options.max_queued_requests, plan.gateway_queued),
            max_queue_wait_s=_given(options.max_queue_wait_s, DEFAULT_MAX_QUEUE_WAIT_S),
            max_request_bytes=_given(
                options.max_request_bytes,
                min(images.max_images * base64_image + BODY_SLACK_BYTES, DEFAULT_MAX_REQUEST_BYTES),
            ),
            triton_refresh_s=DEFAULT_TRITON_REFRESH_S,
            api_keys=APIKeys.load(options.api_keys, options.api_key_files),
            open_metrics=options.open_metrics,
            reasoning_parser=options.reasoning_parser,
            stream_interval_s=_given(options.stream_interval_ms, DEFAULT_STREAM_INTERVAL_MS) / 1000,
        )

    @classmethod
    def from_repository(
        cls, triton_url: str, repo: Path, options: GatewayOptions = NO_GATEWAY_OPTIONS
    ) -> GatewaySettings:
        config = serving_config.read(Path(repo) / interface.PREPROCESSING)
        params = PreprocessingParameters.from_model_config(config)
        return cls.resolve(triton_url, params.model_dir, params.limits, options)

    @classmethod
    def from_server(
        cls, triton_url: str, options: GatewayOptions = NO_GATEWAY_OPTIONS, wait_s: float = 0.0
    ) -> GatewaySettings:
        """Asks a replica for its preprocessing model's configuration (once, before serving), waiting up to
        wait_s for one to answer (replicas load their engines for minutes)."""
        APIKeys.load(options.api_keys, options.api_key_files)  # a bad key file fails now, not after the wait
        target = FleetTarget.parse(triton_url)
        deadline = time.monotonic() + wait_s
        waiting = False
        while True:
            problems = []
            try:
                addresses = target.resolve()
            except Exception as e:  # socket.gaierror, dnspython's errors
                addresses, problems = [], [f"cannot resolve: {e}"]
            for address in addresses:
                client = Client(address)
                try:
                    config = client.grpc.get_model_config(interface.PREPROCESSING, client_timeout=10.0).config
                    params = PreprocessingParameters.from_model_config(config)
                except Exception as e:  # tritonclient's own error types; a replica of another repository layout
                    problems.append(f"{address}: {e}")
                    continue
                finally:
                    client.close()
                return cls.resolve(triton_url, params.model_dir, params.limits, options)
            if time.monotonic() >= deadline:
                raise ServerUnavailableError(
                    f"cannot read the {interface.PREPROCESSING} model's configuration from {triton_url} "
                    f"({'; '.join(problems) or 'no address resolved'}); start the deployment first, or pass --repo "
                    "with its model repository"
                )
            if not waiting:
                print(f"waiting up to {wait_s:g} s for a replica of {triton_url} to answer", flush=True)
                waiting = True
            time.sleep(1.0)


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value
