"""Imported first by a python model's model.py in a repository the tests serve (activation.gpu_in_stub): in that
tritonserver python stub, `import tensorrt` is the stand-in, and torch's CUDA device is host memory for the rest of the
process. The device is the stub's main thread's, where python_backend runs a model's initialize and execute
(triton-inference-server/python_backend r24.10, 01d0ad82, src/pb_stub.cc: main() loops over Stub::RunCommand). The
stub's interpreter is isolated (it ignores PYTHONPATH), hence an import in model.py rather than the environment."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from host_cuda import install_host_cuda  # noqa: E402

install_host_cuda()
