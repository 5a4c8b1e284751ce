"""Reference points without a model, on the same test splits and metrics as the configs:

  python benchmarks/baselines.py --data_dir ../shared/data

  multi30k   copy-the-source BLEU (the English sentence as its own German translation)
  dialogsum  lead-N ROUGE (the dialogue's first N turns as its summary), N = 1, 2, 3
  sst2 etc.  majority-class accuracy and macro-F1 on dev / test
Prints one JSON line per baseline. Corpora that are not in --data_dir are skipped.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer_jax import metrics  # noqa: E402
from transformer_jax.data import readers  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data_dir", required=True, help="folder holding multi30k/, dialogsum/...")
  args = parser.parse_args()
  folder = lambda name: os.path.join(args.data_dir, name)

  if os.path.isdir(folder("multi30k")):
    test = readers.read_parallel(folder("multi30k"), "test_2016_flickr", "en", "de")
    score, signature = metrics.bleu([e["source"] for e in test], [e["target"] for e in test])
    print(json.dumps({"dataset": "multi30k test_2016_flickr", "baseline": "copy source",
                      "bleu": round(score, 2), "signature": signature}))
  if os.path.isdir(folder("dialogsum")):
    test = readers.read_jsonl(folder("dialogsum"), "test", "dialogue", "summary|summary1")
    for n in (1, 2, 3):
      leads = [" ".join(e["source"].split("\n")[:n]) for e in test]
      scores = metrics.rouge(leads, [e["target"] for e in test])
      print(json.dumps({"dataset": "dialogsum test (summary1)", "baseline": f"lead-{n} turns",
                        **{k: round(v, 2) for k, v in scores.items()}}))
  for name, split_files, text_column in (("sst2", ("dev", "test"), "sentence|content"),):
    if os.path.isdir(folder(name)):
      train = readers.read_tsv(folder(name), "train", text_column, "label")
      labels = [e["label"] for e in train]
      majority = max(set(labels), key=labels.count)
      for split in split_files:
        gold = [e["label"] for e in readers.read_tsv(folder(name), split, text_column, "label")]
        scores = metrics.classification_scores([majority] * len(gold), gold, 2)
        print(json.dumps({"dataset": f"{name} {split}", "baseline": "majority class",
                          **{k: round(v, 4) for k, v in scores.items()}}))


if __name__ == "__main__":
  main()
