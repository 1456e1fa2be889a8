"""splitspec: EAGLE-3 speculative decoding for Kimi-K2-class MoE targets, drafter on its own parallel group."""

__version__ = "0.1.0"
