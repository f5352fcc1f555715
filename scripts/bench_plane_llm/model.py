"""Benchmark-only Triton python model standing in for `llm` (scripts/bench_plane.py copies it into its
own copies of a repository; no repository users build holds it). It decodes at a GPU's pace without
computing anything: every `bench_step_ms` (a parameter of its config.pbtxt) one decode step gives each
request it holds its next token, as an inflight-batching engine does; a request joins at the next step.
It answers in the llm's decoupled protocol (streaming: one response per token, then an empty final
one; else one final response with every token), so what the plane around it costs per token and per
request is what a GPU's decode loop would let it cost. The same model alone in a repository is the
benchmark's floor: tokens at the same pace straight to a gRPC client."""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.stages.triton_adapters import response

FIRST_TOKEN = 1000  # ordinary text ids, so the text decodes to real words
STEP_MS = "bench_step_ms"


def _scalar(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)[0]


def _tokens(ids):
    return response(
        {
            interface.LLM_OUTPUT_IDS.name: np.array([ids], dtype=np.int32),
            interface.SEQUENCE_LENGTH.name: np.array([len(ids)], dtype=np.int32),
        }
    )


class _Held:
    def __init__(self, sender, count, streaming):
        self.sender, self.count, self.streaming = sender, count, streaming
        self.ids = []


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        self.step_s = float(parameters[STEP_MS]["string_value"]) / 1000
        self.held = []
        self.cond = threading.Condition()
        self.closing = False
        self.loop = threading.Thread(target=self._decode, name="bench-decode", daemon=True)
        self.loop.start()

    def execute(self, requests):
        with self.cond:
            for request in requests:
                sender = request.get_response_sender()
                if _scalar(request, interface.STOP.name):  # a client's stop: nothing of ours is that long
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    continue
                count = int(_scalar(request, interface.REQUEST_OUTPUT_LEN.name))
                self.held.append(_Held(sender, count, bool(_scalar(request, interface.STREAMING.name))))
            self.cond.notify()
        return None

    def _decode(self):
        next_step = time.monotonic()
        while True:
            with self.cond:
                while not self.held and not self.closing:
                    self.cond.wait()
                    next_step = time.monotonic() + self.step_s  # a request that arrives idle waits one step
                if self.closing:
                    return
                batch = list(self.held)
            time.sleep(max(0.0, next_step - time.monotonic()))
            next_step += self.step_s
            finished = []
            for held in batch:
                token = FIRST_TOKEN + len(held.ids)
                held.ids.append(token)
                done = len(held.ids) >= held.count
                if held.streaming:
                    held.sender.send(_tokens([token]))
                    if done:
                        held.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                elif done:
                    held.sender.send(_tokens(held.ids), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                if done:
                    finished.append(held)
            if finished:
                with self.cond:
                    self.held = [h for h in self.held if h not in finished]

    def finalize(self):
        with self.cond:
            self.closing = True
            self.cond.notify()
        self.loop.join(timeout=5)
