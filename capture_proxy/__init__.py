"""Capture proxy: an OpenAI-compatible proxy that records exact tokens for RL training."""

__version__ = "0.1.0"
