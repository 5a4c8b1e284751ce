"""The encoded training split, cached in the workdir: tokenized once, memory-mapped on restart.

WORKDIR/token_cache/train-KEY/ (train-KEY-shardSofN/ for shard S of N data shards) holds one
.npy file per array of the split's `Encoded` (each feature's flat token values and offsets,
the labels) and `manifest.json`, written last, with every array's shape, dtype and CRC32. KEY
hashes everything the arrays depend on: the tokenizer, the family and its feature lengths, the
overlong policy, the data keys of the config and, for a local `data_dir` or Hugging Face
dataset, the name, size and modification time of every file in it. So a changed tokenizer, setting or data file is a miss,
encoded anew into a new entry. An entry that does not match its manifest (a killed write, a
damaged file) is logged, removed and rebuilt.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zlib

import ml_collections
import numpy as np
from absl import logging

from transformer_jax import workdir as workdir_lib
from transformer_jax.data import pipeline

MANIFEST = "manifest.json"
# Config keys that decide which examples a split holds (with the data files themselves).
DATA_KEYS = ("task", "dataset", "data_dir", "local", "tfds", "huggingface", "demo", "splits",
             "mixture", "directions", "language_codes", "source_lang", "target_lang",
             "data_seed", "label_names", "max_source_length", "max_target_length",
             "overlong", "prompt_format", "prompt_template", "system_prompt")


def _data_files(data_dir: str) -> list[tuple[str, int, int]]:
  """(relative path, size, mtime in ns) of every file under a local `data_dir`."""
  found = []
  for root, _, names in os.walk(data_dir):
    for name in names:
      path = os.path.join(root, name)
      stat = os.stat(path)
      found.append((os.path.relpath(path, data_dir), stat.st_size, stat.st_mtime_ns))
  return sorted(found)


def key(config: ml_collections.ConfigDict, family_name: str, feature_lengths: dict,
        tokenizer_proto: bytes, split: str) -> str:
  """What the encoded `split` depends on, hashed."""
  settings = config.to_dict()
  data = {k: settings[k] for k in DATA_KEYS if k in settings}
  if config.get("data_dir") and os.path.isdir(config.data_dir):
    data["files"] = _data_files(config.data_dir)
  if config.get("dataset") == "huggingface":
    from transformer_jax.data import hf_source  # pylint: disable=g-import-not-at-top
    data["hf_files"] = [(path, _data_files(path)) if os.path.isdir(path) else
                        (path, os.stat(path).st_size, os.stat(path).st_mtime_ns)
                        for path in hf_source.local_paths(config)]
  description = json.dumps(dict(data=data, family=family_name, split=split,
                                 lengths=feature_lengths,
                                 tokenizer=hashlib.sha256(tokenizer_proto).hexdigest()),
                            sort_keys=True, default=str)
  return hashlib.sha256(description.encode()).hexdigest()[:20]


def entry(workdir: str, split: str, cache_key: str, shard: int = 0, shard_count: int = 1):
  """The folder of one shard of `split` (of several: the name says which)."""
  name = f"{split}-{cache_key}" + (f"-shard{shard}of{shard_count}" if shard_count > 1 else "")
  return workdir_lib.path(workdir) / "token_cache" / name


def _arrays(encoded: pipeline.Encoded) -> dict[str, np.ndarray]:
  arrays = {}
  for name, ragged in encoded.features.items():
    arrays[f"{name}.values"], arrays[f"{name}.offsets"] = ragged.values, ragged.offsets
  if encoded.labels is not None:
    arrays["labels"] = np.asarray(encoded.labels)
  return arrays


def save(folder, encoded: pipeline.Encoded) -> None:
  """Writes `encoded` into `folder` (a path or URL); the manifest goes last, so a write cut
  short is never taken for an entry."""
  folder.mkdir(parents=True, exist_ok=True)
  manifest = {"lengths": encoded.lengths, "arrays": {}}
  for name, array in _arrays(encoded).items():
    array = np.ascontiguousarray(array)
    with (folder / f"{name}.npy").open("wb") as f:  # written from the array: no copy of it
      np.save(f, array)
    manifest["arrays"][name] = dict(shape=list(array.shape), dtype=str(array.dtype),
                                    crc32=zlib.crc32(array.data))
  workdir_lib.write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1).encode())


def _load_array(path, local: bool) -> np.ndarray:
  if local:  # memory-mapped: pages are read as batches need them, and shared with the OS cache
    return np.load(os.fspath(path), mmap_mode="r")
  return np.load(io.BytesIO(path.read_bytes()))


def load(folder) -> pipeline.Encoded | None:
  """The entry in `folder`, or None when there is none; a damaged one is removed (and None)."""
  manifest_path = folder / MANIFEST
  if not manifest_path.exists():
    return None
  try:
    manifest = json.loads(manifest_path.read_text())
    local = not workdir_lib.is_url(os.fspath(folder))
    arrays = {}
    for name, expected in manifest["arrays"].items():
      array = _load_array(folder / f"{name}.npy", local)
      if (list(array.shape) != expected["shape"] or str(array.dtype) != expected["dtype"]
          or zlib.crc32(np.ascontiguousarray(array).data) != expected["crc32"]):
        raise ValueError(f"{name}.npy does not match the manifest")
      arrays[name] = array
    features = {name[:-len(".values")]: pipeline.Ragged(array, arrays[
        name[:-len(".values")] + ".offsets"]) for name, array in arrays.items()
                if name.endswith(".values")}
    return pipeline.Encoded(features, manifest["lengths"], arrays.get("labels"))
  except (OSError, ValueError, KeyError) as e:
    logging.warning("Token cache %s is damaged (%s); removing it and encoding again.", folder, e)
    folder.rmtree(missing_ok=True)
    return None
