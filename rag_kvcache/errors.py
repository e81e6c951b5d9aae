"""The root of every error rag-kvcache raises for its own reasons: `except RagKVCacheError` catches them
all. Each also derives from the builtin its kind belongs to (ValueError for a bad input or setting, OSError
for storage), so code that catches those keeps working. This module imports nothing of the package."""


class RagKVCacheError(Exception):
    """An error of rag-kvcache's own (a bad setting, input or stored entry); its message names the value."""


class ConfigError(RagKVCacheError, ValueError):
    """A setting out of range or of the wrong kind."""


class StorageFullError(RagKVCacheError, OSError):
    """The disk holding the store or the index is full (or over quota)."""


class IndexFileError(RagKVCacheError, ValueError):
    """A file of an index (or a value recorded in one) that does not parse or does not hold what it should; the
    message names the file and what is wrong."""
