"""Benchmark-only Triton python model standing in for `llm` (scripts/bench_plane.py copies it into its
own copy of a repository; no repository users build holds it). It answers every request at once with
request_output_len token ids in the llm's decoupled protocol (streaming: one response per token, then
an empty final one; else one final response), so what limits a deployment with it is the plane around
the LLM: preprocessing, the vision encoder, postprocessing and the server."""

import numpy as np
import triton_python_backend_utils as pb_utils
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.stages.triton_adapters import response

FIRST_TOKEN = 1000  # ordinary text ids, so postprocessing decodes real text


def _scalar(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0]


def _tokens(ids):
    return response(
        {
            interface.LLM_OUTPUT_IDS.name: np.array([ids], dtype=np.int32),
            interface.SEQUENCE_LENGTH.name: np.array([len(ids)], dtype=np.int32),
        }
    )


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            count = int(_scalar(request, interface.REQUEST_OUTPUT_LEN.name))
            ids = [FIRST_TOKEN + i for i in range(count)]
            if bool(_scalar(request, interface.STREAMING.name)):
                for token in ids:
                    sender.send(_tokens([token]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(_tokens(ids), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
