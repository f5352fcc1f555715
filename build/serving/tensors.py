"""A tensor of the deployment: its name, Triton type and dims, as the models' configs declare it and the clients and
stages send it (serving.interface and serving.request declare the deployment's)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..common.contracts import TensorSpec

# Triton's DataType names (without TYPE_) of the contracts' dtypes; "model" is the LLM checkpoint's dtype.
TRITON_DATA_TYPES = {"float32": "FP32", "int32": "INT32", "int64": "INT64", "uint64": "UINT64", "model": "MODEL"}
NUMPY_DTYPES = {
    **{triton: np.dtype(name) for name, triton in TRITON_DATA_TYPES.items() if name != "model"},
    "BOOL": np.dtype(bool),
    "STRING": np.dtype(object),  # bytes elements
}


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str  # Triton's DataType name without TYPE_ (INT32, FP32, BOOL, STRING, ...)
    dims: tuple[int, ...]
    optional: bool = False
    scalar: bool = False  # one value per request: reshaped to [] where the tensorrt_llm backend does
    contract: TensorSpec | None = None  # the stage contract this tensor carries, if any

    def to_triton(self, array: np.ndarray) -> np.ndarray:
        """An array of the contract's dtype as this tensor carries it (the backend's type, where it differs)."""
        return np.asarray(array, dtype=NUMPY_DTYPES[self.data_type])


def scalar_tensor(name: str, data_type: str, optional: bool = True) -> Tensor:
    """A value per request, declared [1] and reshaped to [] as the tensorrt_llm backend declares them."""
    return Tensor(name, data_type, (1,), optional=optional, scalar=True)
