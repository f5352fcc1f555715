"""The deployments the server tests run: the CPU target of a tiny checkpoint (small limits keep the
too-long-prompt cases cheap; the serving settings are the defaults: requests arriving together still meet in
one batch, as they queue while the model executes the first), and a `qwen3vl` ensemble over one python model
that echoes the text (the launcher's end of a real repository, loaded in seconds); and the OpenAI gateway's
process (Gateway) with the request and error helpers its tests share."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import psutil
import pytest
from qwen3vl_trt.common.limits import EngineLimits
from qwen3vl_trt.pipeline.build import BuildOptions, build
from qwen3vl_trt.serving.interface import ENSEMBLE, TEXT_OUTPUT
from qwen3vl_trt.serving.parameters import EnsembleParameters
from qwen3vl_trt.serving.ports import ServerPorts
from qwen3vl_trt.serving.repository import model_config as serving_config
from qwen3vl_trt.serving.repository.settings import RepositorySettings
from qwen3vl_trt.serving.request import TEXT_INPUT
from tritonclient.grpc import model_config_pb2 as mc

LIMITS = EngineLimits(
    max_batch_size=8,
    max_input_len=1024,
    max_seq_len=2048,
    max_num_tokens=2048,
    max_visual_tokens=1024,
    max_top_logprobs=5,
)
# Without the visual cache: these deployments' tests see every image decoded and encoded (test_visual_cache has
# deployments with it).
SETTINGS = RepositorySettings(visual_cache="off")


def _quiet(*_args, **_kwargs) -> None:
    pass


def build_cpu_repository(model_dir: Path, root: Path, settings: RepositorySettings = SETTINGS) -> Path:
    """`qwen3vl-trt build --target cpu` of the checkpoint under root; the Triton model repository's path."""
    build(
        model_dir,
        root / "build",
        BuildOptions(llm_dtype="fp32", limits=LIMITS),
        target="cpu",
        settings=settings,
        log=_quiet,
    )
    return root / "build" / "triton_repo"


ECHO_MODEL = textwrap.dedent(
    f"""
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            texts = [pb_utils.get_input_tensor_by_name(r, "{TEXT_INPUT.name}").as_numpy() for r in requests]
            return [pb_utils.InferenceResponse([pb_utils.Tensor("{TEXT_OUTPUT.name}", t)]) for t in texts]
    """
)


def echo_repository(root: Path) -> Path:
    """A `qwen3vl` ensemble over a python model that echoes the text: the launcher's end of a real repository."""
    io = dict(input=[serving_config.model_input(TEXT_INPUT)], output=[serving_config.model_output(TEXT_OUTPUT)])
    echo = mc.ModelConfig(name="echo", backend="python", max_batch_size=0, **io)
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    serving_config.write(root / "echo", echo)
    step = mc.ModelEnsembling.Step(
        model_name="echo",
        model_version=-1,
        input_map={TEXT_INPUT.name: TEXT_INPUT.name},
        output_map={TEXT_OUTPUT.name: TEXT_OUTPUT.name},
    )
    ensemble = mc.ModelConfig(name=ENSEMBLE, platform="ensemble", max_batch_size=0, **io)
    ensemble.ensemble_scheduling.step.append(step)
    EnsembleParameters().apply(ensemble)
    (root / ENSEMBLE / "1").mkdir(parents=True)
    serving_config.write(root / ENSEMBLE, ensemble)
    return root


def port_flags(ports: ServerPorts) -> list[str]:
    """`serve`'s flags for every port of `ports` (tritonserver's three and its readiness endpoint's)."""
    flags = ["--grpc-port", ports.grpc, "--http-port", ports.http, "--metrics-port", ports.metrics]
    return [str(flag) for flag in [*flags, "--ready-port", ports.ready]]


SERVE_SCRIPT = (
    "import argparse, sys\n"
    "from qwen3vl_trt.cli import add_serve_arguments, serve_options\n"
    "from qwen3vl_trt.serving.server.serve import serve\n"
    "parser = argparse.ArgumentParser()\n"
    "add_serve_arguments(parser)\n"
    "sys.exit(serve(serve_options(parser.parse_args())))\n"
)


def group_alive(pgid: int) -> list[psutil.Process]:
    """The processes of group `pgid` still running (killed orphans stay zombies until init reaps them)."""
    alive = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return alive


def group_gone(pgid: int, within: float = 5.0) -> bool:
    """Whether the process group's processes all end within `within` seconds."""
    deadline = time.monotonic() + within
    while group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def process_stacks(pid: int) -> str:
    """The process and its descendants (serve, tritonserver, the python stubs) with their threads' stacks, Python
    and native (py-spy dump; tritonserver, not a Python process, by its name alone): what a stuck start leaves for
    its failure message."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return f"process {pid} is gone"
    parts = []
    for process in processes:
        try:
            argv = " ".join(process.cmdline())[:160]
        except psutil.Error:
            continue
        dump = subprocess.run(
            ["py-spy", "dump", "--native", "--pid", str(process.pid)], capture_output=True, text=True, timeout=60
        )
        parts.append(f"===== {process.pid} {argv}\n{dump.stdout}{dump.stderr}")
    return "\n".join(parts)


def repository_processes(repo: Path) -> list[psutil.Process]:
    """The running tritonservers and python stubs that serve `repo` (its path is on their command lines)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            argv = process.cmdline()
        except psutil.Error:
            continue
        if argv and Path(argv[0]).name in ("tritonserver", "triton_python_backend_stub"):
            if any(str(repo) in arg for arg in argv):
                found.append(process)
    return found


def cli(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qwen3vl_trt.cli", *args], **kwargs)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


class Gateway:
    """A command's process serving the OpenAI API, with its output in a log file."""

    def __init__(self, args: list[str], port: int, log: Path, ready_status: int = 200, timeout_s: float = 300):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.process = cli(*args, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while http_status(f"{self.url}/health") != ready_status:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{' '.join(args[:1])} did not come up; its output:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()


class TransformersGreedy:
    """transformers' greedy tokens for a checkpoint's requests, as the CPU deployment answers them (fp32, end ids
    dropped as the server drops them); the model loads at the first request."""

    def __init__(self, model_dir: Path, end_ids: tuple[int, ...]):
        self.model_dir, self.end_ids = model_dir, end_ids
        self.model = self.pre = None

    def inputs(self, prompt: str, images=(), videos=()) -> dict:
        import torch
        from qwen3vl_trt.hf.reference import hf_request_inputs
        from qwen3vl_trt.preprocess import Preprocessor
        from transformers import AutoModelForImageTextToText

        if self.model is None:
            self.model = AutoModelForImageTextToText.from_pretrained(self.model_dir, dtype=torch.float32).eval()
            self.pre = Preprocessor.from_pretrained(self.model_dir)
        parts = [{"type": "image", "image": image} for image in images]
        parts += [{"type": "video", "video": video} for video in videos] + [{"type": "text", "text": prompt}]
        request = self.pre([{"role": "user", "content": parts}])
        return hf_request_inputs(self.model, request, self.pre.info.image_token_id, self.pre.info.video_token_id)

    def tokens(self, prompt: str, images=(), max_tokens: int = 16, videos=()) -> list[int]:
        import torch

        inputs = self.inputs(prompt, images, videos)
        with torch.no_grad():
            out = self.model.generate(
                **inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=list(self.end_ids)
            )
        return [t for t in out[0, inputs["input_ids"].shape[1] :].tolist() if t not in self.end_ids]


def data_url(image: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(image).decode()


def user(text: str, *images: bytes, videos: tuple[bytes, ...] = ()) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    parts += [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(v).decode()}}
        for v in videos
    ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def error_body(error: openai.APIStatusError) -> dict:
    """The error object of an OpenAI error response (the client hands over the body or its "error")."""
    body = error.body
    assert isinstance(body, dict), body
    return body.get("error", body)
