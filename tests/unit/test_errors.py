"""One error root: every exception class the package defines derives from `RagKVCacheError`, and from the
builtin its kind belongs to, so `except RagKVCacheError` catches whatever rag-kvcache raises for its own
reasons and `except ValueError` keeps catching bad settings."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import rag_kvcache
from rag_kvcache.config import Config, QueryConfig, StorageConfig
from rag_kvcache.errors import ConfigError, RagKVCacheError
from rag_kvcache.serving.settings import ServerConfig


def package_exceptions() -> list[type]:
    found = []
    for info in pkgutil.walk_packages(rag_kvcache.__path__, "rag_kvcache."):
        if info.name.endswith("__main__"):  # runs the CLI
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional backend whose package is not installed (vLLM's)
            continue
        found += [
            cls
            for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, BaseException) and cls.__module__ == module.__name__
        ]
    return found


def test_every_exception_the_package_defines_derives_from_the_root():
    found = package_exceptions()
    assert len(found) >= 12, [cls.__name__ for cls in found]
    assert [cls.__name__ for cls in found if not issubclass(cls, RagKVCacheError)] == []


@pytest.mark.parametrize(
    "make",
    [
        lambda: Config(query=QueryConfig(top_k=0)),
        lambda: StorageConfig(conversation_bytes=-1),
        lambda: ServerConfig(history="forget"),
        lambda: ServerConfig(backfill_slice_s=-0.5),
        lambda: ServerConfig(backfill_slice_s=float("nan")),
    ],
)
def test_a_bad_setting_is_a_config_error_and_a_value_error(make):
    with pytest.raises(ConfigError) as caught:
        make()
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, RagKVCacheError)
