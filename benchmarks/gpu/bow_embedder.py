"""Write a bag-of-words sentence-transformers embedder that `--embedder` loads: BERT's embedding layer
alone over a given tokenizer's vocabulary, with random unit-variance word vectors and no position or
type embeddings, mean-pooled and normalised: a random projection of each text's word counts, so
retrieval follows shared words. For timing runs where the default embedder cannot be had (a device
that reaches no model hub, 64 MiB carried); its retrieval is crude, so read only times from such runs.

    python benchmarks/gpu/bow_embedder.py --tokenizer TOKENIZER_DIR --out /tmp/bow-embedder
    rag-kvcache bench --embedder /tmp/bow-embedder ...
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from sentence_transformers import SentenceTransformer, models
from transformers import AutoTokenizer, BertConfig, BertModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="folder of a Hugging Face (WordPiece) tokenizer")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    torch.manual_seed(args.seed)
    bert = BertModel(
        BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=args.dim,
            num_hidden_layers=0,
            num_attention_heads=1,
            intermediate_size=args.dim,
        ),
        add_pooling_layer=False,
    )
    with torch.no_grad():
        bert.embeddings.word_embeddings.weight.normal_()
        bert.embeddings.position_embeddings.weight.zero_()
        bert.embeddings.token_type_embeddings.weight.zero_()
    with tempfile.TemporaryDirectory() as raw:
        bert.save_pretrained(raw)
        tokenizer.save_pretrained(raw)
        word = models.Transformer(raw, max_seq_length=bert.config.max_position_embeddings)
        SentenceTransformer(modules=[word, models.Pooling(args.dim, "mean"), models.Normalize()]).save(str(args.out))
    print(f"wrote {args.out}: {args.dim}-d bag-of-words embedder over {len(tokenizer)} tokens")


if __name__ == "__main__":
    main()
