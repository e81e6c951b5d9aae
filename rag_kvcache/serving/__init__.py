"""Serving: engines (an opened index on its own worker thread) shared by the integrations."""

from .engine import Engine, EngineHandle

__all__ = ["Engine", "EngineHandle"]
