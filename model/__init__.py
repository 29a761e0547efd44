"""The Transformer of "Attention Is All You Need" as pure Flax Linen modules."""
from model.config import PRESETS, Compute, TransformerConfig, base, big
from model.transformer import Transformer, init_cache, reorder_cache

__all__ = ["PRESETS", "Compute", "TransformerConfig", "Transformer", "base", "big", "init_cache", "reorder_cache"]
