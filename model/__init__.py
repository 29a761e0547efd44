"""The Transformer of "Attention Is All You Need" as pure Flax Linen modules."""
from model.config import PRESETS, TransformerConfig, base, big, num_params
from model.transformer import Transformer, init_cache, reorder_cache

__all__ = ["PRESETS", "TransformerConfig", "Transformer", "base", "big", "init_cache", "num_params", "reorder_cache"]
