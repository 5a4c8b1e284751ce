"""Weight-name tables between Hugging Face state dicts and this project's parameter trees
(and `config_value`, the architectures' one reading of config.json values).

An architecture module (t5.py, bart.py, marian.py) lists its tensors once, as `Entry`s: our
parameter path, the checkpoint's tensor name(s), and how one becomes the other. Import and
export both read that table, so the two directions cannot drift apart.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Callable, Iterable

import numpy as np

from transformer_jax.pretrained import vocab as vocab_lib


def config_value(hf: dict, key: str, default):
  """config.json's value, or `default` where it is missing or null."""
  value = hf.get(key)
  return default if value is None else value


@dataclasses.dataclass(frozen=True)
class Entry:
  """One parameter of ours and the checkpoint tensors it is made of.

  kind:
    'copy'       the same array (norm scales and biases, relative-bias tables)
    'dense'      a torch Linear weight [out, in] -> our kernel [in, out]
    'heads_in'   Linear weights [h * d, emb] (one per part: q, k, v) -> [emb, parts, h, d]
    'heads_bias' Linear biases [h * d] (one per part) -> [parts, h, d]
    'heads_out'  the output Linear weight [emb, h * d] -> [h, d, emb]
    'vocab_rows' an embedding [vocab, emb], rows renumbered (vocab.VocabMap)
    'vocab_dense' an output Linear weight [vocab, emb] -> kernel [emb, vocab], renumbered
    'vocab_bias' a logits bias [1, vocab] (or [vocab]) -> [vocab], renumbered
    'offset_rows' learned positions stored `offset` rows late (BART, RoBERTa) -> rows from 0
    'fused_in'   a Conv1D weight [emb, parts * h * d] (GPT-2's c_attn) -> [emb, parts, h, d]
    'fused_bias' its bias [parts * h * d] -> [parts, h, d]
    'fused_out'  a Conv1D output weight [h * d, emb] -> [h, d, emb]
  """
  path: tuple[str, ...]
  hf: tuple[str, ...]
  kind: str = "copy"
  offset: int = 0


@dataclasses.dataclass(frozen=True)
class Shapes:
  """What conversions need besides the arrays."""
  num_heads: int
  head_dim: int
  vocab: vocab_lib.VocabMap


def transpose(matrix: np.ndarray, block: int = 64) -> np.ndarray:
  """A C-contiguous copy of `matrix.T`, a band of rows at a time: several times faster than
  numpy's one-pass copy, whose reads or writes stride across the whole matrix (most of an
  import's time otherwise; benchmarks/RESULTS.md)."""
  out = np.empty(matrix.shape[::-1], matrix.dtype)
  for start in range(0, matrix.shape[0], block):
    out[:, start:start + block] = matrix[start:start + block].T
  return out


def to_ours(entry: Entry, arrays: list[np.ndarray], s: Shapes) -> np.ndarray:
  """The checkpoint's arrays of `entry` -> our parameter."""
  k = entry.kind
  if k == "copy":
    return arrays[0]
  if k == "dense":
    return transpose(arrays[0])
  if k == "heads_in":
    emb = arrays[0].shape[1]
    fused = np.empty((emb, len(arrays), s.num_heads, s.head_dim), arrays[0].dtype)
    for i, w in enumerate(arrays):
      fused[:, i] = transpose(w).reshape(emb, s.num_heads, s.head_dim)
    return fused
  if k == "heads_bias":
    return np.stack([b.reshape(s.num_heads, s.head_dim) for b in arrays], axis=0)
  if k == "heads_out":
    return transpose(arrays[0]).reshape(s.num_heads, s.head_dim, arrays[0].shape[0])
  if k == "vocab_rows":
    return s.vocab.rows_to_internal(arrays[0])
  if k == "vocab_dense":
    return transpose(s.vocab.rows_to_internal(arrays[0]))
  if k == "vocab_bias":
    return s.vocab.rows_to_internal(arrays[0].reshape(-1))
  if k == "offset_rows":
    return arrays[0][entry.offset:]
  if k == "fused_in":
    return arrays[0].reshape(arrays[0].shape[0], -1, s.num_heads, s.head_dim)
  if k == "fused_bias":
    return arrays[0].reshape(-1, s.num_heads, s.head_dim)
  if k == "fused_out":
    return arrays[0].reshape(s.num_heads, s.head_dim, -1)
  raise ValueError(f"Unknown conversion {k!r}.")


def to_hf(entry: Entry, value: np.ndarray, s: Shapes) -> list[np.ndarray]:
  """Our parameter -> the checkpoint's arrays of `entry` (the inverse of `to_ours`)."""
  k = entry.kind
  if k == "copy":
    return [value]
  if k == "dense":
    return [value.T]
  if k == "heads_in":
    emb = value.shape[0]
    return [value[:, i].reshape(emb, -1).T for i in range(value.shape[1])]
  if k == "heads_bias":
    return [value[i].reshape(-1) for i in range(value.shape[0])]
  if k == "heads_out":
    return [value.reshape(-1, value.shape[-1]).T]
  if k == "vocab_rows":
    return [s.vocab.rows_to_hf(value)]
  if k == "vocab_dense":
    return [s.vocab.rows_to_hf(value.T)]
  if k == "vocab_bias":
    return [s.vocab.rows_to_hf(value)[None, :]]
  if k == "offset_rows":
    # The rows before the offset are never read (positions start at `offset`).
    return [np.concatenate([np.zeros((entry.offset, value.shape[1]), value.dtype), value])]
  if k == "fused_in":
    return [value.reshape(value.shape[0], -1)]
  if k == "fused_bias":
    return [value.reshape(-1)]
  if k == "fused_out":
    return [value.reshape(-1, value.shape[-1])]
  raise ValueError(f"Unknown conversion {k!r}.")


def attention_entries(ours: tuple[str, ...], hf: str, names: dict[str, str], *,
                      self_attention: bool, bias: bool) -> list[Entry]:
  """One attention layer: q/k/v fused as ours are ('qkv' in self-attention, 'query' + 'kv' in
  cross-attention), then the output projection. `names` gives the checkpoint's q, k, v, o
  module names under `hf`."""
  q, k, v, o = (f"{hf}.{names[part]}" for part in ("q", "k", "v", "o"))
  groups = [("qkv", (q, k, v))] if self_attention else [("query", (q,)), ("kv", (k, v))]
  entries = []
  for name, parts in groups:
    entries.append(Entry(ours + (name, "kernel"), tuple(f"{p}.weight" for p in parts),
                         "heads_in"))
    if bias:
      entries.append(Entry(ours + (name, "bias"), tuple(f"{p}.bias" for p in parts),
                           "heads_bias"))
  entries.append(Entry(ours + ("out", "kernel"), (f"{o}.weight",), "heads_out"))
  if bias:
    entries.append(Entry(ours + ("out", "bias"), (f"{o}.bias",)))
  return entries


def dense_entries(ours: tuple[str, ...], hf: str, bias: bool) -> list[Entry]:
  entries = [Entry(ours + ("kernel",), (f"{hf}.weight",), "dense")]
  if bias:
    entries.append(Entry(ours + ("bias",), (f"{hf}.bias",)))
  return entries


def norm_entries(ours: tuple[str, ...], hf: str, bias: bool) -> list[Entry]:
  entries = [Entry(ours + ("scale",), (f"{hf}.weight",))]
  if bias:
    entries.append(Entry(ours + ("bias",), (f"{hf}.bias",)))
  return entries


def build_params(table: Iterable[Entry], read: Callable[[str], np.ndarray], s: Shapes,
                 dtype=np.float32) -> dict:
  """Our parameter tree from the checkpoint tensors `read(name)` gives. Entries are read and
  converted on every core (numpy's copies release the GIL), a few at a time, so memory holds
  the tree and no more than a core's worth of parameters beside it."""

  def convert(entry: Entry) -> np.ndarray:
    return np.ascontiguousarray(to_ours(entry, [read(name) for name in entry.hf], s),
                                dtype=dtype)

  params: dict = {}
  # At most 8 threads: more cores would hold more converted tensors at once for little gain.
  with concurrent.futures.ThreadPoolExecutor(min(os.cpu_count() or 1, 8)) as pool:
    for entry, value in zip(table, pool.map(convert, table)):
      node = params
      for key in entry.path[:-1]:
        node = node.setdefault(key, {})
      node[entry.path[-1]] = value
  return params


def state_dict(table: Iterable[Entry], params: dict, s: Shapes) -> dict[str, np.ndarray]:
  """The checkpoint tensors of our parameter tree."""
  tensors = {}
  for entry in table:
    value = params
    for key in entry.path:
      value = value[key]
    for name, array in zip(entry.hf, to_hf(entry, np.asarray(value, np.float32), s)):
      tensors[name] = np.ascontiguousarray(array)
  return tensors
