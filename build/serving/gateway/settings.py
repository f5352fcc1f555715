"""The gateway's settings: what the deployment it fronts runs with (read from its model repository or asked of a
replica) and the gateway's options (gateway.options), with the bounds they leave to the engine limits resolved
(serving.backpressure)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ...common.limits import EngineLimits
from .. import interface
from ..backpressure import BackPressure
from ..client import Client, ServerUnavailableError
from ..parameters import PreprocessingParameters
from ..repository import model_config as serving_config
from ..targets import FleetTarget
from .auth import NO_API_KEYS, APIKeys
from .options import (
    BODY_SLACK_BYTES,
    DEFAULT_GATEWAY_OPTIONS,
    MAX_DEFAULT_QUEUED_BYTES,
    MAX_DEFAULT_REQUEST_BYTES,
    GatewayOptions,
)


@dataclass(frozen=True)
class GatewaySettings:
    """What the gateway runs with: the deployment it fronts and the options it was given.

    triton_url: the deployment's gRPC endpoints (one, or a fleet of replicas: see fleet.FleetTarget). model_dir and
    limits: the checkpoint and engine limits the deployment's preprocessing runs with (read from its model config).
    api_keys: the options' keys, loaded (its repr: key ids only). The bounds the options leave to the limits are
    resolved here, once (the properties)."""

    triton_url: str
    model_dir: Path
    limits: EngineLimits
    options: GatewayOptions = DEFAULT_GATEWAY_OPTIONS
    api_keys: APIKeys = NO_API_KEYS

    @classmethod
    def resolve(
        cls, triton_url: str, model_dir: Path, limits: EngineLimits, options: GatewayOptions = DEFAULT_GATEWAY_OPTIONS
    ) -> GatewaySettings:
        return cls(triton_url, model_dir, limits, options, APIKeys.load(options.api_keys, options.api_key_files))

    @property
    def served_model_name(self) -> str:
        return self.options.served_model_name or self.model_dir.name

    @property
    def max_concurrent_requests(self) -> int:
        """As given, else as BackPressure plans the gateway's share for the limits."""
        given = self.options.max_concurrent_requests
        return BackPressure.plan(self.limits).gateway_in_flight if given is None else given

    @property
    def max_queued_requests(self) -> int:
        given = self.options.max_queued_requests
        return BackPressure.plan(self.limits).gateway_queued if given is None else given

    @property
    def max_queued_bytes(self) -> int:
        """As given, else the queued requests' largest bodies up to MAX_DEFAULT_QUEUED_BYTES; at least one body."""
        given = self.options.max_queued_bytes
        if given is None:
            given = min(self.max_queued_requests * self.max_request_bytes, MAX_DEFAULT_QUEUED_BYTES)
        return max(given, self.max_request_bytes)

    @property
    def max_request_bytes(self) -> int:
        """As given, else max_images images of max_image_bytes each as base64, plus BODY_SLACK_BYTES, and at most
        MAX_DEFAULT_REQUEST_BYTES."""
        if self.options.max_request_bytes is not None:
            return self.options.max_request_bytes
        images = self.limits.request_limits()
        base64_image = 4 * -(-images.max_image_bytes // 3)
        return min(images.max_images * base64_image + BODY_SLACK_BYTES, MAX_DEFAULT_REQUEST_BYTES)

    @classmethod
    def from_repository(
        cls, triton_url: str, repo: Path, options: GatewayOptions = DEFAULT_GATEWAY_OPTIONS
    ) -> GatewaySettings:
        config = serving_config.read(Path(repo) / interface.PREPROCESSING)
        params = PreprocessingParameters.from_model_config(config)
        return cls.resolve(triton_url, params.model_dir, params.limits, options)

    @classmethod
    def from_server(
        cls, triton_url: str, options: GatewayOptions = DEFAULT_GATEWAY_OPTIONS, wait_s: float = 0.0
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
