"""Request preprocessing: prompts, images and positions -> the vision encoder's and LLM engine's inputs."""

from .images import ImageLimits, ImageProcessingConfig
from .preprocessor import Preprocessor, Request, RequestLimits

__all__ = ["ImageLimits", "ImageProcessingConfig", "Preprocessor", "Request", "RequestLimits"]
