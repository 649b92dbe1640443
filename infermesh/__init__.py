"""infermesh: LLM-aware service-mesh extension."""

__version__ = "0.1.0"
