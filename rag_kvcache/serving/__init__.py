"""Serving: engines (an opened index on its own worker thread) shared by the integrations, and the
OpenAI-compatible server (`rag-kvcache serve`). Names are imported on first use, so that the CLI can
read `ServerConfig` without loading torch or FastAPI."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"Engine": ".engine", "EngineHandle": ".engine", "ServerConfig": ".settings", "create_app": ".openai_api"}
__all__ = ["Engine", "EngineHandle", "ServerConfig", "create_app"]

if TYPE_CHECKING:
    from .engine import Engine, EngineHandle
    from .openai_api import create_app
    from .settings import ServerConfig


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
