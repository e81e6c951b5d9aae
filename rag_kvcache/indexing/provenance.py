"""What an index records of how it was built, in its metadata (`index.sqlite`'s meta), read back and checked.

`KVIndex.create` records the index's `IndexSettings` as one JSON value (`SETTINGS_KEY`) with that JSON's
xxh3-64 beside it (`SETTINGS_CHECKSUM_KEY`, `settings_checksum`), its tokenizer's vocabulary hash
(`tokenizer_id`: a model that tokenizes otherwise cannot read its chunks' token ids) and that its neighbour
caches are stored averaged (`STORED_MEANS_KEY`). `recorded_settings` reads the settings back: what does not
parse, or was edited after the index was built, raises `IndexFileError` naming the meta key; the formats of
older indexes are still read. `ForeignModelError` is raised for documents indexed with a model the index was
not built with: the caches it computes would not be the index's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path

import xxhash

from ..config import IndexSettings
from ..errors import IndexFileError, RagKVCacheError
from ..retrieval.database import DB_FILE

SETTINGS_KEY = "settings"  # the index's meta key holding its `IndexSettings` as JSON
SETTINGS_CHECKSUM_KEY = "settings_xxh3"  # beside it: the xxh3-64 of that JSON, recorded with it (`settings_checksum`)
# the meta key recording that neighbour caches are stored averaged with the behind-prefix ones (`CacheMaker`):
# every index this release creates; one created before stores the neighbour cache itself, averaged per query
STORED_MEANS_KEY = "stored_means"


def settings_checksum(settings_json: str) -> str:
    """The checksum an index records beside its settings JSON (`SETTINGS_CHECKSUM_KEY`): xxh3-64, hex."""
    return xxhash.xxh3_64_hexdigest(settings_json.encode())


def recorded_settings(meta: Mapping[str, str], index_dir: Path | None = None) -> IndexSettings:
    """The `IndexSettings` an index's metadata records (of the index at `index_dir`, which errors name). Settings
    that do not parse, or do not match the checksum recorded beside them (edited after the index was built: its
    caches were made with others), raise `IndexFileError` naming the meta key; an index made before the checksum
    was recorded is read without it. Indexes made before the settings were one JSON value recorded each as its own
    string, the codec as `kv_codec` (none recorded: stored as computed); those are read by the fields' types."""
    if SETTINGS_KEY in meta:
        where = f"{(index_dir or Path('<index>')) / DB_FILE} meta key {SETTINGS_KEY!r}"
        try:
            settings = IndexSettings.from_json(text := meta[SETTINGS_KEY])
        except json.JSONDecodeError as e:
            raise IndexFileError(f"{where} is not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        except (ValueError, TypeError) as e:
            raise IndexFileError(f"{where} does not hold index settings: {e}") from e
        if (recorded := meta.get(SETTINGS_CHECKSUM_KEY)) is not None and recorded != settings_checksum(text):
            raise IndexFileError(
                f"{where} was edited after the index was built: it hashes to {settings_checksum(text)}, the index "
                f"recorded {recorded} ({SETTINGS_CHECKSUM_KEY!r}), and its chunks and caches were made with the "
                "settings it recorded then. Restore them, or build a new index with the new settings"
            )
        return settings
    types = {f.name: f.type for f in fields(IndexSettings) if f.name in meta}
    return IndexSettings(
        **{k: int(meta[k]) if t == "int" else meta[k] for k, t in types.items()}, codec=meta.get("kv_codec", "none")
    )


def tokenizer_id(tokenizer) -> str:
    """A tokenizer's vocabulary hash (xxh3-64 of its sorted vocabulary as JSON, hex), which the index records: the
    same for tokenizers of the same vocabulary."""
    vocab = sorted(tokenizer.get_vocab().items())
    return xxhash.xxh3_64_hexdigest(json.dumps(vocab).encode())


class ForeignModelError(RagKVCacheError, ValueError):
    """Documents indexed with a model the index was not built with (its weights differ)."""
