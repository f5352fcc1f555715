"""The `qwen3vl-trt` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import signal
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from . import __version__
from .errors import Qwen3VLTrtError
from .hf.chat_templates import RELEASED_TEMPLATES
from .serving.gateway.options import DEFAULT_GATEWAY_OPTIONS, DEFAULT_OPENAI_PORT, REASONING_PARSERS, GatewayOptions
from .serving.ports import LOCAL_TRITON_URL, READY_TIMEOUT_S, STOP_GRACE_S, ServerPorts

if TYPE_CHECKING:
    from .hf.checkpoint import Checkpoint
    from .pipeline.build import BuildOptions
    from .serving.server.serve import ServeOptions


def _read_files(paths: Sequence[str], kind: str = "image") -> list[bytes]:
    from pathlib import Path

    from .errors import MessageError

    read = []
    for path in paths:
        try:
            read.append(Path(path).read_bytes())
        except OSError as e:
            raise MessageError(f"cannot read {kind} {path}: {e.strerror}") from None
    return read


def _media_parts(args: argparse.Namespace) -> list[dict]:
    """Chat content parts of --image and --video files, images first."""
    images = [{"type": "image", "image": data} for data in _read_files(args.image)]
    return images + [{"type": "video", "video": data} for data in _read_files(args.video, "video")]


def _make_tiny(args: argparse.Namespace) -> None:
    from .qa.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        args.output, moe=args.moe, seed=args.seed, preset=args.preset, force=args.force, template=args.template
    )
    print(f"wrote {'MoE' if args.moe else 'dense'} {args.preset} {args.template} checkpoint to {path}")


def _inspect(args: argparse.Namespace) -> None:
    from .common.contracts import VISUAL_PREFIX
    from .hf.checkpoint import Checkpoint

    ckpt = Checkpoint(args.model)
    ckpt.verify_shards()
    info = ckpt.info
    visual = ckpt.tensor_names(VISUAL_PREFIX)
    print(
        json.dumps(
            {
                "model_type": info.model_type,
                "size": info.size_name,
                "moe": info.is_moe,
                "vision": asdict(info.vision) | {"head_dim": info.vision.head_dim},
                "text": asdict(info.text),
                "shards": len(ckpt.shard_files),
                "visual_tensors": len(visual),
                "visual_bytes": ckpt.tensor_bytes(visual),
                "quantization": _quantization_summary(ckpt),
                "bytes_by_dtype": ckpt.stored_bytes(),
            },
            indent=2,
            default=list,
        )
    )


def _quantization_summary(ckpt: Checkpoint) -> dict | None:
    """What inspect says of the checkpoint's own quantization (None: unquantized)."""
    from .common.contracts import VISUAL_PREFIX

    q = ckpt.info.quantization
    if q is None:
        return None
    quantized = ckpt.quantized_tensor_names()
    return q.describe() | {
        "quantized_tensors": len(quantized),
        "quantized_bytes": ckpt.tensor_bytes(quantized),
        "vision_quantized": any(n.startswith(VISUAL_PREFIX) for n in quantized),
    }


def _export_vision(args: argparse.Namespace) -> None:
    from .vision.export import export_vision

    result = export_vision(
        args.model, args.output, dtype=args.dtype, verify=args.verify, force=args.force, variant=args.variant
    )
    print(f"wrote {result.output_dir}")


def _build_vision_engine(args: argparse.Namespace) -> None:
    from .vision.engine import VisionEngineProfile, build_vision_engine

    profile = VisionEngineProfile(args.min_patches, args.opt_patches, args.max_patches, args.max_images)
    path = build_vision_engine(
        args.onnx,
        args.output,
        profile,
        dtype=args.dtype,
        arch=args.arch,
        timing_cache=args.timing_cache,
        optimization_level=args.optimization_level,
        force=args.force,
    )
    print(f"wrote {path}")


def _build(args: argparse.Namespace) -> None:
    from .build_cache.store import CacheSettings
    from .pipeline.build import build

    if args.cache is None and args.checkpoint_id is not None:
        raise Qwen3VLTrtError("--checkpoint-id names the checkpoint in a build cache key: give --cache too")
    cache = None
    if args.cache is not None:
        cache = CacheSettings(
            args.cache, args.cache_pull, args.verify, args.checkpoint_id, args.cache_lease_s, args.cache_wait_s
        )
    # A pod deleted mid-build gets SIGTERM: end as an interrupt does, so the build's lease on a cache key is
    # released and its partial work removed now rather than after the lease lapses.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        build(
            args.model,
            args.output,
            _build_options(args),
            target=args.target,
            settings=_repository_settings(args),
            force=args.force,
            cache=cache,
        )
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _build_options(args: argparse.Namespace) -> BuildOptions:
    from .pipeline.build import BuildOptions

    return BuildOptions(
        dtype=args.dtype,
        vision_engine_dtype=args.vision_engine_dtype,
        llm_dtype=args.llm_dtype,
        llm_quant=args.llm_quant,
        **_quantization_options(args),
        tp=args.tp,
        pp=args.pp,
        limits=_engine_limits(args),
    )


def _build_key(args: argparse.Namespace) -> None:
    from .build_cache.store import BuildCache
    from .hf.checkpoint import Checkpoint
    from .pipeline.build import build_key

    ckpt = Checkpoint(args.model)
    options = _build_options(args)
    llm = options.check(ckpt)
    remembered = None if args.cache is None else BuildCache(args.cache).open().remembered
    log = (lambda _line: None) if args.json else print
    # stdout is the key's alone with --json: TensorRT-LLM prints a banner when imported.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        key = build_key(ckpt, options, llm, args.checkpoint_id, remembered, log)
    print(json.dumps({"key": key.key, "parts": dict(key.parts)}, indent=2) if args.json else key.describe())


def _cache(args: argparse.Namespace) -> None:
    import time

    from .build_cache.store import BuildCache

    cache = BuildCache(args.cache).open(create=False)
    if args.action == "list":
        entries = cache.listing()
        if args.json:
            print(json.dumps([asdict(e) for e in entries], indent=2))
            return
        for e in entries:
            days = (time.time() - e.last_used) / 86400
            what = f"{e.parts.get('checkpoint', '?')[:23]} gpu={e.parts.get('gpu', '?')} tp={e.parts.get('tp', '?')}"
            print(f"{e.key}  {e.bytes / 2**30:8.2f} GiB  pulled {days:5.1f} days ago  {what}")
        print(f"{len(entries)} entries, {sum(e.bytes for e in entries) / 2**30:.2f} GiB in {cache.root}")
        return
    if args.older_than_days is None and args.max_gib is None:
        raise Qwen3VLTrtError("cache prune needs --older-than-days or --max-gib (or both)")
    removed = cache.prune(
        None if args.older_than_days is None else args.older_than_days * 86400,
        None if args.max_gib is None else int(args.max_gib * 2**30),
        args.dry_run,
    )
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {len(removed)} entries" + "".join(f"\n  {key}" for key in removed))


def _repository_settings(args: argparse.Namespace):
    from .serving.repository.settings import RepositorySettings

    return RepositorySettings(
        max_queue_delay_us=args.max_queue_delay_us,
        dynamic_batching=not args.no_dynamic_batching,
        max_queue_size=args.max_queue_size,
        queue_timeout_us=int(args.queue_timeout_ms * 1000),
        attention_budget_bytes=args.vision_attention_mib * 2**20,
        visual_cache="off" if args.no_visual_cache else args.visual_cache,
        visual_cache_bytes=None if args.visual_cache_mib is None else args.visual_cache_mib * 2**20,
        visual_cache_ttl_s=args.visual_cache_ttl_s,
        kv_cache_free_gpu_mem_fraction=args.kv_cache_free_gpu_mem_fraction,
        python_models_gpu=args.python_models_gpu,
        gpu_memory_bytes=None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * 2**30),
    )


def _add_repository_options(s: argparse.ArgumentParser) -> None:
    from .serving.backpressure import QUEUED_BATCHES
    from .serving.repository.settings import VISUAL_CACHE_MAX_BYTES, VISUAL_CACHE_MIN_BYTES, RepositorySettings

    d = RepositorySettings()
    g = s.add_argument_group("Triton repository")
    g.add_argument("--target", choices=["gpu", "cpu"], help="default: gpu where the GPU stack is present, else cpu")
    g.add_argument("--max-queue-delay-us", type=int, default=d.max_queue_delay_us, help="dynamic batching delay")
    g.add_argument("--no-dynamic-batching", action="store_true", help="one request per model execution")
    g.add_argument(
        "--max-queue-size",
        type=_positive_int,
        help="requests preprocessing and llm each hold waiting; more are refused at once (UNAVAILABLE) "
        f"(default: {QUEUED_BATCHES} x --max-batch-size)",
    )
    g.add_argument(
        "--queue-timeout-ms",
        type=float,
        default=d.queue_timeout_us / 1000,
        help="refuse a request that waited this long in a model's queue (default 0: only the queue's size bounds it)",
    )
    g.add_argument(
        "--vision-attention-mib",
        type=int,
        default=d.attention_budget_bytes >> 20,
        help="attention memory of one vision encoder run (the batch is cut into runs that fit)",
    )
    cache = g.add_mutually_exclusive_group()
    cache.add_argument(
        "--visual-cache",
        type=_visual_cache,
        default=d.visual_cache,
        help="where images' encoded features are kept, so a repeated image is neither decoded nor encoded again: "
        "'memory' (in the preprocessing process, an LRU within --visual-cache-mib) or redis://HOST:PORT/DB "
        "(shared by replicas; docs/visual-cache.md) (default: %(default)s)",
    )
    cache.add_argument("--no-visual-cache", action="store_true", help="encode every image of every request")
    g.add_argument(
        "--visual-cache-mib",
        type=_positive_int,
        help="the in-process visual cache's budget (default: 4 full batches of the largest requests' features, "
        f"{VISUAL_CACHE_MIN_BYTES >> 20} MiB to {VISUAL_CACHE_MAX_BYTES >> 20} MiB)",
    )
    g.add_argument(
        "--visual-cache-ttl-s",
        type=_positive_int,
        default=d.visual_cache_ttl_s,
        help="with Redis: seconds an entry lives (default: %(default)s)",
    )
    g.add_argument(
        "--kv-cache-free-gpu-mem-fraction",
        type=float,
        default=d.kv_cache_free_gpu_mem_fraction,
        help="GPU target: share of free GPU memory for the KV cache (default: from the GPU memory plan, "
        "which leaves room for the python models; docs/gpu-hosts.md)",
    )
    g.add_argument(
        "--python-models-gpu",
        type=int,
        default=d.python_models_gpu,
        help="GPU target: the GPU of the preprocessing and vision_encoder instances",
    )
    g.add_argument(
        "--gpu-memory-gib",
        type=float,
        help="GPU target: each GPU's memory, for the plan (default: the smallest of the GPUs', where they are visible)",
    )


def _write_repo(args: argparse.Namespace) -> None:
    from .serving.repository.writer import write_repository

    path = write_repository(
        args.build_dir,
        args.output,
        target=args.target,
        model_dir=args.model,
        settings=_repository_settings(args),
        force=args.force,
    )
    print(f"wrote Triton model repository {path}")


def _gateway_options(args: argparse.Namespace) -> GatewayOptions:
    """The gateway's options; `openai` alone fronts a fleet (serve's gateway, its own replica)."""
    fleet = DEFAULT_GATEWAY_OPTIONS
    return GatewayOptions(
        served_model_name=args.served_model_name,
        allow_remote_media=args.allow_remote_media,
        max_concurrent_requests=args.max_concurrent_requests,
        max_queued_requests=args.max_queued_requests,
        max_queue_wait_s=args.max_queue_wait,
        max_queued_bytes=args.max_queued_bytes,
        queue_order=args.queue_order,
        queue_ageing=args.queue_ageing,
        max_request_bytes=args.max_request_bytes,
        request_timeout_s=args.request_timeout,
        reasoning_parser=args.reasoning_parser,
        stream_interval_ms=args.stream_interval_ms,
        api_keys=tuple(args.api_key),
        api_key_files=tuple(args.api_key_file),
        open_metrics=args.open_metrics,
        batch_redis=args.batch_redis,
        batch_dir=args.batch_dir,
        batch_runners=args.batch_runners,
        batch_share=args.batch_share,
        batch_claim_s=args.batch_claim_s,
        batch_group_images=not args.batch_file_order,
        triton_refresh_s=getattr(args, "triton_refresh", fleet.triton_refresh_s),
        replica_ready_port=getattr(args, "replica_ready_port", fleet.replica_ready_port),
    )


def serve_options(args: argparse.Namespace) -> ServeOptions:
    from .serving.server.serve import ServeOptions

    return ServeOptions(
        repo=args.repo,
        ports=ServerPorts(args.grpc_port, args.http_port, args.metrics_port, args.ready_port),
        address=args.address,
        tritonserver=args.tritonserver,
        print_command=args.print_command,
        log_verbose=args.log_verbose,
        ready_timeout=args.ready_timeout,
        openai_port=args.openai_port,
        gateway=_gateway_options(args),
        stop_grace=args.stop_grace,
        max_queue_size=args.max_queue_size,
        visual_cache=args.visual_cache,
        warmup=args.warmup,
        role=args.role,
        vision_pool=args.vision_pool,
        vision_fallback=args.vision_fallback,
    )


def _serve(args: argparse.Namespace) -> int:
    from .serving.server.serve import serve

    return serve(serve_options(args))


def _openai(args: argparse.Namespace) -> int:
    from .serving.gateway.app import run_openai

    return run_openai(
        args.triton_url,
        args.repo,
        _gateway_options(args),
        args.address,
        args.port,
        wait_s=args.wait_ready,
    )


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port (1-65535)")
    return port


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a share in (0, 1]")
    return value


def _visual_cache(text: str) -> str:
    from .errors import LimitsError
    from .serving.parameters import check_cache_setting

    try:
        return check_cache_setting(text)
    except LimitsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _triton_url(text: str) -> str:
    from .serving.targets import FleetTarget, FleetTargetError

    try:
        FleetTarget.parse(text)
    except FleetTargetError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of 0 or more")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def _ageing(text: str) -> float:
    value = float(text)
    if not 1 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} is not a number of 1 or more")
    return value


def _add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """The OpenAI gateway's options, which `serve --openai-port` and `openai` both take."""
    from .serving.backpressure import GATEWAY_IN_FLIGHT_BATCHES, GATEWAY_QUEUED_BATCHES
    from .serving.gateway.options import (
        BODY_SLACK_BYTES,
        MAX_DEFAULT_QUEUED_BYTES,
        MAX_DEFAULT_REQUEST_BYTES,
        QUEUE_ORDERS,
    )

    defaults = DEFAULT_GATEWAY_OPTIONS

    parser.add_argument(
        "--served-model-name", help="the `model` clients ask for (default: the checkpoint's folder name)"
    )
    parser.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="fetch http(s) image and video URLs in messages (default: only data: URLs are accepted)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=defaults.reasoning_parser,
        help="split <think>...</think> into reasoning_content: auto (default: when the chat template opens a "
        "reasoning block, as the Thinking checkpoints' does), qwen3 (always), none (the text as generated)",
    )
    parser.add_argument(
        "--stream-interval-ms",
        type=_non_negative_float,
        default=defaults.stream_interval_ms,
        help="a streamed answer's chunks after its first text go out together at most this often, each as it is "
        "(default: %(default)g; 0: each as it comes)",
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=_positive_int,
        help=f"chat requests served at once (default: {GATEWAY_IN_FLIGHT_BATCHES} x the engine's max_batch_size)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=_non_negative_int,
        help="requests that wait for a slot beyond those; more are refused with 429 "
        f"(default: {GATEWAY_QUEUED_BATCHES} x max_batch_size)",
    )
    parser.add_argument(
        "--max-queue-wait",
        type=_positive_float,
        default=defaults.max_queue_wait_s,
        help="seconds a queued request waits for a slot before it is refused with 429 (default: %(default)g)",
    )
    parser.add_argument(
        "--max-queued-bytes",
        type=_positive_int,
        help="the bodies of the requests held without a slot, in all; a request past it is refused with 429 "
        f"(default: max queued requests x max request bytes, at most {MAX_DEFAULT_QUEUED_BYTES // 2**20} MiB; at "
        "least --max-request-bytes)",
    )
    parser.add_argument(
        "--queue-order",
        choices=QUEUE_ORDERS,
        default=defaults.queue_order,
        help="which waiting request a free slot goes to: short-first (default: the least prompt plus output tokens, "
        "with ageing) or fifo (the first come)",
    )
    parser.add_argument(
        "--queue-ageing",
        type=_ageing,
        default=defaults.queue_ageing,
        metavar="FACTOR",
        help="short-first: a request gets its slot within FACTOR x the slots handed out before first come first "
        "served would give it one, plus one round of the slots (default: %(default)g)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=_positive_int,
        help="larger request bodies are refused with 413 (default: max images x max image bytes as base64 plus "
        f"{BODY_SLACK_BYTES // 2**20} MiB, at most {MAX_DEFAULT_REQUEST_BYTES // 2**20} MiB)",
    )
    parser.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=defaults.request_timeout_s,
        help="seconds a request may take; then it ends with an error and is cancelled on the server "
        "(default: %(default)g)",
    )
    # No type= on --api-key: argparse would repeat a refused value in its error message.
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require Authorization: Bearer KEY on /v1/* and /metrics (repeat for several keys); a command line is "
        "visible to every local user: prefer --api-key-file",
    )
    parser.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        type=pathlib.Path,
        metavar="PATH",
        help="a file of API keys, one a line (blank lines and # comments skipped), required as with --api-key "
        "(repeat for several files)",
    )
    parser.add_argument(
        "--open-metrics",
        action="store_true",
        help="serve GET /metrics without a key even when keys are required (for scrapers without credentials)",
    )
    batches = DEFAULT_GATEWAY_OPTIONS
    parser.add_argument(
        "--batch-redis",
        metavar="URL",
        help="serve the Batch API (/v1/files, /v1/batches) with its state in this Redis (redis://HOST:PORT/DB): one "
        "of its own, with --appendonly yes and --maxmemory-policy noeviction, never the visual cache's; needs "
        "--batch-dir (docs/batch.md)",
    )
    parser.add_argument(
        "--batch-dir",
        type=pathlib.Path,
        metavar="DIR",
        help="where batch files are kept: a directory every gateway of the deployment mounts",
    )
    parser.add_argument(
        "--batch-runners",
        type=_positive_int,
        default=batches.batch_runners,
        help=f"batch lines this gateway runs at once (default {batches.batch_runners})",
    )
    parser.add_argument(
        "--batch-share",
        type=_share,
        default=batches.batch_share,
        help="the most of the request slots batch lines take, and only while no request waits (default "
        f"{batches.batch_share})",
    )
    parser.add_argument(
        "--batch-claim-s",
        type=_positive_float,
        default=batches.batch_claim_s,
        metavar="SECONDS",
        help="a batch line whose gateway stopped holding it (killed) is run by another after this long (default "
        f"{batches.batch_claim_s:g})",
    )
    parser.add_argument(
        "--batch-file-order",
        action="store_true",
        help="run a batch's lines in the file's order, each on its own, instead of lines that share an image "
        "together (which the visual cache serves all but the first of): for comparison",
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from .serving.server.tritonserver_install import ENV_VAR, NGC_INSTALL

    defaults = ServerPorts()
    parser.add_argument(
        "--repo", required=True, type=pathlib.Path, help="Triton model repository written by qwen3vl-trt"
    )
    parser.add_argument("--grpc-port", type=_port, default=defaults.grpc)
    parser.add_argument("--http-port", type=_port, default=defaults.http)
    parser.add_argument("--metrics-port", type=_port, default=defaults.metrics)
    parser.add_argument(
        "--ready-port",
        type=_port,
        default=defaults.ready,
        help="serve's own readiness endpoint: GET /ready (200 once warmed up and while tritonserver is ready, else "
        f"503) and GET /metrics (default: {defaults.ready})",
    )
    parser.add_argument(
        "--address",
        default="127.0.0.1",
        help="address every endpoint binds to (0.0.0.0: all interfaces, e.g. in a container); default loopback only",
    )
    parser.add_argument(
        "--tritonserver",
        help=f"tritonserver binary (default: ${ENV_VAR}, PATH, {NGC_INSTALL}, else the nvidia-pytriton wheel's)",
    )
    parser.add_argument("--print-command", action="store_true", help="print the server command and exit")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver verbose logging level")
    parser.add_argument(
        "--ready-timeout", type=float, default=READY_TIMEOUT_S, help="seconds to wait for every model to load"
    )
    parser.add_argument(
        "--stop-grace",
        type=_positive_float,
        default=STOP_GRACE_S,
        help="seconds the requests in flight get to finish after a stop (SIGTERM, Ctrl-C; tritonserver's "
        "--exit-timeout-secs); then the server is killed",
    )
    parser.add_argument(
        "--max-queue-size",
        type=_positive_int,
        help="requests preprocessing and llm each hold waiting, more are refused at once "
        "(default: as build/write-repo set it)",
    )
    parser.add_argument(
        "--visual-cache",
        type=_visual_cache,
        help="where preprocessing keeps images' features: 'off', 'memory' or redis://HOST:PORT/DB, shared by "
        "replicas (default: as build/write-repo set it)",
    )
    parser.add_argument(
        "--role",
        choices=("replica", "vision", "language"),
        default="replica",
        help="replica (default): the whole deployment; vision: a vision pool member, serving only preprocessing and "
        "the vision encoder for replicas started with --vision-pool; language: a replica without a vision encoder "
        "(its GPU memory goes to the KV cache), which needs --vision-pool and is ready only while a member is "
        "(docs/vision-pool.md)",
    )
    parser.add_argument(
        "--vision-pool",
        type=_triton_url,
        metavar="TARGET",
        help="decode and encode the images and videos the visual cache does not hold on these `serve --role vision` "
        "members (HOST:PORT of their gRPC, a comma-separated list, a name that resolves to each, or "
        "dns://[DNS_SERVER:PORT]/NAME:PORT), round robin, a failed call retried once on another",
    )
    parser.add_argument(
        "--vision-fallback",
        choices=("local", "fail"),
        help="with --vision-pool, when no member answers: local (default; a language replica has no encoder: fail) "
        "encodes here, fail ends the request's images with an error naming the pool",
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="report ready without first sending warm-up requests through every model (default: warm up)",
    )
    parser.add_argument(
        "--openai-port",
        type=_port,
        help="also serve the OpenAI-compatible API (POST /v1/chat/completions) on this port, on --address",
    )
    _add_gateway_arguments(parser)


def _infer(args: argparse.Namespace) -> None:

    from .serving.client import Client

    images = _read_files(args.image)
    client = Client(args.url, timeout_s=args.timeout)
    options = dict(
        stream=args.stream,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        videos=_read_files(args.video, "video"),
    )
    if args.json:
        answer = client.generate(args.prompt, images, args.max_tokens, **options)
        print(json.dumps({"text": answer.text, "token_ids": answer.token_ids}))
    else:
        client.generate(args.prompt, images, args.max_tokens, on_text=lambda s: print(s, end="", flush=True), **options)
        print()


def _quantization_options(args: argparse.Namespace) -> dict:
    """The options _add_llm_quant adds besides --llm-quant, as build and convert_llm take them."""
    return {"kv_cache_dtype": args.kv_cache_dtype, "gpu_arch": args.gpu_arch, "calibration_data": args.calibration_data}


def _convert_llm(args: argparse.Namespace) -> None:
    from .pipeline.calibration import convert_calibrated

    path = convert_calibrated(
        args.model,
        args.output,
        dtype=args.dtype,
        tp=args.tp,
        pp=args.pp,
        quant=args.llm_quant,
        **_quantization_options(args),
        force=args.force,
        log=print,
    )
    print(f"wrote TensorRT-LLM checkpoint ({args.tp * args.pp} rank files) to {path}")


def _generate(args: argparse.Namespace) -> None:

    from .runtime.local import LocalPipeline
    from .runtime.sampling import SamplingParams

    pipeline = LocalPipeline(args.model, args.build)
    parts = _media_parts(args)
    parts.append({"type": "text", "text": args.text})
    sampling = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        end_ids=pipeline.end_ids,
    )
    messages = [{"role": "user", "content": parts}]
    if args.json:
        reply = pipeline.generate(messages, sampling)
        print(json.dumps({"text": reply.text, "token_ids": reply.token_ids}))
    else:
        pipeline.generate(messages, sampling, on_text=lambda s: print(s, end="", flush=True))
        print()


def _engine_limits(args: argparse.Namespace):
    from .common.limits import EngineLimits

    return EngineLimits(
        max_batch_size=args.max_batch_size,
        max_input_len=args.max_input_len,
        max_seq_len=args.max_seq_len,
        max_num_tokens=args.max_num_tokens,
        max_visual_tokens=args.max_visual_tokens,
        max_top_logprobs=args.max_top_logprobs,
    )


def _build_llm_engine(args: argparse.Namespace) -> None:
    import shlex
    from pathlib import Path

    from .llm.checkpoint_format import read_trtllm_config
    from .llm.engine_build import build_llm_engine, launcher_command

    limits = _engine_limits(args)
    if args.print_command:
        _, config = read_trtllm_config(args.checkpoint)
        command = launcher_command(
            str(Path(args.checkpoint).absolute()), str(Path(args.output).absolute()), config, limits
        )
        print(shlex.join(["python", *command[1:]]))
        return
    print(f"wrote {build_llm_engine(args.checkpoint, args.output, limits, force=args.force)}")


def _add_limits(s: argparse.ArgumentParser) -> None:
    from .common.limits import EngineLimits

    d = EngineLimits()
    g = s.add_argument_group("engine limits")
    g.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="requests in flight")
    g.add_argument("--max-input-len", type=int, default=d.max_input_len, help="prompt tokens, visual included")
    g.add_argument("--max-seq-len", type=int, default=d.max_seq_len, help="prompt + generated tokens")
    g.add_argument("--max-num-tokens", type=int, default=d.max_num_tokens, help="tokens per engine step")
    g.add_argument("--max-visual-tokens", type=int, default=d.max_visual_tokens, help="visual tokens per request")
    g.add_argument(
        "--max-top-logprobs", type=int, default=d.max_top_logprobs,
        help="alternatives a request may ask per generated token (top_logprobs; 0: none; costs GPU memory, see "
        "docs/serving.md)",
    )  # fmt: skip


def _preprocess(args: argparse.Namespace) -> None:

    from .preprocess import Preprocessor

    pre = Preprocessor.from_pretrained(args.model, resize_backend=args.resize_backend, device=args.device)
    if args.prompt is not None:
        request = pre(prompt=args.prompt, images=_read_files(args.image), videos=_read_files(args.video, "video"))
    else:
        request = pre([{"role": "user", "content": [*_media_parts(args), {"type": "text", "text": args.text}]}])
    summary = {
        "tokens": request.num_tokens,
        "visual_tokens": request.num_visual_tokens,
        "images": [
            {"file": path, "size": [h.width, h.height], "grid_thw": grid.tolist()}
            for path, h, grid in zip(args.image, request.headers, request.image_grid_thw, strict=True)
        ],
        "videos": [
            {"file": path, "grid_thw": grid.tolist(), "timestamps": list(seconds)}
            for path, grid, seconds in zip(args.video, request.video_grid_thw, request.video_timestamps, strict=True)
        ],
        "pixel_values": list(request.pixel_values.shape),
        "mrope_position_delta": request.mrope_position_delta,
        "prompt_table_rows": request.num_visual_tokens * (request.deepstack_count + 1),
        "input_ids": request.input_ids.tolist() if args.ids else f"{request.num_tokens} ids (--ids prints them)",
    }
    print(json.dumps(summary, indent=2))


_Subparsers = argparse._SubParsersAction  # add_subparsers' result: each command adds its parser to it


def _add_make_tiny_parser(sub: _Subparsers) -> None:
    s = sub.add_parser("make-tiny", help="write a random-weight Qwen3-VL checkpoint (tests, demos, benchmarks)")
    s.add_argument("--output", required=True, help="checkpoint directory to create")
    s.add_argument("--moe", action="store_true", help="Qwen3-VL-MoE text model (a few experts)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--preset",
        default="tiny",
        choices=["tiny", "2b-vision", "8b-vision"],
        help="tiny (default), or a real released vision tower shape with a tiny LLM",
    )
    s.add_argument(
        "--template",
        default="instruct",
        choices=RELEASED_TEMPLATES,
        help="the released chat template it carries: the Instruct (default) or the Thinking checkpoints'",
    )
    s.add_argument("--force", action="store_true", help="replace an existing output directory")
    s.set_defaults(func=_make_tiny)


def _add_inspect_parser(sub: _Subparsers) -> None:
    s = sub.add_parser("inspect", help="check a checkpoint's config and shards and print what it is")
    s.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    s.set_defaults(func=_inspect)


def _add_export_vision_parser(sub: _Subparsers) -> None:
    s = sub.add_parser("export-vision", help="export the vision encoder (ViT, merger, DeepStack) to ONNX")
    s.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    s.add_argument("--output", required=True, help="directory to create for the ONNX and its sidecar")
    s.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    s.add_argument("--verify", action="store_true", help="compare with transformers on random images (fp32)")
    s.add_argument(
        "--variant",
        default="portable",
        choices=["portable", "plugin"],
        help="portable: standard ONNX ops (ONNX Runtime, TensorRT); plugin: varlen attention plugin nodes (TensorRT)",
    )
    s.add_argument("--force", action="store_true", help="replace an existing output directory")
    s.set_defaults(func=_export_vision)


def _add_build_vision_engine_parser(sub: _Subparsers) -> None:
    from .vision.engine import DEFAULT_OPTIMIZATION_LEVEL, VisionEngineProfile

    d = VisionEngineProfile()
    s = sub.add_parser("build-vision-engine", help="build the vision TensorRT engine of an export (GPU host)")
    s.add_argument("--onnx", required=True, help="directory written by export-vision (--variant plugin)")
    s.add_argument("--output", required=True, help="engine directory to create")
    s.add_argument("--min-patches", type=int, default=d.min_patches, help="fewest patches of one engine run")
    s.add_argument("--opt-patches", type=int, default=d.opt_patches, help="patches TensorRT tunes for (one image)")
    s.add_argument("--max-patches", type=int, default=d.max_patches, help="most patches of one run (all its images)")
    s.add_argument("--max-images", type=int, default=d.max_images, help="most images of a run (video: per frame pair)")
    s.add_argument("--dtype", choices=["fp16", "bf16"], help="require this export dtype (the ONNX sets the precision)")
    s.add_argument("--arch", help="GPU target of the plugin kernel, e.g. sm_90 (default: this GPU)")
    s.add_argument("--timing-cache", help="timing cache file to reuse and update (default: one in the output)")
    s.add_argument("--optimization-level", type=int, default=DEFAULT_OPTIMIZATION_LEVEL, help="TensorRT builder, 0-5")
    s.add_argument("--force", action="store_true", help="replace an existing output directory")
    s.set_defaults(func=_build_vision_engine)


def _add_preprocess_parser(sub: _Subparsers) -> None:
    s = sub.add_parser("preprocess", help="show what a request (text, images, videos) becomes for the engines")
    s.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    s.add_argument("--image", action="append", default=[], help="image file (repeat for several)")
    s.add_argument("--video", action="append", default=[], help="video file: MP4, WebM, MKV, MOV (repeat for several)")
    text = s.add_mutually_exclusive_group()
    text.add_argument("--text", default="Describe the image.", help="user message after the images (chat template)")
    text.add_argument(
        "--prompt",
        help="raw prompt instead, no chat template: <|vision_start|><|image_pad|><|vision_end|> per image and "
        "<|vision_start|><|video_pad|><|vision_end|> per video",
    )
    s.add_argument("--resize-backend", default="torchvision", choices=["torchvision", "pil"])
    s.add_argument("--device", default="cpu", help="cpu, or cuda (nvImageCodec decode into device memory)")
    s.add_argument("--ids", action="store_true", help="print the token ids")
    s.set_defaults(func=_preprocess)


def _gpu_arch(value: str) -> int:
    from .llm.precision import parse_gpu_arch

    try:
        return parse_gpu_arch(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_llm_quant(s: argparse.ArgumentParser) -> None:
    from .common.dtypes import KV_CACHE_DTYPE_CHOICES, LLM_QUANT_CHOICES

    s.add_argument(
        "--llm-quant",
        choices=LLM_QUANT_CHOICES,
        help="the language model's engine precision: none (its dtype; FP8 checkpoints dequantized), int8-wo / "
        "int4-wo (weight-only INT8 / INT4 per channel, TensorRT-LLM W8A16 / W4A16, sm80+), fp8 (FP8 weights and "
        "activations, per-tensor scales from a calibration pass, sm89+) (default: fp8 for an FP8 checkpoint built for "
        "an FP8-capable GPU, else none; docs/model.md)",
    )
    s.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPE_CHOICES,
        help="the KV cache's precision: auto (the engine dtype), fp8 or int8 (scales from the calibration pass) "
        "(default: %(default)s)",
    )
    s.add_argument(
        "--gpu-arch",
        type=_gpu_arch,
        help="the GPU the engines are for, as sm80, sm89, sm90, ... (default: the visible GPU's): chooses the default "
        "--llm-quant and refuses modes the GPU cannot run",
    )
    s.add_argument(
        "--calibration-data",
        help='JSON lines of {"text": ..., "image": optional path} to calibrate fp8 / quantized KV-cache scales on '
        "(default: a small built-in set of synthetic images and prompts)",
    )


def _add_artifact_options(s: argparse.ArgumentParser) -> None:
    """What `build` makes its artifacts from: the checkpoint and the options that change them (the build key's)."""
    s.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    s.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"], help="vision export dtype")
    s.add_argument(
        "--vision-engine-dtype", default="bf16", choices=["fp16", "bf16"], help="vision TensorRT engine (GPU hosts)"
    )
    s.add_argument("--llm-dtype", choices=["bf16", "fp16", "fp32"], help="LLM checkpoint dtype (default: the model's)")
    _add_llm_quant(s)
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the LLM")
    s.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages of the LLM")
    _add_limits(s)


def _add_cache_options(s: argparse.ArgumentParser) -> None:
    from .build_cache.store import DEFAULT_LEASE_S, DEFAULT_WAIT_S

    g = s.add_argument_group("build cache (docs/build-cache.md)")
    g.add_argument(
        "--cache",
        type=pathlib.Path,
        help="shared build cache directory (POSIX storage every replica mounts: NFS, EFS, Filestore, CephFS): "
        "artifacts built once per build key, pulled by every later build",
    )
    g.add_argument(
        "--checkpoint-id",
        help="a revision you vouch for (e.g. the hub commit) in place of the checkpoint's digest (no hashing)",
    )
    g.add_argument(
        "--cache-pull",
        choices=["link", "copy"],
        default="link",
        help="use a cache entry where it lies, read-only (link) or copy it into the build (default: %(default)s)",
    )
    g.add_argument(
        "--verify",
        action="store_true",
        help="hash every file of a cache entry at the pull (default: sizes, and the hashes of files up to 64 MiB)",
    )
    g.add_argument(
        "--cache-lease-s",
        type=_positive_float,
        default=DEFAULT_LEASE_S,
        help="a builder whose lease heartbeat is still this long is taken for dead (default: %(default)g)",
    )
    g.add_argument(
        "--cache-wait-s",
        type=_positive_float,
        default=DEFAULT_WAIT_S,
        help="longest wait for another builder of the same key (default: %(default)g)",
    )


def _add_build_parser(sub: _Subparsers) -> None:
    s = sub.add_parser("build", help="run every stage this machine can run; write a manifest")
    _add_artifact_options(s)
    s.add_argument("--output", required=True, help="build directory to create")
    _add_repository_options(s)
    _add_cache_options(s)
    s.add_argument("--force", action="store_true", help="replace an existing build directory")
    s.set_defaults(func=_build)


def _add_build_key_parser(sub: _Subparsers) -> None:
    s = sub.add_parser("build-key", help="print the build key of a checkpoint and build options, and its parts")
    _add_artifact_options(s)
    s.add_argument("--cache", type=pathlib.Path, help="remember the checkpoint's file hashes in this build cache")
    s.add_argument("--checkpoint-id", help="a revision you vouch for in place of the checkpoint's digest")
    s.add_argument("--json", action="store_true", help="print {key, parts} as JSON")
    s.set_defaults(func=_build_key)


def _add_cache_parser(sub: _Subparsers) -> None:
    s = sub.add_parser("cache", help="list or prune the entries of a build cache")
    actions = s.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="every entry: key, size, last pull, model and GPU")
    listing.add_argument("--cache", type=pathlib.Path, required=True, help="build cache directory")
    listing.add_argument("--json", action="store_true", help="print the entries as JSON")
    prune = actions.add_parser(
        "prune", help="remove entries not pulled for a while, or the least recently pulled beyond a size"
    )
    prune.add_argument("--cache", type=pathlib.Path, required=True, help="build cache directory")
    prune.add_argument("--older-than-days", type=_positive_float, help="entries not pulled for this many days")
    prune.add_argument("--max-gib", type=_positive_float, help="then the least recently pulled until the rest fit")
    prune.add_argument("--dry-run", action="store_true", help="say what would be removed")
    s.set_defaults(func=_cache)


def _add_write_repo_parser(sub: _Subparsers) -> None:
    s = sub.add_parser("write-repo", help="write the Triton model repository for a build directory")
    s.add_argument("--build-dir", required=True, help="directory written by `qwen3vl-trt build`")
    s.add_argument("--output", required=True, help="repository directory to create")
    s.add_argument("--model", help="checkpoint with the tokenizer and processor files (default: the build's)")
    _add_repository_options(s)
    s.add_argument("--force", action="store_true", help="replace an existing repository")
    s.set_defaults(func=_write_repo)


def _add_serve_parser(sub: _Subparsers) -> None:
    s = sub.add_parser("serve", help="run tritonserver on a repository written by build or write-repo")
    add_serve_arguments(s)
    s.set_defaults(func=_serve)


def _add_openai_parser(sub: _Subparsers) -> None:
    s = sub.add_parser("openai", help="serve the OpenAI-compatible API in front of a running deployment")
    s.add_argument(
        "--triton-url",
        type=_triton_url,
        default=LOCAL_TRITON_URL,
        help="the deployment's tritonserver gRPC address; or several replicas: a name that resolves to each (a "
        "Kubernetes headless Service), HOST:PORT,HOST:PORT,..., or dns://[DNS_SERVER:PORT]/NAME:PORT; requests are "
        "balanced round robin over the ready replicas",
    )
    s.add_argument(
        "--triton-refresh",
        type=_positive_float,
        default=DEFAULT_GATEWAY_OPTIONS.triton_refresh_s,
        help="seconds between resolutions of the names in --triton-url (default: %(default)g)",
    )
    s.add_argument("--repo", type=pathlib.Path, help="the deployment's model repository (default: ask the server)")
    s.add_argument(
        "--wait-ready",
        type=float,
        default=0.0,
        help="without --repo: seconds to wait for a replica to answer at start (default: 0, fail at once)",
    )
    s.add_argument("--port", type=_port, default=DEFAULT_OPENAI_PORT)
    s.add_argument("--address", default="127.0.0.1", help="address to bind (0.0.0.0: all interfaces); default loopback")

    def ready_port(text: str) -> int:
        return 0 if text.strip() == "0" else _port(text)

    s.add_argument(
        "--replica-ready-port",
        type=ready_port,
        default=ServerPorts().ready,
        help="where each replica's `serve` answers GET /ready, on the address --triton-url resolves to (ready once "
        f"warmed up; default: {ServerPorts().ready}); 0 asks tritonserver's gRPC readiness instead, for replicas that "
        "are plain tritonservers",
    )
    _add_gateway_arguments(s)
    s.set_defaults(func=_openai)


def _add_batch_parser(sub: _Subparsers) -> None:
    s = sub.add_parser("batch", help="submit a JSONL file of requests to a gateway's Batch API, watch it, fetch it")
    actions = s.add_subparsers(dest="action", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url", default=f"http://127.0.0.1:{DEFAULT_OPENAI_PORT}", help="the gateway (http://HOST:PORT)"
    )
    common.add_argument("--api-key-file", type=pathlib.Path, metavar="PATH",
                        help="a file whose first line is the API key (else $OPENAI_API_KEY, if set)")  # fmt: skip
    submit = actions.add_parser("submit", parents=[common], help="upload the file and start a batch of it")
    submit.add_argument("requests", type=pathlib.Path, help="JSONL: {custom_id, method, url, body} a line")
    endpoints = ("/v1/chat/completions", "/v1/completions")
    submit.add_argument("--endpoint", default=endpoints[0], choices=endpoints)
    submit.add_argument("--window", default="24h", help="the completion window (24h, or shorter: 30m, 2h)")
    submit.add_argument("--wait", action="store_true", help="watch it to the end, then fetch its files")
    submit.add_argument("--output", type=pathlib.Path, help="with --wait: where the output file goes")
    watch = actions.add_parser("watch", parents=[common], help="show a batch's progress until it ends")
    watch.add_argument("batch_id")
    fetch = actions.add_parser("fetch", parents=[common], help="write an ended batch's output and error files")
    fetch.add_argument("batch_id")
    fetch.add_argument("--output", type=pathlib.Path, required=True, help="the output file (errors beside it)")
    cancel = actions.add_parser("cancel", parents=[common], help="cancel a batch")
    cancel.add_argument("batch_id")
    s.set_defaults(func=_batch)


def _batch(args: argparse.Namespace) -> int:
    import os

    from tqdm import tqdm

    from .serving.batch_client import BatchClient

    key = os.environ.get("OPENAI_API_KEY")
    if args.api_key_file is not None:
        lines = args.api_key_file.read_text().split()
        key = lines[0] if lines else None
    client = BatchClient(args.url, key)
    if args.action == "cancel":
        print(json.dumps(client.cancel(args.batch_id), indent=2))
        return 0
    if args.action == "submit":
        batch = client.submit(args.requests, args.endpoint, args.window)
        print(f"batch {batch['id']}: {batch['request_counts']['total']} requests, {batch['status']}", flush=True)
        if not args.wait:
            return 0
        batch_id = batch["id"]
    else:
        batch_id = args.batch_id
    if args.action == "fetch":
        batch = client.batch(batch_id)
    else:
        with tqdm(unit="request", desc=batch_id, dynamic_ncols=True) as bar:

            def progress(batch: dict) -> None:
                counts = batch["request_counts"]
                bar.total = counts["total"]
                bar.n = counts["completed"] + counts["failed"]
                bar.set_postfix(status=batch["status"], failed=counts["failed"], refresh=False)
                bar.refresh()

            batch = client.wait(batch_id, progress)
        counts = batch["request_counts"]
        print(f"batch {batch_id}: {batch['status']}, {counts['completed']} completed, {counts['failed']} failed of "
              f"{counts['total']}")  # fmt: skip
        if args.action == "watch" or args.output is None:
            return 0 if batch["status"] == "completed" else 1
    for path in client.fetch(batch, args.output):
        print(f"wrote {path}")
    return 0 if batch["status"] == "completed" else 1


def _add_infer_parser(sub: _Subparsers) -> None:
    from .serving.client import RESPONSE_TIMEOUT_S

    s = sub.add_parser("infer", help="send one request to a running deployment over gRPC")
    s.add_argument("--url", default=LOCAL_TRITON_URL, help="tritonserver gRPC address")
    s.add_argument("--image", action="append", default=[], help="image file (repeat for several)")
    s.add_argument("--video", action="append", default=[], help="video file: MP4, WebM, MKV, MOV (repeat for several)")
    s.add_argument("--prompt", required=True, help="the user's message (after the images and videos)")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--stream", action="store_true", help="print the text as it is generated")
    s.add_argument("--temperature", type=float, help="default greedy")
    s.add_argument("--top-k", type=int)
    s.add_argument("--top-p", type=float)
    s.add_argument("--seed", type=int)
    s.add_argument("--timeout", type=float, default=RESPONSE_TIMEOUT_S, help="seconds to wait for each response")
    s.add_argument("--json", action="store_true", help='print one JSON object {"text", "token_ids"}')
    s.set_defaults(func=_infer)


def _add_generate_parser(sub: _Subparsers) -> None:
    s = sub.add_parser("generate", help="answer one chat request on the CPU (ONNX Runtime + reference LLM)")
    s.add_argument("--model", required=True, help="Hugging Face checkpoint directory (tokenizer, processor)")
    s.add_argument("--build", required=True, help="directory written by `qwen3vl-trt build`")
    s.add_argument("--image", action="append", default=[], help="image file (repeat for several)")
    s.add_argument("--video", action="append", default=[], help="video file: MP4, WebM, MKV, MOV (repeat for several)")
    s.add_argument("--text", default="Describe the image.", help="user message after the images and videos")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    s.add_argument("--top-k", type=int, default=0, help="0: no limit")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true", help='print one JSON object {"text", "token_ids"} at the end')
    s.set_defaults(func=_generate)


def _add_convert_llm_parser(sub: _Subparsers) -> None:
    s = sub.add_parser("convert-llm", help="convert the language model to a TensorRT-LLM 1.2.1 checkpoint")
    s.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    s.add_argument("--output", required=True, help="checkpoint directory to create")
    s.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="weights dtype (default: the model's)")
    _add_llm_quant(s)
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    s.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    s.add_argument("--force", action="store_true", help="replace an existing output directory")
    s.set_defaults(func=_convert_llm)


def _add_build_llm_engine_parser(sub: _Subparsers) -> None:
    s = sub.add_parser("build-llm-engine", help="build the LLM engine with trtllm-build (GPU host)")
    s.add_argument("--checkpoint", required=True, help="directory written by convert-llm")
    s.add_argument("--output", required=True, help="engine directory to create")
    _add_limits(s)
    s.add_argument("--print-command", action="store_true", help="print the build command instead of running it")
    s.add_argument("--force", action="store_true", help="replace an existing output directory")
    s.set_defaults(func=_build_llm_engine)


def _add_gpu_acceptance_parser(sub: _Subparsers) -> None:
    s = sub.add_parser(
        "gpu-acceptance",
        help="what a GPU host runs first: build every stage from tiny checkpoints, serve, check the numbers",
        description="Builds tiny dense and MoE checkpoints through every stage (plugin vision engine, trtllm-build, "
        "GPU repository), serves them and checks kernel, decoding, vision engine and served tokens; prints one "
        "table, writes acceptance.json. Exit 0: every row passed; 1: a row failed; 3: none failed, some skipped "
        "(the GPU stack is incomplete). Nothing is downloaded.",
    )
    s.add_argument("--output", default="acceptance", help="directory for acceptance.json (default: ./acceptance)")
    s.add_argument("--work", help="keeps checkpoints, builds and server logs here (default: a temporary directory)")
    s.set_defaults(func=_gpu_acceptance)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qwen3vl-trt", description="Compile Qwen3-VL for TensorRT and Triton.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for add_command in (
        _add_make_tiny_parser,
        _add_inspect_parser,
        _add_export_vision_parser,
        _add_build_vision_engine_parser,
        _add_preprocess_parser,
        _add_build_parser,
        _add_build_key_parser,
        _add_cache_parser,
        _add_write_repo_parser,
        _add_serve_parser,
        _add_openai_parser,
        _add_batch_parser,
        _add_infer_parser,
        _add_generate_parser,
        _add_convert_llm_parser,
        _add_build_llm_engine_parser,
        _add_gpu_acceptance_parser,
    ):
        add_command(sub)
    return p


def _gpu_acceptance(args: argparse.Namespace) -> int:
    import tempfile

    from .qa.acceptance import run_acceptance, write_report

    with tempfile.TemporaryDirectory(prefix="qwen3vl-trt-acceptance-") as scratch:
        report = run_acceptance(pathlib.Path(args.work or scratch))
    print(report.table())
    path = write_report(report, pathlib.Path(args.output))
    print(f"\n{path}: exit code {report.exit_code} (0 passed, 1 a row failed, 3 some rows skipped)")
    return report.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        status = args.func(args)
    except Qwen3VLTrtError as e:
        print(f"qwen3vl-trt {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"qwen3vl-trt {args.command}: interrupted; no output was published", file=sys.stderr)
        return 130
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
