"""The token cache of the training split (data/token_cache.py) and its Ragged arrays."""

import os

import numpy as np
import pytest

from transformer_jax import run_data
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import pipeline
from transformer_jax.data import token_cache


def test_ragged_holds_sequences_in_two_arrays():
  ragged = pipeline.Ragged.from_sequences([[5, 6, 1], [1], [7, 8, 9, 1]])
  assert ragged.values.tolist() == [5, 6, 1, 1, 7, 8, 9, 1]
  assert ragged.offsets.tolist() == [0, 3, 4, 8]
  assert len(ragged) == 3 and ragged.lengths().tolist() == [3, 1, 4]
  assert [x.tolist() for x in ragged] == [[5, 6, 1], [1], [7, 8, 9, 1]]
  assert ragged[-1].tolist() == [7, 8, 9, 1]
  with pytest.raises(IndexError):
    ragged[3]  # pylint: disable=pointless-statement
  assert [x.tolist() for x in ragged.take([2, 0])] == [[7, 8, 9, 1], [5, 6, 1]]
  joined = pipeline.Ragged.concatenate([ragged, pipeline.Ragged.from_sequences([[4, 1]])])
  assert [x.tolist() for x in joined] == [[5, 6, 1], [1], [7, 8, 9, 1], [4, 1]]


def _corpus(folder, pairs):
  os.makedirs(folder, exist_ok=True)
  for lang, side in (("en", 0), ("de", 1)):
    for split in ("train", "val", "test"):
      with open(os.path.join(folder, f"{split}.{lang}"), "w", encoding="utf-8") as f:
        f.write("".join(pair[side] + "\n" for pair in pairs))


PAIRS = [(f"the {a} house number {i}", f"das {b} Haus Nummer {i}")
         for i, (a, b) in enumerate([("red", "rote"), ("old", "alte"), ("big", "grosse")] * 40)]


@pytest.fixture
def local_config(tmp_path, tiny_config):
  data_dir = str(tmp_path / "data")
  _corpus(data_dir, PAIRS)
  tiny_config.dataset = "local"
  tiny_config.data_dir = data_dir
  tiny_config.local.update(format="parallel", source_lang="en", target_lang="de")
  tiny_config.splits.update(train="train", validation="val", test="test")
  tiny_config.model.vocab_size = 64
  return tiny_config


def _workdir(tmp_path):
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)  # as train_and_evaluate has it (its run lock) before reading data
  return workdir


def _entries(workdir):
  folder = os.path.join(workdir, "token_cache")
  return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


@pytest.fixture
def read_splits(monkeypatch):
  """The splits whose texts prepare_data reads, in order: listed (load_examples) or streamed
  (examples.stream: the training split, for the tokenizer's sample and for encoding)."""
  calls = []
  load, stream = run_data.examples_lib.load_examples, run_data.examples_lib.stream

  def recording_load(config, splits):
    calls.extend(splits)
    return load(config, splits)

  def recording_stream(config, split, *shard):
    calls.append(split)
    return stream(config, split, *shard)

  monkeypatch.setattr(run_data.examples_lib, "load_examples", recording_load)
  monkeypatch.setattr(run_data.examples_lib, "stream", recording_stream)
  return calls


def _in_memory(encoded: pipeline.Encoded) -> pipeline.Encoded:
  """A copy that does not change when the cache files it was mapped from are damaged."""
  return pipeline.Encoded({name: pipeline.Ragged(np.array(f.values), np.array(f.offsets))
                           for name, f in encoded.features.items()}, encoded.lengths)


def _same(a: pipeline.Encoded, b: pipeline.Encoded):
  assert a.lengths == b.lengths and set(a.features) == set(b.features)
  for name in a.features:
    np.testing.assert_array_equal(a.features[name].values, b.features[name].values)
    np.testing.assert_array_equal(a.features[name].offsets, b.features[name].offsets)


def test_second_start_reads_the_cache_not_the_corpus(tmp_path, local_config, read_splits):
  workdir = _workdir(tmp_path)
  examples, _, first = run_data.prepare_data(local_config, workdir, ("train", "validation"))
  assert len(first["train"]) == len(PAIRS) and list(examples) == ["validation"]
  (entry,) = _entries(workdir)
  assert entry.startswith("train-")
  # Read: the training texts for the tokenizer and to encode them, the validation texts.
  assert read_splits == ["train", "validation", "train"]
  _, _, again = run_data.prepare_data(local_config, workdir, ("train", "validation"))
  assert read_splits[3:] == ["validation"]  # no training texts read
  assert isinstance(again["train"].held[0].features["inputs"].values, np.memmap)
  _same(first["train"].held[0], again["train"].held[0])
  assert _entries(workdir) == [entry]


@pytest.mark.parametrize("change", ["data file", "config"])
def test_a_changed_corpus_or_setting_is_a_miss(tmp_path, local_config, change, read_splits):
  workdir = _workdir(tmp_path)
  _, _, first = run_data.prepare_data(local_config, workdir, ("train",))
  if change == "data file":
    _corpus(local_config.data_dir, PAIRS[:-1])  # one pair fewer (a new size and mtime)
    expected = len(PAIRS) - 1
  else:
    local_config.max_source_length = 6  # other truncation, other arrays
    expected = len(PAIRS)
  _, _, second = run_data.prepare_data(local_config, workdir, ("train",))
  assert read_splits[-1] == "train" and len(second["train"]) == expected
  assert len(_entries(workdir)) == 2  # a new entry beside the old one
  assert not np.array_equal(first["train"].held[0].features["inputs"].offsets,
                            second["train"].held[0].features["inputs"].offsets)


@pytest.mark.parametrize("damage", ["truncated array", "flipped byte", "no manifest"])
def test_a_damaged_entry_is_rebuilt(tmp_path, local_config, damage, read_splits):
  workdir = _workdir(tmp_path)
  _, _, first = run_data.prepare_data(local_config, workdir, ("train",))
  first = _in_memory(first["train"].held[0])
  (entry,) = _entries(workdir)
  folder = os.path.join(workdir, "token_cache", entry)
  values = os.path.join(folder, "targets.values.npy")
  if damage == "truncated array":
    with open(values, "r+b") as f:
      f.truncate(os.path.getsize(values) - 8)
  elif damage == "flipped byte":
    with open(values, "r+b") as f:
      f.seek(-3, os.SEEK_END)
      byte = f.read(1)
      f.seek(-3, os.SEEK_END)
      f.write(bytes([byte[0] ^ 0xFF]))
  else:
    os.remove(os.path.join(folder, token_cache.MANIFEST))
  _, _, rebuilt = run_data.prepare_data(local_config, workdir, ("train",))
  assert read_splits == ["train", "train", "train"]  # tokenizer, encoded, encoded again
  _same(first, rebuilt["train"].held[0])
  assert token_cache.load(workdir_lib.path(folder)) is not None  # and cached again


def test_shards_are_encoded_and_cached_apart(tmp_path, local_config):
  workdir = _workdir(tmp_path)
  _, _, whole = run_data.prepare_data(local_config, workdir, ("train",))
  local_config.data_shards = 3
  _, _, sharded = run_data.prepare_data(local_config, workdir, ("train",))
  assert sharded["train"].count == 3 and sorted(sharded["train"].held) == [0, 1, 2]
  assert len(_entries(workdir)) == 4
  whole_entry, *shard_entries = _entries(workdir)
  assert shard_entries == [f"{whole_entry}-shard{s}of3" for s in range(3)]
  for shard, data in sharded["train"].held.items():  # example i in shard i % 3
    _same(data, whole["train"].held[0].subset(range(shard, len(PAIRS), 3)))


def test_the_training_split_can_be_read_whole_to_be_scored(tmp_path, local_config):
  workdir = _workdir(tmp_path)
  examples, _, encoded = run_data.prepare_data(local_config, workdir, ("train",), training=False)
  assert len(examples["train"]) == len(encoded["train"]) == len(PAIRS)
  assert isinstance(encoded["train"], pipeline.Encoded) and not _entries(workdir)
