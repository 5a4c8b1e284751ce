"""The attention kernels as one table: what each one computes with, where it runs, which masks
and options it takes, and what 'auto' picks per platform.

`MultiHeadAttention` asks `choose` for a kernel per call (at trace time, from shapes alone) and
runs it with `run`; 'reference' (dot_product.py's einsums) takes every call and is what a call
falls back to when the kernel asked for cannot take it (one log line per kernel and reason).
`config_validation` reads `IMPLEMENTATIONS` and `config_refusal`, so adding a kernel is one
entry in `KERNELS`. This module imports nothing else of the project.

Masks reach a kernel two ways: as the dense boolean [b|1, 1, q, k] array every path can read,
and, where the model built it from its parts (`StructuredMask`: causal or not, segment ids
with 0 for padding, a sliding window), as those parts, which blockwise kernels (splash) need
instead of an array. A decoding step's mask has no parts (the cache's slots); a prefix LM's
neither (its prefix differs per row): kernels that need parts then fall back.

Padding queries: the reference gives a query that may attend to no key uniform weights;
kernels reading segment ids let a padding query (segment 0) attend to the padding keys. Those
rows carry no loss and no later query reads them, so only padding rows' outputs differ.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# Set (to 1) to let Pallas kernels of another platform run in interpret mode here (the tests
# check the TPU kernels on the CPU so): slow, for checking only.
INTERPRET_ENV = "TRANSFORMER_JAX_INTERPRET_KERNELS"


@flax.struct.dataclass
class StructuredMask:
  """A self- or cross-attention mask with the parts it was built from. `dense` [b|1, 1, q, k]
  is the mask itself (True = may attend); `query_segments` [b, q] / `key_segments` [b, k]
  are segment ids, 0 at padding (a query sees a key of its own segment only); `causal`: no
  later key; `window` > 0: only keys less than `window` positions before the query."""
  dense: Array
  query_segments: Array
  key_segments: Array
  causal: bool = flax.struct.field(pytree_node=False, default=False)
  window: int = flax.struct.field(pytree_node=False, default=0)


def split_mask(mask) -> tuple[Array | None, StructuredMask | None]:
  """(dense mask, its parts or None) of a call's mask argument."""
  if isinstance(mask, StructuredMask):
    return mask.dense, mask
  return mask, None


@dataclasses.dataclass(frozen=True)
class Call:
  """What a kernel must take of one attention call (all static at trace time)."""
  platform: str
  dtype: jnp.dtype
  queries: int
  keys: int
  heads: int
  kv_heads: int
  head_dim: int
  parts: StructuredMask | None  # None: a mask array alone, or no mask
  bias: bool
  softcap: bool

  @classmethod
  def of(cls, query: Array, key: Array, mask=None, *, bias: Array | None = None,
         softcap: float = 0.0, platform: str | None = None) -> "Call":
    return cls(platform or jax.default_backend(), query.dtype, query.shape[1], key.shape[1],
               query.shape[2], key.shape[2], query.shape[3], split_mask(mask)[1],
               bias is not None, bool(softcap))


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One table entry. `platforms`: where it runs natively; a Pallas kernel (`pallas`) runs
  elsewhere in interpret mode only where INTERPRET_ENV is set. `dense_masks`: takes any mask
  array; otherwise it needs the mask's parts, of which it implements `windows` or not.
  `run(query, key, value, dense, parts, bias, scale, softcap, interpret)` -> [b, q, h, d]."""
  name: str
  summary: str
  platforms: tuple[str, ...]
  run: Callable | None  # None: dot_product.py's reference einsums
  dense_masks: bool = True
  windows: bool = True
  bias: bool = True
  softcap: bool = True
  half_precision_only: bool = False
  head_dims: Callable[[int], bool] = lambda d: True
  head_dims_text: str = ""
  min_queries: int = 1
  length_multiple: int = 1  # query and key lengths
  pallas: bool = False
  module: str | None = None  # the package it needs, where that is not jax
  # What differs on one platform (field: value): a package's kernels per platform are not
  # the same kernel.
  on_platform: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)

  def on(self, platform: str) -> Kernel:
    """This entry as it is on `platform` (interpreted elsewhere, a Pallas kernel is its TPU
    one)."""
    platform = platform if platform in self.platforms else "tpu"
    return dataclasses.replace(self, **self.on_platform.get(platform, {}))

  def refusal(self, call: Call) -> str | None:
    """Why this kernel cannot take `call`, None if it can."""
    if self.module and importlib.util.find_spec(self.module) is None:
      return f"needs the {self.module} package (pip install {self.module})"
    if call.platform not in self.platforms and not (self.pallas and interpreting()):
      return f"runs on {'/'.join(self.platforms)}, not {call.platform}"
    return self.on(call.platform)._limits(call)

  def _limits(self, call: Call) -> str | None:
    if self.half_precision_only and call.dtype not in (jnp.bfloat16, jnp.float16):
      return f"needs bfloat16 or float16 inputs, not {jnp.dtype(call.dtype).name}"
    if not self.head_dims(call.head_dim):
      return f"needs a head dimension {self.head_dims_text}, not {call.head_dim}"
    if call.queries < self.min_queries:
      return f"needs at least {self.min_queries} queries per row (a decoding step has 1)"
    if call.queries % self.length_multiple or call.keys % self.length_multiple:
      return (f"needs lengths that are multiples of {self.length_multiple}, not "
              f"{call.queries} queries and {call.keys} keys")
    if call.bias and not self.bias:
      return "takes no score bias (relative position bias)"
    if call.softcap and not self.softcap:
      return "has no score soft-capping"
    if not self.dense_masks:
      if call.parts is None:
        return "needs the mask's parts (causal / segments / window), not a mask array"
      if call.parts.window and not self.windows:
        return "has no sliding window"
    return None


def interpreting() -> bool:
  return os.environ.get(INTERPRET_ENV, "") not in ("", "0")


# ----------------------------------------------------------------------------- jax.nn kernels
def _jax_nn(implementation: str):
  def run(query, key, value, dense, parts, bias, scale, softcap, interpret):
    del parts, softcap, interpret  # refused where set
    return _without_empty_rows(
        lambda mask: jax.nn.dot_product_attention(
            query, key, value, mask=mask, implementation=implementation,
            **_extra(query, bias, scale)),
        query, value, dense, guard=implementation == "cudnn")
  return run


def _extra(query, bias, scale) -> dict:
  extra = {}  # only what is set: the call is the plain one otherwise
  if bias is not None:
    extra["bias"] = bias.astype(query.dtype)
  if scale is not None:
    extra["scale"] = scale
  return extra


def _without_empty_rows(attend: Callable[[Array | None], Array], query: Array, value: Array,
                        dense: Array | None, guard: bool) -> Array:
  """`attend(mask)` with no query row that may attend to no key, when `guard`: such a row (a
  padding query; a packed target segment without source) has a hugely negative log-sum-exp,
  and with an explicit mask and a length of 64 mod 128 (Multi30k's 64-token rows) cuDNN's
  Hopper backward kernel then returns NaN in dQ (pytorch/pytorch#196678, issue #18's NaN
  loss). Those rows attend to every key, then get the reference path's result instead:
  uniform weights, the mean of the values."""
  if dense is None:
    return attend(None)
  dense = jnp.broadcast_to(dense, (query.shape[0], 1, query.shape[1], value.shape[1]))
  if not guard:
    return attend(dense)
  empty = ~jnp.any(dense, axis=-1)  # [b, 1, q]
  out = attend(dense | empty[..., None])
  mean = jnp.mean(value, axis=1, keepdims=True, dtype=jnp.float32).astype(out.dtype)
  # Per query head (a grouped key/value head's mean serves its g query heads): [b, 1, h, d].
  mean = jnp.repeat(mean, query.shape[2] // value.shape[2], axis=2)
  return jnp.where(empty[:, 0, :, None, None], mean, out)  # [b, q, h, d]


# ----------------------------------------------------------------------------- tokamax
def _tokamax(query, key, value, dense, parts, bias, scale, softcap, interpret):
  """tokamax's flash attention: Triton on a GPU, Mosaic on a TPU; the mask array read
  blockwise, causality (where the parts say so) skipping blocks. (tokamax 0.0.12's Mosaic
  GPU kernel fails under jax 0.11.2 on an H200: "Mesh.__init__() got an unexpected keyword
  argument 'out_shape'", so the GPU takes its Triton kernel.)"""
  from absl import flags  # pylint: disable=import-outside-toplevel
  import tokamax  # pylint: disable=import-outside-toplevel  # only where it is asked for
  if not flags.FLAGS.is_parsed():
    # tokamax reads its absl flags, parsing sys.argv first if nobody has: a program whose
    # arguments are argparse's would stop there. Its defaults are what we want.
    flags.FLAGS.mark_as_parsed()
  causal = bool(parts and parts.causal)
  attend = lambda q, k, v, mask, implementation: tokamax.dot_product_attention(
      q, k, v, bias=None if bias is None else bias.astype(q.dtype), mask=mask, scale=scale,
      is_causal=causal, logits_soft_cap=softcap or None, implementation=implementation)
  if jax.default_backend() == "gpu":
    return _without_empty_rows(lambda mask: attend(query, key, value, mask, "triton"),
                               query, value, dense, guard=True)
  if interpret:
    _interpretable_tokamax()
  groups = query.shape[2] // key.shape[2]
  # tokamax 0.0.12's Mosaic TPU backward gives wrong key/value gradients for grouped heads
  # (checked in interpret mode: off by up to 3.5): each query head gets its own copy, whose
  # gradients the repeat sums back (the group's factor more key/value memory in the call).
  key, value = (jnp.repeat(x, groups, axis=2) for x in (key, value))
  # Its Mosaic TPU kernel takes one mask for the whole batch: one call per row.
  def one_row(q, k, v, mask):
    return attend(q[None], k[None], v[None], None if mask is None else mask[None], "mosaic")[0]

  per_row = jax.vmap(one_row, in_axes=(0, 0, 0, None if dense is None else 0))
  return _without_empty_rows(lambda mask: per_row(query, key, value, mask), query, value,
                             dense, guard=True)


@functools.lru_cache(maxsize=1)
def _interpretable_tokamax() -> None:
  """Lets tokamax's Mosaic TPU attention run here in Pallas interpret mode, for checking only
  (INTERPRET_ENV): tokamax 0.0.12 has no switch for it, so its splash kernel's default config
  is made to interpret and its forward and backward ops to accept this platform."""
  from tokamax._src.ops.attention import pallas_mosaic_tpu, pallas_mosaic_tpu_vjp  # pylint: disable=import-outside-toplevel
  splash_config = pallas_mosaic_tpu.splash.SplashConfig
  default = splash_config.get_default
  splash_config.get_default = lambda: dataclasses.replace(default(), interpret=True)
  for op in (pallas_mosaic_tpu.PallasMosaicTpuFlashAttention,
             pallas_mosaic_tpu_vjp.PallasMosaicTpuFlashAttentionVjp):
    op.supported_on = lambda self, device: True


# ----------------------------------------------------------------------------- splash (TPU)
_SPLASH_BLOCKS = (512, 256, 128)


@functools.lru_cache(maxsize=64)
def _splash_kernel(queries: int, keys: int, heads: int, grouped: bool, causal: bool,
                   window: int, softcap: float, interpret: bool):
  """A splash attention kernel for these static shapes and mask parts (built once: the mask's
  block structure is worked out on the host)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=import-outside-toplevel
      splash_attention_kernel as splash, splash_attention_mask as masks)
  shape = (queries, keys)
  mask = masks.CausalMask(shape) if causal else masks.FullMask(shape)
  if window:  # keys less than `window` positions back; later ones are causality's business
    local = masks.LocalMask(shape, window_size=(window - 1, None), offset=0)
    mask = masks.LogicalAnd(mask, local) if causal else local
  block_q = next(b for b in _SPLASH_BLOCKS if queries % b == 0)
  block_k = next(b for b in _SPLASH_BLOCKS if keys % b == 0)
  blocks = splash.BlockSizes(
      block_q=block_q, block_kv=block_k, block_kv_compute=block_k, block_q_dkv=block_q,
      block_kv_dkv=block_k, block_kv_dkv_compute=block_k, block_q_dq=block_q,
      block_kv_dq=block_k)
  make = splash.make_splash_mqa if grouped else splash.make_splash_mha
  return make(masks.MultiHeadMask([mask] * heads), block_sizes=blocks, head_shards=1,
              q_seq_shards=1, attn_logits_soft_cap=softcap or None, interpret=interpret)


def _splash(query, key, value, dense, parts, bias, scale, softcap, interpret):
  """JAX's splash attention (Pallas, Mosaic TPU): causal / full / windowed block masks built
  on the host, segment ids for padding and packing; grouped key/value heads as multi-query
  kernels, one per key/value head."""
  del dense, bias  # refused: the parts say everything
  b, q, h, d = query.shape
  n = key.shape[2]
  scale = d ** -0.5 if scale is None else scale
  # Splash reads [heads, length, d] per row and does not scale: queries pre-scaled.
  query = (query * jnp.asarray(scale, query.dtype)).transpose(0, 2, 1, 3)  # [b, h, q, d]
  key, value = (x.transpose(0, 2, 1, 3) for x in (key, value))  # [b, n, k, d]
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash  # pylint: disable=import-outside-toplevel
  segments = splash.SegmentIds(q=parts.query_segments.astype(jnp.int32),
                               kv=parts.key_segments.astype(jnp.int32))
  grouped = n != h
  kernel = _splash_kernel(q, key.shape[2], h // n if grouped else h, grouped, parts.causal,
                          parts.window, float(softcap), interpret)
  if grouped:  # [b, n, g, q, d]: each key/value head with its g query heads
    query = query.reshape(b, n, h // n, q, d)
    per_row = jax.vmap(lambda qs, k, v, s: kernel(qs, k, v, segment_ids=s),
                       in_axes=(0, 0, 0, None))
    out = jax.vmap(per_row, in_axes=(0, 0, 0, 0))(query, key, value, segments)
    out = out.reshape(b, h, q, d)
  else:
    out = jax.vmap(lambda qs, k, v, s: kernel(qs, k, v, segment_ids=s))(query, key, value,
                                                                       segments)
  return out.transpose(0, 2, 1, 3).astype(value.dtype)  # [b, q, h, d]


# ----------------------------------------------------------------------------- the table
_CUDNN_HEAD_DIMS = lambda d: d % 8 == 0 and d <= 256

KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("reference", "this project's einsums (attention.dot_product_attention): every "
           "mask, bias, soft-cap, dropout and the weights", ("cpu", "gpu", "tpu"), None),
    Kernel("xla", "jax.nn.dot_product_attention's XLA path: mask arrays and bias",
           ("cpu", "gpu", "tpu"), _jax_nn("xla"), softcap=False),
    Kernel("cudnn", "cuDNN flash attention through jax.nn: mask arrays and bias, 16-bit",
           ("gpu",), _jax_nn("cudnn"), softcap=False, half_precision_only=True,
           head_dims=_CUDNN_HEAD_DIMS, head_dims_text="that is a multiple of 8 up to 256",
           min_queries=2),
    Kernel("tokamax", "tokamax flash attention (Triton on a GPU: mask arrays, bias, "
           "soft-cap; Mosaic on a TPU v5 or later: mask arrays (any: prefix LMs too), "
           "soft-cap, grouped heads, lengths in whole 128-blocks)", ("gpu", "tpu"), _tokamax,
           min_queries=2, pallas=True, module="tokamax",
           on_platform={"tpu": dict(bias=False, length_multiple=128)}),
    Kernel("splash", "JAX's splash attention (Pallas TPU): causal / full / sliding-window "
           "masks with segment ids (padding, packing), soft-cap, grouped heads",
           ("tpu",), _splash, dense_masks=False, bias=False, length_multiple=128, pallas=True),
)}
IMPLEMENTATIONS = ("auto",) + tuple(KERNELS)

# What 'auto' tries per backend (jax.default_backend()), first one that takes the call, else
# the reference. GPU: on an H100, cuDNN made the Transformer-base step 21% faster than 'xla'
# (benchmarks/RESULTS.md, GPU section). TPU: splash, as MaxText runs it (the reference would
# hold every [heads, length, length] score), then tokamax's Mosaic kernel (checked in interpret
# mode only) for the calls splash cannot take (a prefix LM's mask, which has no parts). CPU:
# the reference, on which the CPU's decoding speed and every exactness test were measured.
AUTO_ORDER: dict[str, tuple[str, ...]] = {"gpu": ("cudnn",), "tpu": ("splash", "tokamax")}

_warned: set[tuple[str, str]] = set()


def choose(implementation: str, call: Call) -> str:
  """The kernel that runs `call` for `implementation` ('auto' or a KERNELS name): 'auto' the
  first of its platform's AUTO_ORDER that takes the call; a named kernel that cannot take it
  falls back to the reference, with one log line per kernel and reason."""
  if implementation == "auto":
    return next((name for name in AUTO_ORDER.get(call.platform, ())
                 if KERNELS[name].refusal(call) is None), "reference")
  if implementation not in KERNELS:
    raise ValueError(f"Unknown attention implementation {implementation!r}: use one of "
                     f"{', '.join(IMPLEMENTATIONS)}.")
  why = KERNELS[implementation].refusal(call)
  if why is None:
    return implementation
  if (implementation, why) not in _warned:
    _warned.add((implementation, why))
    logging.info("attention_implementation=%r %s: this call runs the reference.",
                 implementation, why)
  return "reference"


def run(name: str, query: Array, key: Array, value: Array, mask, *, bias: Array | None = None,
        scale: float | None = None, softcap: float = 0.0) -> Array | None:
  """Kernel `name` (not the reference) on one call: [b, q, h, d] like the reference; None
  where a kernel of another package fails to build for this call (that package against this
  jax: tokamax 0.0.12's GPU kernels under jax 0.11.2), logged once: run the reference."""
  dense, parts = split_mask(mask)
  kernel = KERNELS[name]
  interpret = jax.default_backend() not in kernel.platforms
  if kernel.module is None:
    return _per_shard(kernel, query, key, value, dense, parts, bias, scale, softcap, interpret)
  try:
    return _per_shard(kernel, query, key, value, dense, parts, bias, scale, softcap, interpret)
  except Exception as error:  # pylint: disable=broad-except  # the package's own failure
    why = f"failed here ({type(error).__name__}: {str(error).splitlines()[0][:160]})"
    if (name, why) not in _warned:
      _warned.add((name, why))
      logging.warning("attention_implementation=%r %s: this call runs the reference.", name,
                      why)
    return None


def _per_shard(kernel: Kernel, query: Array, key: Array, value: Array, dense: Array | None,
               parts: StructuredMask | None, bias: Array | None, scale: float | None,
               softcap: float, interpret: bool) -> Array:
  """`kernel` on one call; a Pallas kernel under the jit layout's mesh (jax.set_mesh) on each
  device's own rows (data x fsdp) and heads (tensor, where it divides both the query and the
  key/value heads), as the layout's rules shard them, since XLA cannot split a kernel call.
  Other kernels, no mesh or one device: the plain call."""
  if parts is not None:  # the array travels once (as `dense`), to the kernels that read it
    parts = parts.replace(dense=None)
  if not kernel.dense_masks:
    dense = None
  call = lambda q, k, v, dense, parts, bias: kernel.run(q, k, v, dense, parts, bias, scale,
                                                        softcap, interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if not kernel.pallas or mesh.empty or mesh.size == 1:
    return call(query, key, value, dense, parts, bias)
  sizes = dict(mesh.shape)
  rows = tuple(a for a in ("data", "fsdp") if sizes.get(a, 1) > 1)
  if query.shape[0] % int(np.prod([sizes[a] for a in rows])):
    rows = ()
  rows = rows or None
  tensor = sizes.get("tensor", 1)
  heads = "tensor" if tensor > 1 and not (query.shape[2] % tensor or key.shape[2] % tensor) \
      else None
  P = jax.sharding.PartitionSpec
  per_head = P(rows, None, heads, None)  # [b, length, heads, d]
  # [b|1, h|1, q, k] (a mask's head axis is 1): split where the axis is not broadcast
  square = lambda x: P(rows if x.shape[0] > 1 else None, heads if x.shape[1] > 1 else None)
  parts_spec = None if parts is None else parts.replace(
      dense=None, query_segments=P(rows, None), key_segments=P(rows, None))
  inputs = (query, key, value, dense, parts, bias)
  specs = (per_head, per_head, per_head, None if dense is None else square(dense), parts_spec,
           None if bias is None else square(bias))
  return jax.shard_map(call, in_specs=specs, out_specs=per_head, check_vma=False)(*inputs)


def config_refusal(implementation: str, platform: str | None, *, dtype: str, head_dim: int,
                   prefix_lm: bool, relative_bias: bool, softcap: bool) -> str | None:
  """Why a model config cannot run `implementation` at all on `platform` (None: wherever the
  kernel runs; a user's error before compilation), None if some of its calls can. Calls it
  takes only in part (a decoding step, a prefix LM's mask) fall back at run time."""
  if implementation == "auto" or implementation not in KERNELS:
    return None
  kernel = KERNELS[implementation]
  platform = platform or kernel.platforms[0]
  length = max(kernel.min_queries, kernel.on(platform).length_multiple)  # a call it takes
  call = Call(platform, jnp.dtype(dtype), length, length, 1, 1, head_dim,
              None if prefix_lm else _ANY_PARTS, relative_bias, softcap)
  why = kernel.refusal(call)
  if why is None:
    return None
  if prefix_lm and not kernel.dense_masks:
    why = "needs the mask's parts, which a prefix LM's mask (per-row prefixes) has not"
  return f"config.model.attention_implementation={implementation!r} {why}"


# Parts of some mask (NumPy: importing this module must not start a JAX backend).
_ANY_PARTS = StructuredMask(np.ones((1, 1, 1, 1), bool), np.ones((1, 1), np.int32),
                            np.ones((1, 1), np.int32))
