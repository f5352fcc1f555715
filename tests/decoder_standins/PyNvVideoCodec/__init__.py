"""PyNvVideoCodec 2.2.4 on a host without NVIDIA's driver (tests only; tests/decoder_standins/README.md).

The package's import as the 2.2.4 wheel's `__init__.py` does it: the driver's NVENC API version is read through
VersionCheck (a RuntimeError with troubleshooting steps when libnvidia-encode cannot be loaded, another when the driver
is older than NVENC 12.1), then the native module's names, then the Python decoders. The native module is _native
(PyAV standing in for FFmpeg demuxing, NVDEC and the RGB conversion kernel).
"""

from __future__ import annotations

__version__ = "2.2.4"

_NVENC_VER_12_1 = 12 * 16 + 1  # the oldest driver the wheel has a native module for (`_121`)


def _get_driver_version() -> int:
    try:
        from .VersionCheck import DriverWrapper

        return int(DriverWrapper().GetDriverVersion())
    except Exception as e:
        message = str(e)
        if "libnvidia-encode.so" in message or "cannot open shared object file" in message:
            steps = (
                "\nThe NVENC library could not be found. This usually means:\n\n1. **Running in Docker?**\n"
                "   - Ensure your container was launched with: NVIDIA_DRIVER_CAPABILITIES=compute,utility,video"
            )
        else:
            steps = f"\nOriginal error: {message}\n"
        raise RuntimeError(f"{message}\n\n=== TROUBLESHOOTING STEPS ===\n{steps}") from e


if _get_driver_version() < _NVENC_VER_12_1:
    raise RuntimeError("Driver version is too old")

from ._native import (  # noqa: E402 (after the driver check, as upstream)
    CreateSimpleDecoder,
    DecodedFrame,
    OutputColorType,
    PyNvVCException,
    PyNvVCExceptionUnsupported,
    ScannedStreamMetadata,
    StreamMetadata,
)
from .decoders.SimpleDecoder import SimpleDecoder  # noqa: E402

__all__ = [
    "CreateSimpleDecoder",
    "DecodedFrame",
    "OutputColorType",
    "PyNvVCException",
    "PyNvVCExceptionUnsupported",
    "ScannedStreamMetadata",
    "SimpleDecoder",
    "StreamMetadata",
]
