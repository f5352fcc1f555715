"""Errors the toolchain raises for bad input; the CLI prints them without a traceback."""


class Qwen3VLTrtError(Exception):
    """Base class: a problem the user can fix, with a message that says how."""


class CheckpointError(Qwen3VLTrtError):
    """The checkpoint directory is missing, incomplete or corrupt."""


class UnsupportedModelError(Qwen3VLTrtError):
    """The checkpoint is not a Qwen3-VL model this toolchain can compile."""


class OutputExistsError(Qwen3VLTrtError):
    """The output directory exists and overwriting was not asked for."""


class InputError(Qwen3VLTrtError):
    """Tensors handed to a runtime do not match its contract."""
