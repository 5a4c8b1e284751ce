"""T5-style text-to-text mixture (`config.task = 'multitask'`): every part's examples become
`prefix + source -> target text` (a class becomes its label name), tagged with the part's name
and metric so evaluation scores each part on its own.

Training mixes the parts in proportion to their (capped) sizes, T5's examples-proportional
mixing: `max_train_examples` keeps a large part from drowning the others.
"""

from __future__ import annotations

import copy
import os
from typing import Sequence

import ml_collections
import numpy as np

from transformer_jax import default_config
from transformer_jax import tasks
from transformer_jax.data import sources


def part_config(config: ml_collections.ConfigDict, part: ml_collections.ConfigDict
                ) -> ml_collections.ConfigDict:
  """A single-task config that reads one part's data."""
  sub = default_config.get_config()
  sub.task = part.task
  sub.dataset = part.get("dataset", "local")
  sub.data_seed = config.data_seed
  sub.data_dir = os.path.join(config.data_dir, part.get("data_dir", ""))
  for name in ("local", "splits", "tfds", "huggingface"):
    if name in part:
      sub[name].update(copy.deepcopy(part[name].to_dict()))
  if "label_names" in part:
    sub.label_names = list(part.label_names)
  return sub


def _cap(examples: list[dict], limit: int, seed: int) -> list[dict]:
  """A seeded sample of `limit` examples, kept in their file order (-1 = all)."""
  if limit < 0 or len(examples) <= limit:
    return examples
  keep = np.random.default_rng(seed).choice(len(examples), limit, replace=False)
  return [examples[i] for i in sorted(keep)]


def load_examples(config: ml_collections.ConfigDict,
                  splits: Sequence[str]) -> dict[str, list[dict]]:
  """{split: [example, ...]} of every part, tagged with the part's name and metric."""
  if not config.mixture:
    raise ValueError("config.task='multitask' needs parts in config.mixture; see "
                     "configs/multitask.py.")
  mixed: dict[str, list[dict]] = {split: [] for split in splits}
  for name, part in sorted(config.mixture.items()):
    sub = part_config(config, part)
    for split, examples in sources.load_examples(sub, splits).items():
      limit = part.get("max_train_examples" if split == "train" else "max_eval_examples", -1)
      for example in _cap(examples, limit, config.data_seed):
        target = (sub.label_names[example["label"]] if tasks.has_labels(sub.task)
                  else example["target"])
        mixed[split].append({"source": part.prefix + example["source"], "target": target,
                             "task": name, "metric": sub.task})
  return mixed
