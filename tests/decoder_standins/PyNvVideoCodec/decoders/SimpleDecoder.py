"""SimpleDecoder as the 2.2.4 wheel's `PyNvVideoCodec/decoders/SimpleDecoder.py` defines it, for the calls the product
makes: the constructor with bytes-like input (copied once; paths and BinaryIO streams are not modelled), its
refusal of streams with no frames, `len()` (the container's count, the scanned count where that is 0),
`get_batch_frames_by_index` (out-of-range indices skipped with a warning, duplicates dropped, the native decoder asked
for the sorted indices and its frames returned in the order asked) and the metadata getters."""

from __future__ import annotations

import warnings
from typing import Any

import PyNvVideoCodec as nvc


class SimpleDecoder:
    def __init__(
        self,
        enc_file_path: Any,
        gpu_id: int = 0,
        cuda_context: int = 0,
        cuda_stream: int = 0,
        use_device_memory: bool = True,
        max_width: int = 0,
        max_height: int = 0,
        need_scanned_stream_metadata: bool = False,
        decoder_cache_size: int = 4,
        output_color_type: Any = nvc.OutputColorType.NATIVE,
        bWaitForSessionWarmUp: bool = False,  # upstream's names
        enableDecodeStats: bool = False,
    ) -> None:
        self.need_scanned_stream_metadata = need_scanned_stream_metadata
        if not isinstance(enc_file_path, (bytes, bytearray, memoryview)):
            raise TypeError(f"the stand-in takes the video's bytes, not {type(enc_file_path).__name__}")
        source = bytes(enc_file_path)
        if len(source) > 8 * 1024 * 1024:
            warnings.warn(
                f"SimpleDecoder: in-memory buffer is {len(source) / (1024 * 1024):.1f} MiB. "
                "Large buffers consume additional memory since the data is copied into native storage.",
                stacklevel=2,
            )
        self.simple_decoder = nvc.CreateSimpleDecoder(
            source,
            gpu_id,
            cuda_context,
            cuda_stream,
            use_device_memory,
            max_width,
            max_height,
            need_scanned_stream_metadata,
            decoder_cache_size,
            output_color_type,
            bWaitForSessionWarmUp,
            enableDecodeStats,
        )
        if len(self) == 0:
            raise Exception("Elementary streams not supported by Simple Decoder. Invalid input stream.")

    def __len__(self) -> int:
        stream_meta = self.simple_decoder.get_stream_metadata()
        if stream_meta.num_frames == 0 and self.need_scanned_stream_metadata:
            return int(self.simple_decoder.get_scanned_stream_metadata().num_frames)
        return int(stream_meta.num_frames)

    def get_batch_frames_by_index(self, indices: list[int]) -> list[Any]:
        total_frames = len(self)
        validated_indices: list[int] = []
        for index in indices:
            if 0 <= index < total_frames:
                if index not in validated_indices:
                    validated_indices.append(index)
            else:
                warnings.warn(f"Skipping index {index}: Out of valid range [0, {total_frames - 1}]", stacklevel=2)
        sorted_validated_indices = sorted(validated_indices)
        sorted_frames = self.simple_decoder.get_batch_frames_by_index(sorted_validated_indices)
        # As upstream: a native result shorter than asked raises IndexError here.
        mapping = {val: sorted_frames[idx] for idx, val in enumerate(sorted_validated_indices)}
        return [mapping[val] for val in validated_indices]

    def get_stream_metadata(self) -> Any:
        return self.simple_decoder.get_stream_metadata()

    def get_scanned_stream_metadata(self) -> Any:
        if not self.need_scanned_stream_metadata:
            raise Exception("Invalid call to funtion. Decoder was created with need_scanned_stream_metadata = 0.")
        return self.simple_decoder.get_scanned_stream_metadata()
