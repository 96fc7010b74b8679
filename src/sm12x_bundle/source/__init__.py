"""The pin: which vLLM source the series is written for, and how to get it safely."""

from .pin import Pin, SourceTree, known_sha256, resolve_source

__all__ = ["Pin", "SourceTree", "known_sha256", "resolve_source"]
