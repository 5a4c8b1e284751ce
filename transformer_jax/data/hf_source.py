"""Examples from Hugging Face datasets (`config.dataset = 'huggingface'`).

`config.huggingface.name` is one of:
  a Hub id          'knkarthick/dialogsum', 'wmt/wmt14' (+ `subset`, `revision`), read through
                    the library's cache, so HF_DATASETS_OFFLINE=1 / HF_HUB_OFFLINE=1 work once
                    it is cached;
  a saved dataset   a local or gs:// folder written by `DatasetDict.save_to_disk`;
  a folder of files Parquet / JSON lines / CSV named by split (train-*.parquet, test.jsonl,
                    ...), local or gs://, as `load_dataset(folder)` reads them;
  a builder         'parquet', 'json', 'csv', 'arrow' or 'text' with
                    `config.huggingface.data_files.<split>` (paths or globs, comma-separated).
Only this module imports `datasets`, and only a Hub id reaches the network.

Our splits map to the dataset's through `config.splits`; `config.huggingface.columns` names
the source / target / label fields, 'translation.en' for a field inside a dict column ('' =
the usual names, e.g. dialogue / summary, sentence / label). A ClassLabel label column gives
the class names (`apply_label_names`). Rows are read from the memory-mapped Arrow table a
chunk at a time, or from a stream with `streaming=True`: a split is never held as Python
objects. Example i is in data shard i % N as for every source, so the batches do not depend
on the number of hosts: a host gathers its shards' rows from the Arrow table by index, or, from
a stream, reads every row and keeps its own.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from typing import Any, Iterator

import ml_collections
import numpy as np
from absl import logging

from transformer_jax import tasks
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import prompt_format

BUILDERS = ("parquet", "json", "csv", "arrow", "text")
# Field names tried, in order, when config.huggingface.columns leaves one empty.
USUAL_COLUMNS = {
    "source": ("source", "src", "dialogue", "article", "document", "sentence", "text",
               "input", "inputs", "review", "content"),
    "target": ("target", "tgt", "summary", "highlights", "output", "outputs", "targets"),
    "label": ("label", "labels", "sentiment"),
}
_READ_CHUNK = 10_000  # rows converted to Python objects at a time


def _is_folder(name: str) -> bool:
  if workdir_lib.is_url(name):
    return workdir_lib.path(name).is_dir()
  return os.path.isdir(name)


def _is_saved_dataset(name: str) -> bool:
  folder = workdir_lib.path(name)
  return (folder / "dataset_dict.json").exists() or (folder / "state.json").exists()


def source_kind(name: str) -> str:
  """'builder', 'saved' (save_to_disk), 'folder' (files named by split) or 'hub'."""
  if name in BUILDERS:
    return "builder"
  if _is_folder(name):
    return "saved" if _is_saved_dataset(name) else "folder"
  if workdir_lib.is_url(name) or os.path.isabs(name) or name.startswith("."):
    raise FileNotFoundError(f"config.huggingface.name={name!r} is not a folder; give a "
                            "save_to_disk folder, a folder of data files or a Hub id.")
  return "hub"


def _what(config: ml_collections.ConfigDict) -> str:
  h = config.huggingface
  return repr(h.name) + (f" (subset {h.subset!r})" if h.subset else "")


def _split_error(config, split: str, available) -> ValueError:
  return ValueError(f"Dataset {_what(config)} has no split {config.splits[split]!r}; set "
                    f"--config.splits.{split} to one of {sorted(map(str, available))}.")


def _builder_files(config: ml_collections.ConfigDict) -> dict[str, list[str]]:
  """{dataset split: [path or glob, ...]} from config.huggingface.data_files."""
  files = {}
  for split, patterns in config.huggingface.data_files.items():
    if patterns:
      files[config.splits[split]] = [p.strip() for p in patterns.split(",") if p.strip()]
  if not files:
    raise ValueError(f"config.huggingface.name={config.huggingface.name!r} reads files: set "
                     "--config.huggingface.data_files.train=PATH (and .validation / .test).")
  return files


def _remote_folder_files(url: str) -> tuple[str, dict[str, list[str]]]:
  """(builder, {split: [file URL, ...]}) for a gs:// folder of data files: the library
  infers splits from file names only in local folders, so the same rules are applied here."""
  from datasets import data_files as data_files_lib  # pylint: disable=g-import-not-at-top
  from datasets import packaged_modules  # pylint: disable=g-import-not-at-top
  patterns = data_files_lib.get_data_patterns(url)
  files = data_files_lib.DataFilesDict.from_patterns(patterns, base_path=url)
  files = {str(split): list(paths) for split, paths in files.items()}
  extensions = {os.path.splitext(path)[1] for paths in files.values() for path in paths}
  by_extension = packaged_modules._EXTENSION_TO_MODULE  # pylint: disable=protected-access
  builders = {by_extension.get(e, (None,))[0] for e in extensions}
  if len(builders) != 1 or None in builders:
    raise ValueError(f"{url} holds files of types {sorted(extensions)}; keep one of Parquet, "
                     "JSON lines or CSV per folder.")
  return builders.pop(), files


def _config_key(config: ml_collections.ConfigDict, split: str) -> str:
  return json.dumps([config.huggingface.to_dict(), config.splits[split]], sort_keys=True)


# Hub datasets and bucket copies, opened once per process: the checks, the tokenizer's sample
# and the encoding all read the same split. Local data is opened anew each time (in
# milliseconds), so that a split read through is not kept mapped for the whole run.
_OPENED: dict[str, Any] = {}


def open_split(config: ml_collections.ConfigDict, split: str):
  """Our `split` of the dataset: a `datasets.Dataset` (memory-mapped Arrow) or, with
  `streaming`, an `IterableDataset`. Library errors become one line that says what to do."""
  name = config.huggingface.name
  kind = source_kind(name)
  if not (kind == "hub" or (kind != "builder" and workdir_lib.is_url(name))):
    return _open(config, split, kind)
  key = _config_key(config, split)
  if key not in _OPENED:
    _OPENED[key] = _open(config, split, kind)
  return _OPENED[key]


def _saved(name: str):
  """A save_to_disk folder; from a bucket, copied once to a local temporary folder (by the
  library) for all its splits."""
  return _saved_copy(name) if workdir_lib.is_url(name) else _load_saved(name)


@functools.lru_cache(maxsize=4)
def _saved_copy(name: str):
  return _load_saved(name)


def _load_saved(name: str):
  import datasets  # pylint: disable=g-import-not-at-top
  saved = datasets.load_from_disk(name)
  if isinstance(saved, datasets.Dataset):
    raise ValueError(f"{name} holds one dataset, not splits; save a DatasetDict "
                     "(DatasetDict(train=..., validation=..., test=...).save_to_disk).")
  return saved


def _saved_split(config: ml_collections.ConfigDict, split: str):
  """A split of a save_to_disk folder, by name or in the library's slice syntax
  ('train[:-872]', 'train[:5%]+validation'), as load_dataset reads them from the Hub."""
  import datasets  # pylint: disable=g-import-not-at-top
  saved, spec = _saved(config.huggingface.name), config.splits[split]
  if spec in saved:
    return saved[spec]
  try:
    parts = datasets.ReadInstruction.from_spec(spec).to_absolute(
        {name: len(data) for name, data in saved.items()})
  except (ValueError, AssertionError, KeyError):  # not a slice, or of a split not there
    raise _split_error(config, split, saved) from None
  return datasets.concatenate_datasets(
      [saved[part.splitname].select(range(part.from_, part.to)) for part in parts])


def _open(config: ml_collections.ConfigDict, split: str, kind: str):
  import datasets  # pylint: disable=g-import-not-at-top
  h, dataset_split = config.huggingface, config.splits[split]
  if kind == "saved":  # memory-mapped already: `streaming` would add nothing
    return _saved_split(config, split)
  if kind == "builder":
    args, kwargs = (h.name,), dict(data_files=_builder_files(config))
  elif kind == "folder" and workdir_lib.is_url(h.name):
    builder, files = _remote_folder_files(h.name)
    args, kwargs = (builder,), dict(data_files=files)
  else:
    args = (h.name, h.subset or None)
    kwargs = dict(revision=h.revision or None) if kind == "hub" else {}
  try:
    return datasets.load_dataset(*args, split=dataset_split, streaming=h.streaming, **kwargs)
  except datasets.exceptions.DatasetNotFoundError:
    raise ValueError(f"Hugging Face dataset {h.name!r} was not found on the Hub; check the "
                     "name (a gated or private one needs `hf auth login`).") from None
  except ConnectionError as e:
    raise ValueError(
        f"Dataset {_what(config)} is not in the local datasets cache and the Hub cannot be "
        f"reached ({str(e).split('(')[-1].rstrip(')')}): run once with network to cache it, or "
        "copy it here with save_to_disk and set config.huggingface.name to that folder."
    ) from None
  except FileNotFoundError as e:
    raise FileNotFoundError(f"Dataset {_what(config)}: {' '.join(str(e).split())}") from None
  except ValueError as e:
    message = " ".join(str(e).split())
    if message.startswith("Unknown split"):
      raise ValueError(f"Dataset {_what(config)}: {message} Set --config.splits.{split} to "
                       "one of them.") from None
    if "BuilderConfig" in message or "Config name is missing" in message:
      raise ValueError(f"Dataset {h.name!r}: {message} Set config.huggingface.subset.") from None
    raise ValueError(f"Dataset {_what(config)}: {message}") from None


# ---- Fields --------------------------------------------------------------------------------

def _field_path(config: ml_collections.ConfigDict, role: str, features: dict | None,
                split: str) -> list[str]:
  """The path of the `role` field ('translation.en' -> ['translation', 'en']), checked against
  the split's features when it has them (a stream whose files declare no schema has none)."""
  given = config.huggingface.columns[role]
  columns = sorted(features or {})
  if not given:
    found = [c for c in USUAL_COLUMNS[role] if c in (features or {})]
    if not found:
      hint = ""
      if "translation" in columns:
        langs = sorted(getattr(features["translation"], "languages", None) or
                       getattr(features["translation"], "keys", lambda: [])())
        hint = (f" (for the 'translation' dict: 'translation.{langs[0]}' / "
                f"'translation.{langs[-1]}')" if langs else "")
      raise ValueError(f"Dataset {_what(config)} has no usual {role} column among {columns}; "
                       f"set --config.huggingface.columns.{role}=NAME{hint}.")
    return [found[0]]
  path = given.split(".")
  if features is None:
    return path
  if given in features:  # a column whose name has a dot
    return [given]
  feature = features.get(path[0])
  for part in path[1:]:
    names = (getattr(feature, "languages", None) or
             (list(feature) if isinstance(feature, dict) else []))
    feature = feature[part] if isinstance(feature, dict) and part in feature else (
        part if part in names else None)
  if feature is None:
    raise ValueError(f"config.huggingface.columns.{role}={given!r} is not a field of "
                     f"{_what(config)} split {config.splits[split]!r}; its columns are "
                     f"{columns}.")
  return path


def class_names(config: ml_collections.ConfigDict, split: str = "train") -> list[str] | None:
  """The label column's ClassLabel names, or None when it holds plain ints or strings."""
  import datasets  # pylint: disable=g-import-not-at-top
  data = open_split(config, split)
  features = data.features
  path = _field_path(config, "label", features, split)
  feature = features.get(path[0]) if features and len(path) == 1 else None
  return list(feature.names) if isinstance(feature, datasets.ClassLabel) else None


def apply_label_names(config: ml_collections.ConfigDict) -> None:
  """A classification config takes the class names of a ClassLabel label column (its
  label_names then name what the ids mean); a class count that differs from
  config.model.num_classes is refused."""
  if config.dataset != "huggingface" or not tasks.has_labels(config.task):
    return
  names = class_names(config)
  if names is None:
    if len(config.label_names) != config.model.num_classes:
      raise ValueError(f"config.label_names has {len(config.label_names)} names but "
                       f"config.model.num_classes={config.model.num_classes}; the label "
                       f"column of {_what(config)} has no class names to take instead.")
    return
  if len(names) != config.model.num_classes:
    raise ValueError(f"Dataset {_what(config)} has {len(names)} classes ({', '.join(names)}) "
                     f"but config.model.num_classes={config.model.num_classes}; set "
                     f"--config.model.num_classes={len(names)}.")
  if list(config.label_names) != names:
    logging.info("Class names from the dataset's label column: %s.", names)
    config.label_names = names


def check(config: ml_collections.ConfigDict, splits) -> None:
  """Opens `splits` and checks the fields the task reads, before anything is written."""
  roles = tasks.example_fields(config.task)
  for split in splits:
    data = open_split(config, split)
    for role in roles:
      _field_path(config, role, data.features, split)


def _label(value, names: list[str], config, split: str) -> int:
  if isinstance(value, str):
    if value not in names:
      raise ValueError(f"Label {value!r} in split {config.splits[split]!r} of {_what(config)} "
                       f"is not one of config.label_names {names}.")
    return names.index(value)
  if not 0 <= int(value) < len(names):
    unlabeled = " (an unlabeled split: evaluate on one with labels)" if value == -1 else ""
    raise ValueError(f"Label {value} in split {config.splits[split]!r} of {_what(config)} is "
                     f"not a class id below {len(names)}{unlabeled}.")
  return int(value)


def _text(value) -> str:
  return "" if value is None else str(value)


def _column(table, path: list[str]) -> list:
  import pyarrow.compute as pc  # pylint: disable=g-import-not-at-top
  column = table.column(path[0])
  for part in path[1:]:
    column = pc.struct_field(column, part)
  return column.to_pylist()


def _nested(record: dict, path: list[str]):
  value = record
  for part in path:
    value = value[part]
  return value


def _rows_of_table(data, paths: dict[str, list[str]], shard_index: int,
                   shard_count: int) -> Iterator[dict[str, Any]]:
  """Rows shard_index, + shard_count, ... of a memory-mapped Dataset, as {role: value},
  converted a chunk at a time."""
  table = data.with_format("arrow")
  for start in range(0, len(data), _READ_CHUNK):
    stop = min(start + _READ_CHUNK, len(data))
    first = (shard_index - start) % shard_count  # the chunk's first row of this shard
    rows = np.arange(start + first, stop, shard_count)
    if not len(rows):
      continue
    chunk = table[start:stop] if shard_count == 1 else table[rows.tolist()]
    values = {role: _column(chunk, path) for role, path in paths.items()}
    for i in range(len(rows)):
      yield {role: column[i] for role, column in values.items()}


def stream(config: ml_collections.ConfigDict, split: str, shard_index: int = 0,
           shard_count: int = 1) -> tuple[Iterator[dict], int | None]:
  """Examples shard_index, shard_index + shard_count, ... of `split` (example i of the
  dataset in shard i % shard_count, as for every source), and how many (None for a stream
  of unknown length)."""
  import datasets  # pylint: disable=g-import-not-at-top
  data = open_split(config, split)
  classify = tasks.has_labels(config.task)
  roles = ("source", "label") if classify else ("source", "target")
  chats = bool(config.huggingface.columns.get("messages"))
  if chats:
    roles = ("messages",)
  paths = {role: _field_path(config, role, data.features, split) for role in roles}
  names = list(config.label_names)
  if isinstance(data, datasets.Dataset):  # memory-mapped Arrow, read by index
    rows = _rows_of_table(data, paths, shard_index, shard_count)
    total = len(range(shard_index, len(data), shard_count))
  else:  # a stream: every row passes, the shard's are kept
    rows = ({role: _nested(record, path) for role, path in paths.items()}
            for record in itertools.islice(data, shard_index, None, shard_count))
    known = getattr(getattr(data, "info", None), "splits", None) or {}
    size = known[config.splits[split]].num_examples if config.splits[split] in known else None
    total = len(range(shard_index, size, shard_count)) if size else None

  def examples():
    for row in rows:
      if chats:
        yield prompt_format.conversation_example(
            row["messages"], f"Dataset {_what(config)} split {split}, column "
                             f"{config.huggingface.columns.messages!r}")
      elif classify:
        yield {"source": _text(row["source"]), "label": _label(row["label"], names, config,
                                                               split)}
      else:
        yield {"source": _text(row["source"]), "target": _text(row["target"])}

  return examples(), total


def local_paths(config: ml_collections.ConfigDict) -> list[str]:
  """The local files and folders the dataset is read from (for the token cache's key), [] for
  the Hub and buckets, whose revision is the config's to pin."""
  h = config.huggingface
  if h.name in BUILDERS:
    import glob  # pylint: disable=g-import-not-at-top
    return sorted(path for patterns in h.data_files.values() if patterns
                  for p in patterns.split(",") if p.strip() and not workdir_lib.is_url(p)
                  for path in glob.glob(p.strip(), recursive=True))
  if not workdir_lib.is_url(h.name) and os.path.isdir(h.name):
    return [h.name]
  return []
