"""Attention heatmaps: the attention weights of one example, drawn with its tokens on the axes.

Each evaluation writes the layers and heads that `config.attention_images` chooses, of every
attention kind the model has (encoder self-, decoder self- and cross-attention), for the first
generated validation example to TensorBoard; `--mode attention` draws them for any sentence
from a trained workdir into one PNG. The weights come from a teacher-forced forward pass over
the source and the model's own output (families.py `attention_weights`).
"""

from __future__ import annotations

import dataclasses
import io
import re
from typing import Sequence

import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from transformer_jax import tokenizer as tokenizer_lib

KINDS = {"encoder_self": "encoder self-attention", "decoder_self": "decoder self-attention",
         "cross": "cross-attention"}


@dataclasses.dataclass
class AttentionMap:
  """One layer's weights of one attention kind, and the tokens its queries and keys read."""
  kind: str  # a key of KINDS
  layer: int
  weights: np.ndarray  # [heads, queries, keys], rows sum to 1
  query_ids: list[int]
  key_ids: list[int]


def _kind(path: str) -> str:
  if "cross_attention" in path:
    return "cross"
  return "encoder_self" if path.startswith("encoder/") else "decoder_self"


def collect(family, params, prompt: np.ndarray, output: np.ndarray) -> list[AttentionMap]:
  """Every attention layer's map for `prompt` (the encoded source, EOS included) and `output`
  (generated ids, EOS included); kinds in KINDS order, layers in order."""
  through_eos = lambda ids: [int(i) for i in ids[:_eos_end(ids)]]
  weights, tokens = family.attention_weights(params, np.asarray(through_eos(prompt)),
                                             np.asarray(through_eos(output)))
  maps = []
  for path, value in weights.items():
    kind = _kind(path)
    layer = int(re.search(r"layer_(\d+)", path).group(1))
    queries, keys = tokens[kind]
    if not value.is_fully_addressable:  # sharded over several processes (a jit layout)
      value = multihost_utils.process_allgather(value, tiled=True)
    maps.append(AttentionMap(kind, layer, np.asarray(value)[0],
                             list(map(int, queries)), list(map(int, keys))))
  order = list(KINDS)
  return sorted(maps, key=lambda m: (order.index(m.kind), m.layer))


def _eos_end(ids: Sequence[int]) -> int:
  ids = [int(i) for i in ids]
  return ids.index(tokenizer_lib.EOS_ID) + 1 if tokenizer_lib.EOS_ID in ids else len(ids)


def chosen(maps: list[AttentionMap], images_config: ml_collections.ConfigDict
           ) -> list[tuple[AttentionMap, int]]:
  """(map, head) pairs of `images_config.layers` and `.heads` (negative: from the end), for
  every attention kind."""
  pairs = []
  for kind in KINDS:
    of_kind = [m for m in maps if m.kind == kind]
    for layer in sorted({l % len(of_kind) for l in images_config.layers
                         if -len(of_kind) <= l < len(of_kind)}):
      layer_map = of_kind[layer]
      num_heads = layer_map.weights.shape[0]
      pairs += [(layer_map, h) for h in sorted({h % num_heads for h in images_config.heads})]
  return pairs


def title(layer_map: AttentionMap, head: int) -> str:
  return f"{KINDS[layer_map.kind]}, layer {layer_map.layer}, head {head}"


def tag(layer_map: AttentionMap, head: int) -> str:
  """The TensorBoard tag of one image, e.g. attention/cross/layer_2/head_0."""
  return f"attention/{layer_map.kind}/layer_{layer_map.layer}/head_{head}"


def tensorboard_images(maps: list[AttentionMap], images_config: ml_collections.ConfigDict,
                       tokenizer: tokenizer_lib.Tokenizer) -> dict[str, bytes]:
  """One PNG per chosen (layer, head) of every kind, by TensorBoard tag."""
  return {tag(m, head): draw([(m, head)], tokenizer) for m, head in chosen(maps, images_config)}


def draw(pairs: list[tuple[AttentionMap, int]], tokenizer: tokenizer_lib.Tokenizer,
         columns: int = 0) -> bytes:
  """One PNG with a heatmap per (map, head), keys along x and queries along y, labelled with
  their tokens; `columns` per row (0: as many as the most heads of one layer)."""
  try:
    from matplotlib import figure  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError("Drawing attention needs matplotlib: pip install matplotlib.") from None
  if not pairs:
    raise ValueError("No attention map chosen: config.attention_images.layers and .heads "
                     "must each name at least one.")
  columns = columns or max(sum(m is layer_map for m, _ in pairs) for layer_map, _ in pairs)
  rows = -(-len(pairs) // columns)
  longest = max(max(len(m.query_ids), len(m.key_ids)) for m, _ in pairs)
  side = min(max(3.0, 0.28 * longest + 1.5), 16.0)  # inches: room for a label per token
  fig = figure.Figure(figsize=(side * columns, side * rows), dpi=80, layout="constrained")
  for i, (layer_map, head) in enumerate(pairs):
    axes = fig.add_subplot(rows, columns, i + 1)
    axes.imshow(layer_map.weights[head], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto",
                interpolation="nearest")
    axes.set_xticks(range(len(layer_map.key_ids)),
                    [tokenizer.id_to_piece(t) for t in layer_map.key_ids], rotation=90,
                    fontsize=8)
    axes.set_yticks(range(len(layer_map.query_ids)),
                    [tokenizer.id_to_piece(t) for t in layer_map.query_ids], fontsize=8)
    axes.set_xlabel("keys (attended to)")
    axes.set_ylabel("queries" if layer_map.kind == "encoder_self" else
                    "queries (the token each predicts)")
    axes.set_title(title(layer_map, head), fontsize=10)
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png")
  return buffer.getvalue()

