"""Cache memory: KV for attention layers, conv windows and SSM states for GDN layers."""

from qwen_mtp.cache.sequence import SequenceCache

__all__ = ["SequenceCache"]
