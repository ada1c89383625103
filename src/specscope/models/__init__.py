"""Target models: the native Llama-family/MoE implementation and the transformers fallback."""

from .loading import DEFAULT_MODEL, PRESETS, ModelSpecError, Target, load_target
from .llama import SUPPORTED_ARCHITECTURES, UnsupportedArchitecture

__all__ = [
    "DEFAULT_MODEL", "PRESETS", "ModelSpecError", "Target", "load_target",
    "SUPPORTED_ARCHITECTURES", "UnsupportedArchitecture",
]
