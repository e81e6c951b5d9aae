"""Serving: `engine` (an opened index on its own worker thread, shared by the integrations) and the
OpenAI-compatible server (`openai_api`, configured by `settings.ServerConfig`, run by `rag-kvcache serve`).

Import from the modules (`rag_kvcache.serving.settings` needs neither torch nor FastAPI); `ServingEngine` is
also exported at the package top, `rag_kvcache.ServingEngine`."""
