"""Model definitions, selected by config.json `model_type`."""

from engine.models.decoder import SUPPORTED_MODEL_TYPES, Model, ModelArgs

__all__ = ["SUPPORTED_MODEL_TYPES", "Model", "ModelArgs"]
