"""Request preprocessing: prompts, images and positions -> the vision encoder's and LLM engine's inputs."""

from ..common.limits import ImageLimits, RequestLimits
from .images import ImageProcessingConfig
from .preprocessor import Preprocessor, Request

__all__ = ["ImageLimits", "ImageProcessingConfig", "Preprocessor", "Request", "RequestLimits"]
