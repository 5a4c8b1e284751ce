"""Readers for a researcher's own corpora in a local folder (`config.data_dir`).

Formats (`config.local.format`):
  parallel     line-aligned files `{split}.{source_lang}` / `{split}.{target_lang}`, plain or .gz
               (translation: Multi30k, IWSLT, Tatoeba layouts);
  jsonl        `{split}.jsonl[.gz]`, one JSON object per line with source / target fields
               (summarization: DialogSum);
  tsv          `{split}.tsv[.gz]`, a text column and an integer label column (SST-2 / GLUE);
  label_lines  `{split}/{text_file}` and `{split}/{label_file}`, line-aligned (UIT-VSFC);
  label_files  one file of texts per label, no splits: a seeded 80/10/10 split is made here
               (rt-polarity).
Every reader returns a list of examples: {'source', 'target'} or {'source', 'label'} dicts;
`iter_parallel` and `iter_jsonl` stream them, for training splits of millions of examples.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
from typing import Iterator, Sequence

import numpy as np

from transformer_jax.data import prompt_format


def find_file(data_dir: str, name: str) -> str:
  """`data_dir/name`, or its `.gz`; a clear error naming both when neither exists."""
  path = os.path.join(data_dir, name)
  for candidate in (path, path + ".gz"):
    if os.path.exists(candidate):
      return candidate
  raise FileNotFoundError(
      f"Neither {path} nor {path}.gz exists. Point --config.data_dir at the dataset's folder "
      f"(it holds {os.listdir(data_dir) if os.path.isdir(data_dir) else 'nothing: no such folder'})"
      " or set the split's file name in config.splits.")


def _open(path: str):
  return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def iter_lines(path: str, encoding: str = "utf-8") -> Iterator[str]:
  """The file's lines without their line ends, read as they are asked for (a corpus of
  millions of lines is never held whole); gzip when the name ends in .gz."""
  # newline="\n": only \n ends a line. Universal newlines would also split on \r, and
  # str.splitlines on \x85 or \u2028 inside a sentence, silently misaligning a parallel corpus.
  with io.TextIOWrapper(_open(path), encoding=encoding, errors="replace", newline="\n") as f:
    for line in f:
      yield line.rstrip("\n").rstrip("\r")


def read_lines(path: str, encoding: str = "utf-8") -> list[str]:
  return list(iter_lines(path, encoding))


def count_lines(path: str) -> int:
  """How many lines `iter_lines` yields, counted in blocks without decoding (a second for a
  few hundred MB); for encodings that write \n as the byte 0x0A, such as UTF-8."""
  count, last = 0, b"\n"
  with _open(path) as f:
    while block := f.read(1 << 24):
      count += block.count(b"\n")
      last = block[-1:]
  return count + (last != b"\n")


def iter_aligned(paths: Sequence[str], encoding: str = "utf-8") -> Iterator[tuple[str, ...]]:
  """Line i of every file, as tuples, streamed; files of different lengths are an error,
  raised before the first line (the files are counted first)."""
  counts = [count_lines(path) for path in paths]
  if len(set(counts)) > 1:
    listing = ", ".join(f"{path}: {count} lines" for path, count in zip(paths, counts))
    raise ValueError(f"Misaligned corpus: {listing}. Line i of each file must belong to the "
                     "same example; fix or re-export the files so they have equal line counts.")
  return zip(*(iter_lines(path, encoding) for path in paths))


def read_aligned(paths: Sequence[str], encoding: str = "utf-8") -> list[tuple[str, ...]]:
  return list(iter_aligned(paths, encoding))


def iter_parallel(data_dir: str, split_file: str, source_lang: str,
                  target_lang: str) -> Iterator[dict]:
  paths = [find_file(data_dir, f"{split_file}.{lang}") for lang in (source_lang, target_lang)]
  return ({"source": s, "target": t} for s, t in iter_aligned(paths))


def read_parallel(data_dir: str, split_file: str, source_lang: str,
                  target_lang: str) -> list[dict]:
  return list(iter_parallel(data_dir, split_file, source_lang, target_lang))


def _first_present(names: str, available) -> str | None:
  """The first of the '|'-separated `names` that is in `available` (files differ between
  splits: SST-2's dev header says 'content' where train says 'sentence')."""
  return next((name for name in names.split("|") if name in available), None)


def iter_jsonl(data_dir: str, split_file: str, source_field: str,
               target_field: str, messages_field: str = "") -> Iterator[dict]:
  """Fields may list alternatives, 'summary|summary1': the first present is used. With
  `messages_field`, each record is a chat conversation (prompt_format.conversation_example)."""
  path = find_file(data_dir, f"{split_file}.jsonl")
  for number, line in enumerate(iter_lines(path), start=1):
    if not line.strip():
      continue
    if messages_field:
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {number}: not JSON ({e}).") from None
      yield prompt_format.conversation_example(
          record.get(messages_field) if isinstance(record, dict) else None,
          f"{path}, line {number}, field {messages_field!r}")
      continue
    try:
      record = json.loads(line)
      yield {"source": str(record[_first_present(source_field, record)]),
             "target": str(record[_first_present(target_field, record)])}
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise ValueError(f"{path}, line {number}: not a JSON object with fields "
                       f"{source_field!r} and {target_field!r} ({e!r}). Set config.local."
                       "source_field / target_field to the file's field names.") from None


def read_jsonl(data_dir: str, split_file: str, source_field: str, target_field: str) -> list[dict]:
  return list(iter_jsonl(data_dir, split_file, source_field, target_field))


def _label(value: str, where: str) -> int:
  try:
    return int(value.strip())
  except ValueError:
    raise ValueError(f"{where}: label {value!r} is not an integer class id.") from None


def read_tsv(data_dir: str, split_file: str, text_column: str, label_column: str) -> list[dict]:
  """A TSV file with a header row naming its columns (GLUE layout); column names may list
  alternatives, 'sentence|content'."""
  path = find_file(data_dir, f"{split_file}.tsv")
  text = "\n".join(read_lines(path))
  rows = csv.DictReader(io.StringIO(text), delimiter="\t", quoting=csv.QUOTE_NONE)
  text_name = _first_present(text_column, rows.fieldnames or [])
  label_name = _first_present(label_column, rows.fieldnames or [])
  if text_name is None or label_name is None:
    raise ValueError(f"{path}: header {rows.fieldnames} lacks the columns {text_column!r} and "
                     f"{label_column!r}; set config.local.text_column / label_column.")
  return [{"source": row[text_name], "label": _label(row[label_name], f"{path}:{i + 2}")}
          for i, row in enumerate(rows)]


def read_label_lines(data_dir: str, split_file: str, text_file: str,
                     label_file: str) -> list[dict]:
  paths = [find_file(os.path.join(data_dir, split_file), name) for name in (text_file, label_file)]
  return [{"source": text, "label": _label(label, paths[1])}
          for text, label in read_aligned(paths)]


def read_label_files(data_dir: str, files: Sequence[str], encoding: str, seed: int
                     ) -> dict[str, list[dict]]:
  """Label i = the lines of files[i]; split 80/10/10 into train / validation / test by a
  seeded permutation, so every run (and predict) sees the same held-out examples."""
  examples = [{"source": line, "label": label}
              for label, name in enumerate(files)
              for line in read_lines(find_file(data_dir, name), encoding) if line.strip()]
  order = np.random.default_rng(seed).permutation(len(examples))
  n_test = n_validation = len(examples) // 10
  pick = lambda indices: [examples[i] for i in indices]
  return {"test": pick(order[:n_test]),
          "validation": pick(order[n_test:n_test + n_validation]),
          "train": pick(order[n_test + n_validation:])}
