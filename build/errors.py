"""Errors the toolchain raises for bad input; the CLI prints them without a traceback."""


class Qwen3VLTrtError(Exception):
    """Base class: a problem the user can fix, with a message that says how."""

    exit_code = 2  # of the command line


class CheckpointError(Qwen3VLTrtError):
    """The checkpoint directory is missing, incomplete or corrupt."""


class UnsupportedModelError(Qwen3VLTrtError):
    """The checkpoint is not a Qwen3-VL model this toolchain can compile."""


class OutputExistsError(Qwen3VLTrtError):
    """The output directory exists and overwriting was not asked for."""


class OutputOverlapError(Qwen3VLTrtError):
    """The output directory is, contains or lies inside one of the stage's inputs."""


class LimitsError(Qwen3VLTrtError):
    """A serving or engine limit is out of range or inconsistent with another."""


class InputError(Qwen3VLTrtError):
    """Tensors handed to a runtime do not match its contract."""


class RequestError(Qwen3VLTrtError):
    """A client request cannot be served as sent; the message says what to change. `field`: the request's field
    (serving.request.GenerationRequest) at fault, where one is."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class ImageDecodeError(RequestError):
    """Image bytes are empty, not an image, truncated or corrupt."""


class ImageTooLargeError(RequestError):
    """An image is over a limit: its encoded bytes, or the pixels its header claims (decompression-bomb guard)."""


class ImageShapeError(RequestError):
    """An image's aspect ratio is beyond what the model's resizing accepts."""


class VideoDecodeError(RequestError):
    """Video bytes are empty, not a video container, audio only, in an unsupported codec, truncated or corrupt."""


class VideoTooLargeError(RequestError):
    """A video is over a limit: its encoded bytes, duration, frame size or sampled frames."""


class TooManyImagesError(RequestError):
    """A request carries more images than the configured limit."""


class TooManyVideosError(RequestError):
    """A request carries more videos than the configured limit."""


class PromptTooLongError(RequestError):
    """The prompt, with its visual tokens expanded, is longer than the configured limit."""


class MessageError(RequestError):
    """Chat messages or prompt placeholders are malformed (roles, content parts, image count)."""


class GpuStackMissingError(Qwen3VLTrtError):
    """A stage needs the GPU stack (CUDA device, TensorRT, TensorRT-LLM) that this machine lacks."""

    exit_code = 3


class StageError(Qwen3VLTrtError):
    """A stage of a running deployment failed a request through no fault of the request's."""


class ServingError(Qwen3VLTrtError):
    """No usable Triton server: not installed, not runnable from this environment, or not ready in time."""

    exit_code = 3


class BuildCacheError(Qwen3VLTrtError):
    """The build cache cannot be used: not a cache, storage lacking what it needs, a damaged entry, a wait ended."""
