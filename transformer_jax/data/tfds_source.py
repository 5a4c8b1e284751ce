"""Examples from a prepared TensorFlow Datasets dataset (`config.dataset = 'tfds'`).

The data must already be prepared in `config.tfds_data_dir` (or $TFDS_DATA_DIR, e.g.
gs://BUCKET/tensorflow_datasets on a TPU VM); training machines often have no internet, so
nothing is downloaded here. A missing dataset gets an error with the command that prepares it.
"""

from __future__ import annotations

import os
from typing import Sequence

import ml_collections


def prepare_command(name: str, data_dir: str | None) -> str:
  return f"tfds build {name}" + (f" --data_dir={data_dir}" if data_dir else "")


def _text(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _example(record: dict, t: ml_collections.ConfigDict, task: str) -> dict:
  if task == "classification":
    return {"source": _text(record[t.source_key]), "label": int(record[t.label_key])}
  return {"source": _text(record[t.source_key]), "target": _text(record[t.target_key])}


def load_examples(config: ml_collections.ConfigDict,
                  splits: Sequence[str]) -> dict[str, list[dict]]:
  """{split: examples} read from the TFDS dataset `config.tfds.name` (splits mapped by
  config.splits, e.g. test -> 'test' for newstest2014 in wmt14_translate)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  t = config.tfds
  if not t.name:
    raise ValueError("config.dataset='tfds' needs config.tfds.name, e.g. wmt14_translate/de-en.")
  data_dir = config.tfds_data_dir or os.environ.get("TFDS_DATA_DIR") or None
  examples = {}
  for split in splits:
    name = t.eval_name if split != "train" and t.eval_name else t.name
    try:
      builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError as e:
      raise ValueError(f"TFDS has no dataset {name!r}: {str(e).splitlines()[0]}") from None
    try:
      dataset = builder.as_dataset(split=config.splits[split], shuffle_files=False)
    except AssertionError:  # TFDS's way of saying the prepared files are not there
      raise FileNotFoundError(
          f"TFDS dataset {name} is not prepared in {builder.data_dir}. On a machine with "
          f"internet run: {prepare_command(name, data_dir)} then point "
          "--config.tfds_data_dir (or TFDS_DATA_DIR) at that folder or a bucket holding a "
          "copy of it.") from None
    except ValueError as e:  # an unknown split name
      raise ValueError(f"{name}: {e}. Set config.splits.{split} to one of "
                       f"{sorted(builder.info.splits)}.") from None
    examples[split] = [_example(record, t, config.task) for record in tfds.as_numpy(dataset)]
  return examples
