"""Examples from a prepared TensorFlow Datasets dataset (`config.dataset = 'tfds'`).

The data must already be prepared in `config.tfds_data_dir` (or $TFDS_DATA_DIR, e.g.
gs://BUCKET/tensorflow_datasets on a TPU VM); training machines often have no internet, so
nothing is downloaded here. A missing dataset gets an error with the command that prepares it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Iterator

import ml_collections

from transformer_jax import tasks


def prepare_command(name: str, data_dir: str | None) -> str:
  return f"tfds build {name}" + (f" --data_dir={data_dir}" if data_dir else "")


def _text(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _example(record: dict, t: ml_collections.ConfigDict, task: str) -> dict:
  if tasks.has_labels(task):
    return {"source": _text(record[t.source_key]), "label": int(record[t.label_key])}
  return {"source": _text(record[t.source_key]), "target": _text(record[t.target_key])}


def check_installed() -> None:
  """Raises a one-line error naming the install when TensorFlow Datasets is missing (the
  base install leaves it and TensorFlow out: no other data source needs them)."""
  if importlib.util.find_spec("tensorflow_datasets") is None:
    raise ValueError("config.dataset='tfds' needs TensorFlow Datasets, which the base install "
                     "leaves out: pip install -r requirements-tfds.txt (or -e .[tfds]).")


def _builder(config: ml_collections.ConfigDict, split: str):
  check_installed()
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  t = config.tfds
  if not t.name:
    raise ValueError("config.dataset='tfds' needs config.tfds.name, e.g. wmt14_translate/de-en.")
  data_dir = config.tfds_data_dir or os.environ.get("TFDS_DATA_DIR") or None
  name = t.eval_name if split != "train" and t.eval_name else t.name
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise ValueError(f"TFDS has no dataset {name!r}: {str(e).splitlines()[0]}") from None
  if not builder.is_prepared():
    raise FileNotFoundError(
        f"TFDS dataset {name} is not prepared in {builder.data_dir}. On a machine with "
        f"internet run: {prepare_command(name, data_dir)} then point "
        "--config.tfds_data_dir (or TFDS_DATA_DIR) at that folder or a bucket holding a "
        "copy of it.")
  return builder


def _random_access(builder) -> bool:
  """Whether the prepared files are ArrayRecord, read by index without TensorFlow."""
  return str(getattr(builder.info.file_format, "value", "")) == "array_record"


def stream(config: ml_collections.ConfigDict, split: str, shard_index: int = 0,
           shard_count: int = 1) -> tuple[Iterator[dict], int]:
  """Records shard_index, shard_index + shard_count, ... of the TFDS dataset `config.tfds.name`
  (splits mapped by config.splits, e.g. test -> 'test' for newstest2014 in wmt14_translate),
  as examples, and how many.

  ArrayRecord data (`tfds build --file_format=array_record`) is read by index: a shard reads
  only its own records, and nothing of TensorFlow is imported. Other formats stream through
  tf.data, which reads every record and keeps the shard's.
  """
  t, builder = config.tfds, _builder(config, split)
  split_name = config.splits[split]
  try:
    num_examples = builder.info.splits[split_name].num_examples
  except (KeyError, ValueError) as e:  # an unknown split name
    raise ValueError(f"{builder.name}: {e}. Set config.splits.{split} to one of "
                     f"{sorted(builder.info.splits)}.") from None
  indices = range(shard_index, num_examples, shard_count)
  if _random_access(builder):
    records = builder.as_data_source(split=split_name)

    def read():
      for start in range(0, len(indices), _READ_CHUNK):
        chunk = list(indices[start:start + _READ_CHUNK])
        # One batched read where the TFDS version has it.
        fetched = (records.__getitems__(chunk) if hasattr(records, "__getitems__")
                   else [records[i] for i in chunk])
        for record in fetched:
          yield _example(record, t, config.task)
  else:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    dataset = builder.as_dataset(split=split_name, shuffle_files=False)
    if shard_count > 1:
      dataset = dataset.shard(shard_count, shard_index)
    read = lambda: (_example(record, t, config.task) for record in tfds.as_numpy(dataset))
  return read(), len(indices)


_READ_CHUNK = 10_000  # ArrayRecord records fetched per call
