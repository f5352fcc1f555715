#!/usr/bin/env python3
"""AIPerf against the OpenAI-compatible gateway: time to first token, inter-token latency and
throughput of streamed chat completions with images.

Without --url (the default) it makes a tiny checkpoint (or takes --model), builds it for the CPU
target, and runs `qwen3vl-trt serve --openai-port` on it; with --url it measures that running
gateway (--model then names the served checkpoint, for AIPerf's tokenizer). AIPerf (NVIDIA's
benchmarking CLI) runs from its own environment, .venv-aiperf, made on first use: it needs numpy 2,
which the bundled tritonserver's python stub cannot load. At each concurrency level AIPerf sends
--requests synthetic chat requests, each a --image-size JPEG and a --input-tokens prompt, asking for
--output-tokens tokens (min_tokens holds the tiny model's random output to that length), streamed.
AIPerf's own table is printed per level, then one summary table.

With --guided it measures what guided decoding costs instead: at each concurrency level (default 1 and 16) the
official openai client sends --requests text requests twice, plain (--output-tokens tokens, held to that length by
min_tokens) and with a JSON schema (GUIDED_SCHEMA: a fixed-size array of bounded integers, about as many tokens),
and the table gives completion tokens per second of each, their ratio, and the grammar's time per token.

    .venv/bin/python scripts/bench_openai.py [--url http://HOST:PORT --model DIR] [--concurrency 1 4 16]
        [--requests 48] [--input-tokens 64] [--output-tokens 32] [--image-size 256x256] [--json]
    .venv/bin/python scripts/bench_openai.py --guided [--concurrency 1 16] [--requests 48] [--json]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from qwen3vl_trt.qa.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
AIPERF_VERSION = "0.13.0"
METRICS = (  # (AIPerf's key, its statistic, the column)
    ("request_throughput", "avg", "req/s"),
    ("output_token_throughput", "avg", "out tok/s"),
    ("time_to_first_token", "p50", "TTFT p50 ms"),
    ("time_to_first_token", "p99", "TTFT p99 ms"),
    ("inter_token_latency", "p50", "ITL p50 ms"),
    ("inter_token_latency", "p99", "ITL p99 ms"),
    ("request_latency", "p50", "latency p50 ms"),
)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def aiperf_binary(venv: Path) -> Path:
    binary = venv / "bin" / "aiperf"
    if not binary.exists():
        _log(f"installing aiperf=={AIPERF_VERSION} into {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, f"aiperf=={AIPERF_VERSION}"], check=True)
    return binary


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class OwnGateway:
    """A tiny (or given) checkpoint built for the CPU target and served with --openai-port."""

    def __init__(self, model_dir: Path | None, scratch: Path):
        from qwen3vl_trt.pipeline.build import BuildOptions, build
        from qwen3vl_trt.qa.tiny import make_tiny_checkpoint

        self.model_dir = model_dir or make_tiny_checkpoint(scratch / "checkpoint")
        _log(f"building {self.model_dir} for the CPU target")
        build(self.model_dir, scratch / "build", BuildOptions(llm_dtype="fp32"), target="cpu", log=lambda *_: None)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        ports = [str(free_port()) for _ in range(4)]
        command = [sys.executable, "-m", "qwen3vl_trt.cli", "serve", "--repo", str(scratch / "build" / "triton_repo")]
        command += ["--grpc-port", ports[0], "--http-port", ports[1], "--metrics-port", ports[2]]
        command += ["--ready-port", ports[3]]
        command += ["--openai-port", str(port)]
        self.log = scratch / "serve.log"
        self.process = subprocess.Popen(command, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while not _healthy(self.url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the deployment did not start; its output:\n{self.log.read_text()[-3000:]}")
            time.sleep(1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            self.process.wait(120)


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]


def profile(aiperf: Path, url: str, model_dir: Path, concurrency: int, artifacts: Path, args) -> dict:
    width, height = args.image_size
    command = [str(aiperf), "profile", "--model", served_model(url), "--url", url, "--endpoint-type", "chat"]
    command += ["--streaming", "--tokenizer", str(model_dir), "--concurrency", str(concurrency)]
    command += ["--request-count", str(args.requests), "--warmup-request-count", str(concurrency)]
    command += ["--prompt-input-tokens-mean", str(args.input_tokens), "--prompt-input-tokens-stddev", "0"]
    command += ["--prompt-output-tokens-mean", str(args.output_tokens), "--prompt-output-tokens-stddev", "0"]
    command += ["--extra-inputs", f"min_tokens:{args.output_tokens}"]
    command += ["--image-width-mean", str(width), "--image-height-mean", str(height), "--image-batch-size", "1"]
    command += ["--image-format", "jpeg", "--random-seed", "0", "--ui", "none", "--output-artifact-dir", str(artifacts)]
    # Token counts from the gateway's usage (the prompt as the server runs it, tested against transformers'
    # processor), so AIPerf does not tokenize every response on the cores the deployment runs on.
    command += ["--use-server-token-count", "--no-server-metrics", "--no-gpu-telemetry"]
    _log(f"aiperf at concurrency {concurrency}: {args.requests} requests")
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"aiperf failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    if not args.json:  # AIPerf's own tables, without its log lines
        tables = run.stdout[run.stdout.find("NVIDIA AIPerf") :].splitlines()
        print(f"concurrency {concurrency}:")
        print("\n".join(line for line in tables if " INFO " not in line and " NOTICE " not in line))
    result = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    if result.get("error_summary"):
        raise SystemExit(f"aiperf saw failed requests at concurrency {concurrency}: {result['error_summary']}")
    return result


# An answer of 12 integers of one digit: about 3 tokens each, so about as long as the plain answers.
GUIDED_SCHEMA = {
    "type": "object",
    "properties": {
        "values": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 12,
            "maxItems": 12,
        }
    },
    "required": ["values"],
    "additionalProperties": False,
}


def guided_cost(url: str, concurrency: int, args) -> dict:
    """Completion tokens per second of plain and of JSON-schema requests at one concurrency level."""
    import asyncio

    import openai

    model = served_model(url)
    messages = [{"role": "user", "content": "Give me numbers. " * max(1, args.input_tokens // 4)}]
    schema = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": GUIDED_SCHEMA, "strict": True}}
    kinds = {
        "plain": dict(max_tokens=args.output_tokens, extra_body={"min_tokens": args.output_tokens}),
        "json_schema": dict(max_tokens=4 * args.output_tokens, response_format=schema),
    }

    async def level(kind: str) -> tuple[float, int]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
            slots = asyncio.Semaphore(concurrency)

            async def one(k: int) -> int:
                async with slots:
                    answer = await client.chat.completions.create(model=model, messages=messages, seed=k,
                                                                  temperature=1.0, **kinds[kind])  # fmt: skip
                if kind == "json_schema":
                    assert answer.choices[0].finish_reason == "stop", answer
                    json.loads(answer.choices[0].message.content)
                return answer.usage.completion_tokens

            await asyncio.gather(*(one(k) for k in range(concurrency)))  # warm-up
            start = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(k) for k in range(args.requests))))
            return time.perf_counter() - start, tokens

    row = {}
    for kind in kinds:
        _log(f"{kind} at concurrency {concurrency}: {args.requests} requests")
        seconds, tokens = asyncio.run(level(kind))
        row[f"{kind} tok/s"] = tokens / seconds
        row[f"{kind} ms/tok"] = 1000 * seconds / tokens
    row["ratio"] = row["json_schema tok/s"] / row["plain tok/s"]
    row["grammar ms/tok"] = row["json_schema ms/tok"] - row["plain ms/tok"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running gateway, http://HOST:PORT (default: build and serve here)")
    p.add_argument("--model", type=Path, help="checkpoint (default: a tiny random one); with --url, the served one")
    p.add_argument("--concurrency", type=int, nargs="+", help="levels (default 1 4 16; --guided: 1 16)")
    p.add_argument("--requests", type=int, default=48, help="requests per concurrency level")
    p.add_argument("--input-tokens", type=int, default=64, help="text tokens per prompt (the image adds its own)")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--image-size", type=lambda s: tuple(int(v) for v in s.split("x")), default=(256, 256))
    p.add_argument("--aiperf-venv", type=Path, default=ROOT / ".venv-aiperf")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.add_argument("--guided", action="store_true", help="measure guided decoding's cost (JSON schema vs plain)")
    args = p.parse_args()
    args.concurrency = args.concurrency or ([1, 16] if args.guided else [1, 4, 16])
    if args.guided:
        guided_main(args)
        return
    if args.url and not args.model:
        p.error("--url needs --model: the served checkpoint's tokenizer, for AIPerf's token counts")
    aiperf = aiperf_binary(args.aiperf_venv)
    with tempfile.TemporaryDirectory(prefix="bench-openai-") as tmp:
        scratch = Path(tmp)
        own = None if args.url else OwnGateway(args.model, scratch)
        url = args.url or own.url
        model_dir = args.model or own.model_dir
        try:
            results = {c: profile(aiperf, url, model_dir, c, scratch / f"aiperf-c{c}", args) for c in args.concurrency}
        finally:
            if own is not None:
                own.stop()
    summary = {c: {column: r[key][stat] for key, stat, column in METRICS} for c, r in results.items()}
    if args.json:
        print(json.dumps({"url": url, "summary": summary}, indent=2))
        return
    width, height = args.image_size
    print(
        f"AIPerf {AIPERF_VERSION}, streamed chat completions with one {width}x{height} JPEG, "
        f"{args.input_tokens} prompt tokens, {args.output_tokens} output tokens, {args.requests} requests a level"
    )
    print(" | ".join(["concurrency", *(column for _, _, column in METRICS)]))
    for c, row in summary.items():
        print(" | ".join([str(c), *(f"{v:.1f}" for v in row.values())]))


def guided_main(args) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-openai-") as tmp:
        own = None if args.url else OwnGateway(args.model, Path(tmp))
        url = args.url or own.url
        try:
            rows = {c: guided_cost(url, c, args) for c in args.concurrency}
        finally:
            if own is not None:
                own.stop()
    if args.json:
        print(json.dumps({"url": url, "guided": rows}, indent=2))
        return
    print(f"guided decoding's cost: {args.requests} text requests a level, plain ({args.output_tokens} tokens) vs a "
          "JSON schema (12 bounded integers), completion tokens per second")  # fmt: skip
    columns = list(next(iter(rows.values())))
    print(" | ".join(["concurrency", *columns]))
    for c, row in rows.items():
        print(" | ".join([str(c), *(f"{row[k]:.2f}" for k in columns)]))


if __name__ == "__main__":
    main()
