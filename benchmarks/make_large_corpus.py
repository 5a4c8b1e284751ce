"""A WMT14-sized parallel corpus from the shared Multi30k files, for data-pipeline measurements.

  python benchmarks/make_large_corpus.py ../shared/data/multi30k /tmp/multi30k_x155 --copies 155
  python benchmarks/make_large_corpus.py ../shared/data/multi30k /tmp/multi30k_x155_parquet \
      --copies 155 --format parquet

Makes `copies` x 29,000 pairs (155 copies: 4,495,000, WMT14 en-de's 4.5M): copy 0 is the
corpus itself, every later copy shuffles the words of each sentence (seeded), so the text is
new to the tokenizer and the encoder while lengths and vocabulary stay Multi30k's.

--format text (the default) writes train.en / train.de and copies the validation and test
files unchanged, so `configs/multi30k.py` runs on the folder with `--config.data_dir`.
--format parquet writes the same pairs as a Hugging Face dataset folder, laid out like WMT14
on the Hub: train-0000N-of-0000M.parquet shards of about --shard_rows rows (written a copy at
a time, so memory stays flat), validation.parquet and test.parquet from Multi30k's val and
test_2016_flickr files, each with one struct column `translation` {"en": ..., "de": ...}.
Run it with `--config.dataset=huggingface --config.huggingface.name=FOLDER
--config.huggingface.columns.source=translation.en (.target=translation.de)`.
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import shutil
from typing import Iterator

import numpy as np

LANGS = ("en", "de")
# Multi30k's evaluation files -> the split names the Parquet folder gives them.
EVAL_SPLITS = {"val": "validation", "test_2016_flickr": "test"}


def _lines(path: str) -> list[str]:
  with gzip.open(path, "rt", encoding="utf-8") as f:
    return f.read().rstrip("\n").split("\n")


def _copies(corpus: dict[str, list[list[str]]], copies: int,
            seed: int) -> Iterator[dict[str, list[str]]]:
  """{lang: [sentence, ...]} for each copy; the same pairs whatever the format."""
  rng = np.random.default_rng(seed)
  for copy in range(copies):
    texts = {}
    for lang in LANGS:
      sentences = corpus[lang]
      if copy:
        sentences = [[words[i] for i in rng.permutation(len(words))] for words in sentences]
      texts[lang] = [" ".join(words) for words in sentences]
    yield texts


def _write_text(corpus, args) -> None:
  outputs = {lang: open(os.path.join(args.output_dir, f"train.{lang}"), "w", encoding="utf-8")
             for lang in LANGS}
  for texts in _copies(corpus, args.copies, args.seed):
    for lang in LANGS:
      outputs[lang].write("".join(text + "\n" for text in texts[lang]))
  for f in outputs.values():
    f.close()
  for name in os.listdir(args.multi30k_dir):
    if not name.startswith("train."):
      shutil.copy(os.path.join(args.multi30k_dir, name), args.output_dir)


def _table(texts: dict[str, list[str]]):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  translation = pa.StructArray.from_arrays([pa.array(texts[lang], pa.string())
                                            for lang in LANGS], names=list(LANGS))
  return pa.table({"translation": translation})


def _write_parquet(corpus, args) -> None:
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  total = args.copies * len(corpus[LANGS[0]])
  shards = max(1, math.ceil(total / args.shard_rows))
  per_shard = math.ceil(total / shards)
  writer, written = None, 0  # written: rows in all shards so far
  for texts in _copies(corpus, args.copies, args.seed):
    table = _table(texts)
    while len(table):
      shard, row = divmod(written, per_shard)
      if row == 0:  # a new shard begins
        if writer:
          writer.close()
        name = f"train-{shard:05d}-of-{shards:05d}.parquet"
        writer = pq.ParquetWriter(os.path.join(args.output_dir, name), table.schema)
      part = table.slice(0, per_shard - row)  # what still fits in this shard
      writer.write_table(part)
      written += len(part)
      table = table.slice(len(part))
  writer.close()
  for stem, split in EVAL_SPLITS.items():
    texts = {lang: _lines(os.path.join(args.multi30k_dir, f"{stem}.{lang}.gz"))
             for lang in LANGS}
    pq.write_table(_table(texts), os.path.join(args.output_dir, f"{split}.parquet"))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("multi30k_dir")
  parser.add_argument("output_dir")
  parser.add_argument("--copies", type=int, default=155)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--format", choices=("text", "parquet"), default="text")
  parser.add_argument("--shard_rows", type=int, default=500_000,
                      help="parquet: about this many training pairs per file")
  args = parser.parse_args()
  os.makedirs(args.output_dir, exist_ok=True)
  corpus = {lang: [line.split(" ") for line in _lines(
      os.path.join(args.multi30k_dir, f"train.{lang}.gz"))] for lang in LANGS}
  if args.format == "parquet":
    _write_parquet(corpus, args)
  else:
    _write_text(corpus, args)
  print(f"{args.copies * len(corpus['en']):,} training pairs in {args.output_dir}")


if __name__ == "__main__":
  main()
