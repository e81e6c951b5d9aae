"""`python -m rag_kvcache`: the `rag-kvcache` command."""

from .cli import app

app(prog_name="rag-kvcache")
