# Integration tests: the package across a process, a port or a service. `serve` on a loopback port driven by
# the openai, LangChain and LlamaIndex clients; a real redis-server; the CLI, indexers and store writers as
# processes (some killed mid-run); a full tmpfs and a read-only mount; a local Ray cluster; the notebooks; the
# vLLM connector (runs in .venv-vllm, skips in .venv). The tiny Llama, except the tests marked `smollm2`.
