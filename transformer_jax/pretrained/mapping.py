"""Weight-name tables between Hugging Face state dicts and this project's parameter trees,
and what every architecture module reads config.json with (`config_value`, `activation`,
`rope_fields`, `window_fields`).

An architecture module (architecture.py says what one offers) lists its tensors once, as
`Entry`s: our parameter path (`Layer` spells the paths inside a layer), the checkpoint's
tensor name(s), and how one becomes the other. Import and export both read that table, so
the two directions cannot drift apart.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Callable, Iterable

import numpy as np

from transformer_jax.pretrained import vocab as vocab_lib


# Hugging Face activation names (transformers' ACT2FN keys) -> this project's ffn_activation.
ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}
# The gated form (a GLU: the activation of one projection times another) of each.
GATED = {"gelu": "geglu", "relu": "reglu", "gelu_tanh": "geglu_tanh", "silu": "swiglu"}
# transformers' RoPE types (rope_parameters' rope_type) that layers.rope_frequencies computes.
ROPE_TYPES = ("default", "linear", "llama3")
# A sliding-window layer in config.json's layer_types (an 'L' of sliding_window_pattern).
SLIDING = "sliding_attention"


def config_value(hf: dict, key: str, default):
  """config.json's value, or `default` where it is missing or null."""
  value = hf.get(key)
  return default if value is None else value


def activation(hf: dict, key: str, default: str, *, name: str | None = None) -> str:
  """Our ffn_activation for config.json's `key` (or the given HF `name`); ValueError naming
  the supported ones otherwise."""
  name = name or config_value(hf, key, default)
  if name not in ACTIVATIONS:
    raise ValueError(f"{key}={name!r} is not supported; supported: {sorted(ACTIVATIONS)}.")
  return ACTIVATIONS[name]


def rope_fields(hf: dict, parameters: dict | None = None,
                default_theta: float = 10000.0) -> dict:
  """TransformerConfig's RoPE fields (position_base, rope_scaling and what its kind reads) of
  RoPE `parameters` (one layer type's, where transformers 5 keys rope_parameters by layer
  type), by default config.json's `rope_parameters` (transformers 5) over the older
  `rope_scaling`; the base from them, else config.json's `rope_theta`, else `default_theta`."""
  if parameters is None:
    parameters = dict(config_value(hf, "rope_scaling", {}) or {})
    parameters.update(config_value(hf, "rope_parameters", {}) or {})
  kind = parameters.get("rope_type", parameters.get("type", "default"))
  if kind not in ROPE_TYPES:
    raise ValueError(f"rope type {kind!r} is not supported; supported: {list(ROPE_TYPES)}")
  base = parameters.get("rope_theta", config_value(hf, "rope_theta", default_theta))
  fields = dict(position_base=float(base), rope_scaling="none" if kind == "default" else kind)
  if kind != "default":
    fields["rope_scaling_factor"] = float(parameters["factor"])
  if kind == "llama3":
    fields.update(rope_low_freq_factor=float(parameters["low_freq_factor"]),
                  rope_high_freq_factor=float(parameters["high_freq_factor"]),
                  rope_original_max_len=int(parameters["original_max_position_embeddings"]))
  return fields


def window_fields(window: int | None, layer_types: list[str]) -> dict:
  """TransformerConfig's sliding_window and sliding_window_pattern of a window (None: none)
  over the layers whose config.json layer type is 'sliding_attention'. The pattern is the
  shortest that repeats into them ('LG' for Gemma 2's alternation, not one letter a layer)."""
  letters = "".join("L" if kind == SLIDING else "G" for kind in layer_types)
  if not window or "L" not in letters:
    return dict(sliding_window=0, sliding_window_pattern="L")
  period = next(p for p in range(1, len(letters) + 1)
                if all(letters[i] == letters[i % p] for i in range(len(letters))))
  return dict(sliding_window=int(window), sliding_window_pattern=letters[:period])


class Layer:
  """Our parameter paths inside layer `index` of `stack` ('encoder' or 'decoder')."""

  def __init__(self, stack: str, index: int):
    self.path = (stack, f"layer_{index}")

  def attention(self, kind: str = "self") -> tuple[str, ...]:
    """'self' or 'cross' attention's projections."""
    return self.path + (f"{kind}_attention",)

  def attention_norm(self, kind: str = "self", name: str = "norm") -> tuple[str, ...]:
    """The norm before the attention ('norm'), or after it ('post_norm': post_sublayer_norm)."""
    return self.path + (f"{kind}_attention_block", name)

  def ffn(self, name: str) -> tuple[str, ...]:
    """A feed-forward projection: 'wi', 'wi_gate' (gated FFNs) or 'wo'."""
    return self.path + ("ffn", name)

  def ffn_norm(self, name: str = "norm") -> tuple[str, ...]:
    """The norm before the feed-forward network ('norm'), or after it ('post_norm')."""
    return self.path + ("ffn_block", name)


def grouped(fields: dict) -> bool:
  """Whether the model has fewer key/value heads than query heads (separate 'query' and 'kv'
  projections in self-attention, as attention.py builds them)."""
  return fields.get("num_kv_heads") not in (0, None, fields["num_heads"])


@dataclasses.dataclass(frozen=True)
class Entry:
  """One parameter of ours and the checkpoint tensors it is made of.

  kind:
    'copy'       the same array (norm scales and biases, relative-bias tables)
    'dense'      a torch Linear weight [out, in] -> our kernel [in, out]
    'heads_in'   Linear weights [h * d, emb] (one per part: q, k, v) -> [emb, parts, h, d]
                 (h: the key/value heads where `kv`)
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
  kv: bool = False  # heads_in / heads_bias of keys and values: num_kv_heads heads


@dataclasses.dataclass(frozen=True)
class Shapes:
  """What conversions need besides the arrays."""
  num_heads: int
  head_dim: int
  vocab: vocab_lib.VocabMap
  num_kv_heads: int

  @classmethod
  def of(cls, fields: dict, vocab: vocab_lib.VocabMap) -> "Shapes":
    """The shapes of a model with TransformerConfig `fields`."""
    heads = fields["num_heads"]
    return cls(heads, fields["qkv_dim"] // heads, vocab, fields.get("num_kv_heads") or heads)

  def heads(self, entry: Entry) -> int:
    return self.num_kv_heads if entry.kv else self.num_heads


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
    emb, heads = arrays[0].shape[1], s.heads(entry)
    fused = np.empty((emb, len(arrays), heads, s.head_dim), arrays[0].dtype)
    for i, w in enumerate(arrays):
      fused[:, i] = transpose(w).reshape(emb, heads, s.head_dim)
    return fused
  if k == "heads_bias":
    return np.stack([b.reshape(s.heads(entry), s.head_dim) for b in arrays], axis=0)
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
                      self_attention: bool, bias: bool, grouped_heads: bool = False,
                      out_bias: bool | None = None) -> list[Entry]:
  """One attention layer: q/k/v fused as ours are ('qkv' in self-attention; 'query' + 'kv' in
  cross-attention and with `grouped_heads`, see `grouped`), then the output projection.
  `names` gives the checkpoint's q, k, v, o module names under `hf`; `bias`: q/k/v biases,
  `out_bias` (default `bias`): the output projection's."""
  q, k, v, o = (f"{hf}.{names[part]}" for part in ("q", "k", "v", "o"))
  groups = ([("qkv", (q, k, v))] if self_attention and not grouped_heads
            else [("query", (q,)), ("kv", (k, v))])
  entries = []
  for name, parts in groups:
    kv = name == "kv"
    entries.append(Entry(ours + (name, "kernel"), tuple(f"{p}.weight" for p in parts),
                         "heads_in", kv=kv))
    if bias:
      entries.append(Entry(ours + (name, "bias"), tuple(f"{p}.bias" for p in parts),
                           "heads_bias", kv=kv))
  entries.append(Entry(ours + ("out", "kernel"), (f"{o}.weight",), "heads_out"))
  if bias if out_bias is None else out_bias:
    entries.append(Entry(ours + ("out", "bias"), (f"{o}.bias",)))
  return entries


def qk_norm_entries(ours: tuple[str, ...], hf: str) -> list[Entry]:
  """An attention layer's per-head query and key norms (qk_norm): `hf`.q_norm / .k_norm."""
  return [Entry(ours + ("query_norm", "scale"), (f"{hf}.q_norm.weight",)),
          Entry(ours + ("key_norm", "scale"), (f"{hf}.k_norm.weight",))]


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


# *ForCausalLM checkpoints of Llama's layout (Llama, Mistral, Qwen, Gemma).
CAUSAL_LM_EMBEDDING, CAUSAL_LM_OUTPUT = "model.embed_tokens.weight", "lm_head.weight"
_CAUSAL_LM_ATTENTION = dict(q="q_proj", k="k_proj", v="v_proj", o="o_proj")


def causal_lm_table(fields: dict,
                    layer_entries: Callable[[Layer, str], list[Entry]]) -> list[Entry]:
  """Every parameter of our DecoderOnly from a checkpoint of Llama's layout: the token
  embedding; per layer its self-attention (q/k/v/o_proj, and q_norm / k_norm with `qk_norm`),
  the attention's input_layernorm, then `layer_entries(layer, 'model.layers.N')` (the
  feed-forward network and its norms, which differ between the models); model.norm; an
  untied lm_head."""
  table = [Entry(("embedding", "embedding", "embedding"), (CAUSAL_LM_EMBEDDING,), "vocab_rows")]
  for i in range(fields["num_layers"]):
    layer, hf_layer = Layer("decoder", i), f"model.layers.{i}"
    table += attention_entries(layer.attention(), f"{hf_layer}.self_attn", _CAUSAL_LM_ATTENTION,
                               self_attention=True, bias=fields["qkv_bias"],
                               out_bias=fields["out_bias"], grouped_heads=grouped(fields))
    if fields.get("qk_norm"):
      table += qk_norm_entries(layer.attention(), f"{hf_layer}.self_attn")
    table += norm_entries(layer.attention_norm(), f"{hf_layer}.input_layernorm", bias=False)
    table += layer_entries(layer, hf_layer)
  table += norm_entries(("decoder", "final_norm"), "model.norm", bias=False)
  if not fields["tie_output"]:
    table.append(Entry(("logits_dense", "kernel"), (CAUSAL_LM_OUTPUT,), "vocab_dense"))
  return table


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
