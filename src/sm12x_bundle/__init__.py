"""sm12x-bundle: a patched vLLM for consumer Blackwell sleep-mode rotation pools."""

__version__ = "0.1.0"
