"""A WMT14-sized parallel corpus from the shared Multi30k files, for data-pipeline measurements.

  python benchmarks/make_large_corpus.py ../shared/data/multi30k /tmp/multi30k_x155 --copies 155

Writes train.en / train.de with `copies` x 29,000 pairs (155 copies: 4,495,000, WMT14 en-de's
4.5M): copy 0 is the corpus itself, every later copy shuffles the words of each sentence
(seeded), so the text is new to the tokenizer and the encoder while lengths and vocabulary stay
Multi30k's. The validation and test files are copied unchanged, so `configs/multi30k.py`
runs on the folder with `--config.data_dir`.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil

import numpy as np

LANGS = ("en", "de")


def _lines(path: str) -> list[str]:
  with gzip.open(path, "rt", encoding="utf-8") as f:
    return f.read().rstrip("\n").split("\n")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("multi30k_dir")
  parser.add_argument("output_dir")
  parser.add_argument("--copies", type=int, default=155)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  os.makedirs(args.output_dir, exist_ok=True)
  corpus = {lang: [line.split(" ") for line in _lines(
      os.path.join(args.multi30k_dir, f"train.{lang}.gz"))] for lang in LANGS}
  rng = np.random.default_rng(args.seed)
  outputs = {lang: open(os.path.join(args.output_dir, f"train.{lang}"), "w", encoding="utf-8")
             for lang in LANGS}
  for copy in range(args.copies):
    for lang in LANGS:
      sentences = corpus[lang]
      if copy:
        sentences = [[words[i] for i in rng.permutation(len(words))] for words in sentences]
      outputs[lang].write("".join(" ".join(words) + "\n" for words in sentences))
  for f in outputs.values():
    f.close()
  for name in os.listdir(args.multi30k_dir):
    if not name.startswith("train."):
      shutil.copy(os.path.join(args.multi30k_dir, name), args.output_dir)
  print(f"{args.copies * len(corpus['en']):,} training pairs in {args.output_dir}")


if __name__ == "__main__":
  main()
