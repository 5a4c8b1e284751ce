"""Layer-wise learning-rate decay for fine-tuning (BERT / ELECTRA / BEiT recipes).

Every parameter gets a depth from its path in the parameter tree, 0 (the embeddings) to
L + 1 (the output layers), and its update is scaled by `decay ** (L + 1 - depth)`: the top
learns at the full rate, each layer below at `decay` times the rate of the one above it.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import optax

# Parameters that turn tokens into the first layer's input, in every family.
EMBEDDINGS = frozenset({
    "embedding", "positions", "token_types", "embedding_norm",  # classifier, decoder-only
    "shared_embedding", "source_embedding", "target_embedding", "encoder_positions",
    "decoder_positions", "encoder_embedding_norm", "decoder_embedding_norm",  # enc-dec
})
# The layer stacks, bottom to top: an encoder-decoder's decoder layers sit above its encoder's.
STACKS = ("encoder", "decoder")
_NUMBERED = re.compile(r"(layer|relative_bias)_(\d+)")


def stack_sizes(paths: Iterable[Sequence[str]]) -> dict[str, int]:
  """{stack: number of layers} of the stacks in `paths` ('encoder/layer_3/...' -> 4 or more)."""
  sizes = {}
  for names in paths:
    if len(names) > 1 and names[0] in STACKS:
      match = _NUMBERED.fullmatch(names[1])
      if match and match.group(1) == "layer":
        sizes[names[0]] = max(sizes.get(names[0], 0), int(match.group(2)) + 1)
  return sizes


def depth(names: Sequence[str], sizes: dict[str, int]) -> int:
  """The depth of the parameter at path `names`, for a model whose stacks have `sizes` layers.

  With L the layers of all stacks together (an encoder-decoder counts its encoder layers,
  then its decoder layers, as one stack of L = encoder + decoder layers):
    0          the embeddings: token, position and token-type embeddings and the norm after
               them (`EMBEDDINGS`; a shared source/target embedding, also the tied output
               layer, is an embedding);
    i + 1      layer i of that one stack (0 = the bottom), with its relative position bias
               when the stack has one per layer (`relative_bias_i`); a stack's one shared
               bias (`relative_bias`) goes with the stack's first layer, where T5 keeps it;
    L + 1      everything else: the stacks' final norms, the pooler, the pooling query, the
               classifier head, the untied output layer and the logits bias.

  Args:
    names: the parameter's path, e.g. ('decoder', 'layer_0', 'ffn', 'wi', 'kernel').
    sizes: `stack_sizes` of the model's parameter paths.

  Returns:
    The depth, from 0 to L + 1.
  """
  total = sum(sizes.values())
  if names[0] in EMBEDDINGS:
    return 0
  if names[0] in sizes and len(names) > 1:
    below = sum(sizes[s] for s in STACKS[:STACKS.index(names[0])] if s in sizes)
    match = _NUMBERED.fullmatch(names[1])
    if match:
      return below + int(match.group(2)) + 1
    if names[1] == "relative_bias":
      return below + 1
  return total + 1


def _path_names(path) -> tuple[str, ...]:
  # Boxed parameters (nn.Partitioned) add an attribute step ('.value') to a leaf's path: only
  # the dict keys name the parameter.
  return tuple(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))


def multipliers(tree: Any, decay: float) -> Any:
  """`tree` (parameters, boxed or not, or anything shaped like them) with every leaf replaced
  by its learning-rate multiplier `decay ** (L + 1 - depth)` (a Python float)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [_path_names(path) for path, _ in leaves]
  sizes = stack_sizes(paths)
  top = sum(sizes.values()) + 1
  return jax.tree.unflatten(treedef, [float(decay) ** (top - depth(p, sizes)) for p in paths])


def scale_by_layer_decay(decay: float) -> optax.GradientTransformation:
  """Scales each leaf of the updates by its `multipliers` factor. Placed last in the chain,
  after Adam's normalisation, the learning rate and AdamW's decoupled weight decay, so it
  scales each layer's learning rate (scaling the gradient instead would be undone by Adam).

  Stateless: the multipliers come from the updates' own paths on every (traced) call, so the
  same transformation serves boxed and unboxed trees under either layout.
  """

  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None):
    del params
    scaled = jax.tree.map(lambda u, m: u * jnp.asarray(m, u.dtype), updates,
                          multipliers(updates, decay))
    return scaled, state

  return optax.GradientTransformation(init, update)
