"""Weight-only quantization (config.quantization for inference, a QLoRA base; docs/
quantization.md), through qwix, Google's quantization library for Flax.

`quantized(model, spec)` is the same Flax model with qwix intercepting its projections'
matmuls: each reads its kernel as int8 or int4 values with float32 scales (one per output
channel, or per `group_size` inputs), dequantized into the matmul, which XLA fuses on
accelerators. `quantize_params` turns float parameters (a checkpoint's) into that layout, one
kernel at a time. Norms, biases and position tables stay float; so do a classifier's head and
pooler, and the token embedding and an untied output layer unless `spec.embeddings` (the
embedding then an `Int8Table`: qwix quantizes matmuls, not lookups).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model import remat

WEIGHT_TYPES = ("none", "int8", "int4")
_QTYPES = {"int8": jnp.int8, "int4": jnp.int4}
DEFAULT_INT4_GROUP = 128
LIBRARY = "qwix"  # imported where a model is quantized: float models never need it
# Entry points the families call with `method=` (each one intercepted; nested calls are
# quantized once).
_METHODS = ("__call__", "encode", "decode", "states", "logits")
# Projections that stay float: an untied output layer (unless asked), a classifier's head and
# pooler, and LoRA adapters (trained in float over a quantized base).
_OUTPUT_LAYER = "logits_dense"
_ALWAYS_FLOAT = (r"(.*/)?(head|pooler|pooling_query)", r".*_lora(/.*)?")


@dataclasses.dataclass(frozen=True)
class QuantizationSpec:
  """How a model's weights are held: `weights` 'int8' or 'int4', `group_size` inputs per scale
  (0: one scale per output channel; the attention output projection is grouped per head, at
  most `head_dim` wide), and whether the token embedding (int8) and an untied output layer
  are quantized too."""
  weights: str
  group_size: int = 0
  head_dim: int = 0
  embeddings: bool = False


def spec(config, head_dim: int) -> QuantizationSpec | None:
  """How a config's model holds its kernels (None: float, the default): config.quantization
  for inference, or a LoRA run's frozen base in config.lora.base_dtype 'int8' / 'int4'
  (QLoRA: the adapters train in float over it; int4 in config.quantization.group_size)."""
  quantization, lora = config.get("quantization") or {}, config.get("lora") or {}
  weights = quantization.get("weights", "none")
  if lora.get("rank") and lora.get("base_dtype") in _QTYPES:
    weights = lora["base_dtype"]
  if weights == "none":
    return None
  return QuantizationSpec(weights, group_size(weights, quantization.get("group_size", 0)),
                          head_dim, bool(quantization.get("embeddings", False)))


def group_size(weights: str, configured: int) -> int:
  """config.quantization.group_size as it applies to `weights`: 0 means one scale per output
  channel for int8 and groups of 128 for int4."""
  return int(configured) or (DEFAULT_INT4_GROUP if weights == "int4" else 0)


def rules(s: QuantizationSpec) -> list:
  """qwix's rules, first match wins: what stays float, then every other projection."""
  import qwix  # pylint: disable=import-outside-toplevel
  qtype = _QTYPES[s.weights]
  float_paths = _ALWAYS_FLOAT + (() if s.embeddings else (rf"(.*/)?{_OUTPUT_LAYER}",))
  found = [qwix.QuantizationRule(module_path=path) for path in float_paths]
  if s.group_size:
    # The attention output's kernel [heads, head_dim, emb] contracts two axes; qwix would
    # group only the last and share each scale across the heads: one group per head instead.
    head_group = min(s.group_size, s.head_dim) if s.head_dim else s.group_size
    found.append(qwix.QuantizationRule(module_path=r"(.*/)?out", weight_qtype=qtype,
                                       tile_size={0: 1, 1: head_group}))
  found.append(qwix.QuantizationRule(module_path=".*", weight_qtype=qtype,
                                     tile_size=s.group_size or None))
  return found


def quantized(model: nn.Module, s: QuantizationSpec | None) -> nn.Module:
  """`model` reading its projections' kernels as `s` holds them (itself where `s` is None).
  Gradients through its quantized products (LoRA over a quantized base) dequantize each
  kernel again in the backward pass (`recomputed_in_backward`)."""
  if s is None:
    return model
  import qwix  # pylint: disable=import-outside-toplevel
  methods = [name for name in _METHODS if hasattr(model, name)]
  return qwix.quantize_model(model, _provider(qwix, rules(s)), methods=methods)


def quantizes_weight_here() -> bool:
  """Whether qwix, tracing a quantized model, quantizes the kernel of the dot_general that the
  current Flax module is about to call (that kernel must then reach qwix as the module's own
  param). qwix's rule lookup is not public API: where it is missing, True. A float model
  never imports qwix: False."""
  if "qwix" not in sys.modules:
    return False
  try:
    from qwix._src import qconfig  # pylint: disable=import-outside-toplevel
    rule = qconfig.get_current_rule("dot_general")
  except (ImportError, AttributeError):
    return True
  return rule is not None and rule.weight_qtype is not None


def _provider(qwix, found: list):
  """qwix's PtqProvider for rules `found`, its products given through the provider's hooks
  for them (keyword arguments of qwix 0.1.8 that are not public API: where a qwix release
  lacks them, the plain provider, whose backward pass keeps the float kernels)."""
  try:
    from qwix._src.core import dot_general, einsum, qarray  # pylint: disable=import-outside-toplevel
    product = _dequantized_again_in_backward(dot_general.dot_general, qarray.QArray)
    return qwix.PtqProvider(
        found, _dot_general_fn=product,
        _einsum_fn=lambda *args, **kwargs: einsum.einsum(*args, _qwix_dot_general=product,
                                                         **kwargs))
  except (ImportError, AttributeError, TypeError):
    return qwix.PtqProvider(found)


def _dequantized_again_in_backward(qwix_dot_general, quantized_type):
  """qwix's dot_general, whose gradient (through its float input: LoRA over a quantized base
  trains through the base's products) dequantizes the kernel again (`recomputed_in_backward`)
  instead of keeping the forward pass's float copy. Otherwise every layer's float kernels
  stay alive from the forward pass to the backward (benchmarks/RESULTS.md, QLoRA): the memory
  a quantized base was to save."""

  def product(lhs, rhs, dimension_numbers, *args, **kwargs):
    if not isinstance(rhs, quantized_type) or not jnp.issubdtype(lhs.dtype, jnp.inexact):
      return qwix_dot_general(lhs, rhs, dimension_numbers, *args, **kwargs)
    return recomputed_in_backward(
        lambda x, kernel: qwix_dot_general(x, kernel, dimension_numbers, *args, **kwargs),
        lhs, rhs)

  return product


def recomputed_in_backward(apply, x: jax.Array, frozen: Any) -> jax.Array:
  """apply(x, frozen), linear in `x`, with `frozen` (quantized weights: no gradient) kept as
  it is for the backward pass, which recomputes what `apply` derives from it (a float copy of
  a kernel) rather than keeping the forward pass's."""

  x_like = jax.ShapeDtypeStruct(x.shape, x.dtype)

  @jax.custom_vjp
  def run(x, frozen):
    # Not differentiated. In a rematerialised layer (remat.py), which trains, it waits for x
    # as `forward` does; elsewhere (decoding) one row's NaN must not reach the others.
    return apply(x, remat.once_ready(x, frozen) if remat.rematerialising() else frozen)

  def forward(x, frozen):
    return apply(x, remat.once_ready(x, frozen)), frozen

  def backward(frozen, grad):
    _, transpose = jax.vjp(lambda v: apply(v, remat.once_ready(grad, frozen)),
                           jnp.zeros(x_like.shape, x_like.dtype))
    no_gradient = jax.tree.map(lambda v: np.zeros(v.shape, jax.dtypes.float0)
                               if not jnp.issubdtype(v.dtype, jnp.inexact)
                               else jnp.zeros_like(v), frozen)
    return transpose(grad)[0], no_gradient

  run.defvjp(forward, backward)
  return run(x, frozen)


def quantize_params(params: Any, abstract_quantized: Any) -> Any:
  """Float `params` (host or device arrays) in the layout of `abstract_quantized` (the
  quantized model's parameters from jax.eval_shape, boxed or not). Each kernel is quantized
  on its own, so no second float copy of the model is made; kernels quantized already (a GGUF
  file's) and the leaves that stay float are kept as they are."""
  import qwix  # pylint: disable=import-outside-toplevel
  from flax import traverse_util  # pylint: disable=import-outside-toplevel
  flat = traverse_util.flatten_dict(params)
  wanted = traverse_util.flatten_dict(abstract_quantized)
  for path, leaf in flat.items():
    target = wanted.get(path)  # quantized leaves are never boxed whole: their parts are
    if is_quantized(leaf) or not is_quantized(target):
      continue
    if isinstance(target, Int8Table):
      flat[path] = int8_table(leaf)
      continue
    one = traverse_util.unflatten_dict({path: jnp.asarray(leaf)})
    flat[path] = traverse_util.flatten_dict(qwix.quantize_params(one, abstract_quantized))[path]
  return traverse_util.unflatten_dict(flat)


def dequantized(params: Any) -> Any:
  """`params` with every quantized kernel back in float32 (its values as the model reads
  them): a QLoRA base merged with its adapters, or exported."""
  import qwix  # pylint: disable=import-outside-toplevel
  def back(x):
    if isinstance(x, Int8Table):
      return x.dequantized()
    return qwix.dequantize(x.array).astype(jnp.float32) if is_quantized(x) else x
  return jax.tree.map(back, params, is_leaf=is_quantized)


def is_quantized(leaf: Any) -> bool:
  """Whether a parameter leaf (not descended into) is a quantized kernel or table."""
  return (hasattr(leaf, "array") and hasattr(leaf, "how")) or isinstance(leaf, Int8Table)


# ---- The token embedding in int8 (qwix quantizes matmuls, not lookups) ------------------------

@flax.struct.dataclass
class Int8Table:
  """An embedding table [rows, width] as int8 `values` and one float32 scale per row
  [rows, 1] (symmetric absmax): a lookup gathers both, the tied output layer multiplies by the
  int8 values and scales each row's logit."""
  values: jax.Array
  scales: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  def lookup(self, ids: jax.Array) -> jax.Array:
    """Rows `ids` in float32: [..., width]."""
    return from_int8(jnp.take(self.values, ids, axis=0), jnp.take(self.scales, ids, axis=0))

  def dequantized(self) -> jax.Array:
    return from_int8(self.values, self.scales)

  def logits(self, y: jax.Array, dot) -> jax.Array:
    """float32 [..., rows]: `y` [..., width] times every row, `dot` (layers.float32_sum_dot)
    multiplying y by the int8 values in y's dtype, each logit then scaled. Differentiated (a
    QLoRA step), the values are converted a block of rows at a time, forward and backward, so
    that no converted copy of the whole table (545 MB in float32 for Qwen2.5's 151,936 x 896)
    lives through the step; decoding and evaluation convert it whole, the faster way on the
    CPU."""
    return _table_logits(y, self.values, self.scales, dot)


# Rows of an int8 table converted at a time by `Int8Table.logits`: 32 MB in float32.
_TABLE_BLOCK_BYTES = 32 * 2**20


def _block_rows(rows: int, width: int) -> int:
  return min(rows, max(256, _TABLE_BLOCK_BYTES // (4 * width)))


def _vocab_shards(rows: int) -> int:
  """The devices the table's rows are split over (the jit layout's 'tensor' axis, where it
  divides them), 1 elsewhere: blocks are taken within each device's rows, so that slicing
  one never gathers the table across them."""
  mesh = jax.sharding.get_abstract_mesh()
  shards = 1 if mesh.empty else dict(mesh.shape).get("tensor", 1)
  return shards if rows % shards == 0 else 1


def _shard_rows(values: jax.Array) -> tuple[jax.Array, int, int]:
  """`values` [rows, width] as [shards, rows per shard, width] (`_vocab_shards`), the rows
  per shard and the rows of a block of them."""
  values = values.reshape(_vocab_shards(values.shape[0]), -1, values.shape[1])
  return values, values.shape[1], _block_rows(values.shape[1], values.shape[2])


def _table_blocks(rows: int, i, block: int):
  """Block `i` of `block` rows among `rows`: its first row (the last block ends at the end,
  overlapping the one before) and its rows that no block before it has (a mask)."""
  start = jnp.minimum(i * block, rows - block)
  return start, start + jnp.arange(block) >= i * block


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _table_logits(y, values, scales, dot):
  logits = dot(y, values.astype(y.dtype), (((y.ndim - 1,), (1,)), ((), ())))
  return logits * scales[:, 0]


def _blockwise_logits(y, values, scales, dot):
  """The logits, a block of each shard's rows at a time: values [shards, rows per shard,
  width], logits [..., shards, rows per shard] until the end."""
  values, rows, block = _shard_rows(values)
  shards = values.shape[0]
  dims = (((y.ndim - 1,), (2,)), ((), ()))

  def add_block(i, logits):
    start, _ = _table_blocks(rows, i, block)
    part = jax.lax.dynamic_slice_in_dim(values, start, block, axis=1).astype(y.dtype)
    return jax.lax.dynamic_update_slice_in_dim(logits, dot(y, part, dims), start, axis=-1)

  logits = jnp.zeros(y.shape[:-1] + (shards, rows), jnp.float32)
  logits = jax.lax.fori_loop(0, -(-rows // block), add_block, logits)
  return logits.reshape(y.shape[:-1] + (shards * rows,)) * scales[:, 0]


def _blockwise_logits_forward(y, values, scales, dot):
  return _blockwise_logits(y, values, scales, dot), (y, values, scales)


def _blockwise_logits_backward(dot, residuals, grads):
  """y's gradient, block by block (of each shard's rows); the table is frozen (int8): it has
  none."""
  y, values, scales = residuals
  values, rows, block = _shard_rows(values)
  grads = (grads * scales[:, 0]).reshape(grads.shape[:-1] + (values.shape[0], rows))
  dims = (((grads.ndim - 2, grads.ndim - 1), (0, 1)), ((), ()))

  def add_block(i, y_grad):
    start, fresh = _table_blocks(rows, i, block)
    # float32 products (the block budget counts 4 bytes a value): a bfloat16 model's
    # gradient is not rounded before its sum over the vocabulary.
    part = jax.lax.dynamic_slice_in_dim(values, start, block, axis=1).astype(jnp.float32)
    part_grads = jnp.where(fresh, jax.lax.dynamic_slice_in_dim(grads, start, block, axis=-1), 0)
    return y_grad + dot(part_grads, part, dims)

  y_grad = jax.lax.fori_loop(0, -(-rows // block), add_block, jnp.zeros(y.shape, jnp.float32))
  return y_grad.astype(y.dtype), None, None


_table_logits.defvjp(_blockwise_logits_forward, _blockwise_logits_backward)


def absmax_int8(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """`x` in int8 along `axis`: each vector over its largest magnitude, times 127 (symmetric
  absmax), and its float32 scale (that axis kept, of size 1)."""
  x = jnp.asarray(x, jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / 127.0
  q = jnp.round(x / jnp.where(scale == 0, 1.0, scale))
  return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def from_int8(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """`absmax_int8`'s values back in `dtype`."""
  return (q.astype(jnp.float32) * scale).astype(dtype)


def int8_table(table: jax.Array) -> Int8Table:
  """`table` [rows, width] in int8, a scale per row (`absmax_int8`)."""
  return Int8Table(*absmax_int8(table, axis=1))


def int8_table_init(init, names: tuple[str, str]):
  """A parameter initializer: `init`'s table in int8, values and scales with the logical axis
  `names` (the scales' second axis unsharded)."""
  def make(key, shape, dtype=jnp.float32):
    table = int8_table(init(key, shape, dtype))
    return Int8Table(nn.LogicallyPartitioned(table.values, names),
                     nn.LogicallyPartitioned(table.scales, (names[0], None)))
  return make


def parameter_bytes(params: Any) -> int:
  """Bytes the parameters hold (int4: half a byte per value)."""
  total = 0
  for leaf in jax.tree.leaves(params):
    bits = jnp.iinfo(leaf.dtype).bits if jnp.issubdtype(leaf.dtype, jnp.integer) \
        else jnp.finfo(leaf.dtype).bits
    total += leaf.size * bits // 8
  return total


def group_problem(group_size: int, model_config) -> str | None:
  """Why groups of `group_size` inputs cannot tile this model's kernels (None: they can). qwix
  groups a kernel's last input axis: emb_dim for the attention and feed-forward inputs,
  mlp_dim for the feed-forward output, a head's width for the attention output (whose groups
  shrink to it where it is narrower)."""
  if group_size <= 0:
    return f"config.quantization.group_size={group_size} must be positive"
  head_dim = model_config.qkv_dim // model_config.num_heads
  widths = [("model.emb_dim", model_config.emb_dim, "the attention and feed-forward inputs"),
            ("model.mlp_dim", model_config.mlp_dim, "the feed-forward output's input")]
  if head_dim > group_size:
    widths.append(("a head's width (model.qkv_dim / model.num_heads)", head_dim,
                   "the attention output's input"))
  for key, width, what in widths:
    if width % group_size:
      return (f"config.quantization.group_size={group_size} does not divide {key}={width} "
              f"({what}): use a divisor of it (e.g. {_largest_divisor(width, group_size)})")
  return None


def _largest_divisor(width: int, at_most: int) -> int:
  return max(d for d in range(1, min(width, at_most) + 1) if width % d == 0)

