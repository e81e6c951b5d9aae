"""Write a randomly initialised Llama to a folder that `--model` loads: for timing the query path on a
GPU, where no model can be downloaded. The default shape is Llama-3.2-1B's (16 layers, hidden 2048,
32 query and 8 KV heads of 64, MLP 8192); the vocabulary is the given tokenizer's.

    python benchmarks/gpu/random_llama.py --tokenizer TOKENIZER_DIR --out /tmp/llama-1b --device cuda
    rag-kvcache bench --model /tmp/llama-1b --device cuda --dtype bfloat16 ...

Random weights answer nonsense: the run measures time, not quality.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="folder of a Hugging Face tokenizer")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--context", type=int, default=8192, help="max_position_embeddings")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the saved weights")
    parser.add_argument("--device", default="cpu", help="where the weights are initialised (cuda: seconds)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.context,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id or tokenizer.cls_token_id,
        eos_token_id=tokenizer.eos_token_id or tokenizer.sep_token_id,
    )
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg).to(DTYPES[args.dtype]).eval()
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {args.out}: {n / 1e9:.2f}B parameters ({args.layers} layers, hidden {args.hidden}, "
        f"{args.heads}/{args.kv_heads} heads, vocabulary {cfg.vocab_size}), {args.dtype}"
    )


if __name__ == "__main__":
    main()
