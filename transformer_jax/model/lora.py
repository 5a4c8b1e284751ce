"""Low-rank adapters (LoRA, Hu et al., 2021): the adapter module, which parameters train, and
the adapters folded back into the weights.

A targeted projection W (a Dense or DenseGeneral kernel, e.g. 'qkv' or 'wi') gets a sibling
module '<name>_lora' holding `a` [*in, rank] and `b` [rank, *out], and computes
x W + scale * dropout(x) a b. Fused projections ('qkv' and 'kv' in attention.py: one kernel
[emb, parts, heads, head_dim] for query, key and value) get one adapter per targeted part, as
PEFT gives q_proj, k_proj and v_proj one each: `a` [emb, parts, rank], `b` [parts, rank,
heads, head_dim]. `b` starts at zero, so an adapted model starts equal to its base.

Training differentiates only the adapters and a classifier's head (`split`): the base is a
constant of the step, so it has no gradient and no optimizer state.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import traverse_util

from transformer_jax.model.schema import LORA_TARGETS, LoraSpec

Array = jax.Array
SUFFIX = "_lora"
# Our projections and the target each of their parts answers to ('qkv' has three parts).
PROJECTION_TARGETS = {"qkv": ("query", "key", "value"), "query": ("query",),
                      "kv": ("key", "value"), "out": ("attention_out",),
                      "wi": ("ffn_in",), "wi_gate": ("ffn_in",), "wo": ("ffn_out",)}
# Projections whose kernels have a parts axis after the input: [emb, parts, heads, head_dim].
FUSED = ("qkv", "query", "kv")


def spec(config: ml_collections.ConfigDict) -> LoraSpec | None:
  """The adapters of `config.lora` (None with rank 0: none)."""
  lora = config.get("lora")
  if lora is None or not lora.rank:
    return None
  alpha = lora.rank if lora.alpha is None else lora.alpha
  return LoraSpec(int(lora.rank), float(alpha), float(lora.dropout), bool(lora.rslora),
                  targets(lora.targets))


def targets(value) -> tuple[str, ...]:
  """config.lora.targets ('all', a comma-separated string or a sequence) as a tuple of
  LORA_TARGETS; ValueError naming them for anything else."""
  names = value.split(",") if isinstance(value, str) else list(value)
  names = [n.strip() for n in names if n.strip()]
  if names == ["all"]:
    return LORA_TARGETS
  unknown = [n for n in names if n not in LORA_TARGETS]
  if unknown or not names:
    raise ValueError(f"config.lora.targets={value!r} matches no layer ({unknown or 'empty'}): "
                     f"use 'all' or some of {', '.join(LORA_TARGETS)}.")
  return tuple(dict.fromkeys(names))


def targeted_parts(lora: LoraSpec | None, projection: str) -> tuple[int, ...]:
  """The parts of `projection` (PROJECTION_TARGETS) that `lora` adapts."""
  if lora is None:
    return ()
  return tuple(i for i, target in enumerate(PROJECTION_TARGETS[projection])
               if target in lora.targets)


def _a_init(fan_in: int):
  # PEFT's kaiming_uniform(a=sqrt(5)) of lora_A: uniform within +-1/sqrt(fan_in).
  bound = 1.0 / math.sqrt(fan_in)
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound,
                                                                  bound)


class Adapter(nn.Module):
  """scale * dropout(x) a b, the low-rank update of projection `projection`; the caller adds it
  to the projection's output. `in_names` / `out_names`: the logical axes of the kernel's
  input and output dims (the adapter's are split the same way under a mesh)."""
  lora: LoraSpec
  projection: str
  in_names: tuple[str | None, ...]
  out_shape: tuple[int, ...]  # a fused projection's: one part's (heads, head_dim)
  out_names: tuple[str | None, ...]
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool) -> Array:
    rank, n_in = self.lora.rank, len(self.in_names)
    in_shape = x.shape[x.ndim - n_in:]
    parts = targeted_parts(self.lora, self.projection)
    fused = self.projection in FUSED
    lead = (len(parts),) if fused else ()
    # Per row: a leading axis of the batch's rows (at rest, of a server's stacked adapters).
    row = (x.shape[0],) if self.lora.per_row else ()
    a = self.param("a", nn.with_logical_partitioning(
        _a_init(math.prod(in_shape)), (*[None] * len(row), *self.in_names,
                                       *[None] * len(lead), None)),
                   (*row, *in_shape, *lead, rank))
    b = self.param("b", nn.with_logical_partitioning(
        nn.initializers.zeros_init(), (*[None] * len(row + lead), None, *self.out_names)),
                   (*row, *lead, rank, *self.out_shape))
    x = nn.Dropout(self.lora.dropout)(x, deterministic=deterministic)
    x, a, b = (v.astype(self.dtype) for v in (x, a, b))
    if self.lora.per_row:
      return self._per_row(x, a, b, len(parts) if fused else 0, parts)
    low = jnp.tensordot(x, a, axes=n_in) * jnp.asarray(self.lora.scale, self.dtype)
    if not fused:
      return jnp.tensordot(low, b, axes=1)  # [..., *out]
    # One update per part: [..., parts, rank] x [parts, rank, h * d] -> [..., parts, h, d].
    update = jnp.einsum("...pr,prz->...pz", low, b.reshape(len(parts), rank, -1))
    return _all_parts(update.reshape(*low.shape[:-1], *self.out_shape), self.projection,
                      parts)

  def _per_row(self, x: Array, a: Array, b: Array, fused_parts: int, parts) -> Array:
    """The update of row r with its own a[r], b[r]: x [rows, ..., *in] -> [rows, ..., *out]."""
    rows, rank, n_in = x.shape[0], self.lora.rank, len(self.in_names)
    middle = x.shape[1:x.ndim - n_in]
    flat_x = x.reshape(rows, -1, math.prod(x.shape[x.ndim - n_in:]))  # [rows, m, in]
    low = jnp.einsum("rmi,rik->rmk", flat_x, a.reshape(rows, flat_x.shape[-1], -1))
    low = low * jnp.asarray(self.lora.scale, self.dtype)
    if not fused_parts:
      update = jnp.einsum("rmk,rko->rmo", low, b.reshape(rows, rank, -1))
      return update.reshape(rows, *middle, *self.out_shape)
    low = low.reshape(rows, -1, fused_parts, rank)
    update = jnp.einsum("rmpk,rpkz->rmpz", low, b.reshape(rows, fused_parts, rank, -1))
    return _all_parts(update.reshape(rows, *middle, fused_parts, *self.out_shape),
                      self.projection, parts)


def _all_parts(per_part: Array, projection: str, parts: tuple[int, ...]) -> Array:
  """[..., len(parts), h, d] updates of the targeted `parts` -> [..., all parts, h, d] of the
  fused kernel, zero for the parts not adapted."""
  total = len(PROJECTION_TARGETS[projection])
  if len(parts) == total:
    return per_part
  zeros = jnp.zeros_like(per_part[..., 0, :, :])
  return jnp.stack([per_part[..., parts.index(p), :, :] if p in parts else zeros
                    for p in range(total)], axis=-3)


def adapted(module: nn.Module, lora: LoraSpec | None, projection: str, x: Array,
            output: Array, *, deterministic: bool, in_names: tuple, out_names: tuple) -> Array:
  """`output` of `projection` (a submodule of `module`'s compact call, input `x`) plus its
  adapter where `lora` targets it."""
  if not targeted_parts(lora, projection):
    return output
  out_shape = output.shape[-len(out_names):]
  return output + Adapter(lora, projection, in_names, out_shape, out_names, output.dtype,
                          name=projection + SUFFIX, parent=module)(x, deterministic=deterministic)


# ---- Parameter trees --------------------------------------------------------------------

def is_adapter(path: tuple[str, ...]) -> bool:
  return any(name.endswith(SUFFIX) for name in path)


def split(params: dict, trained_in_full: tuple[str, ...] = ()) -> tuple[dict, dict]:
  """(trainable, frozen): the adapters and the top-level entries `trained_in_full` (a
  classifier's head), and everything else."""
  flat = traverse_util.flatten_dict(params)
  trains = lambda path: is_adapter(path) or path[0] in trained_in_full
  trainable = {path: v for path, v in flat.items() if trains(path)}
  frozen = {path: v for path, v in flat.items() if not trains(path)}
  return traverse_util.unflatten_dict(trainable), traverse_util.unflatten_dict(frozen)


def drop_adapters(params: Any) -> Any:
  """`params` (nested dicts, boxed or not) without the adapters: `split`'s frozen half."""
  return split(params)[1]


def state_params(state) -> dict:
  """The whole parameter tree of a train state: its trained parameters over its frozen base
  (train.TrainState.frozen; a full fine-tuning state has none)."""
  return combine(state.params, getattr(state, "frozen", None))


def combine(trainable: dict, frozen: dict | None) -> dict:
  """The whole parameter tree of `split`'s two parts (`trainable` alone without a base)."""
  if frozen is None:
    return trainable
  flat = traverse_util.flatten_dict(frozen)
  flat.update(traverse_util.flatten_dict(trainable))
  return traverse_util.unflatten_dict(flat)


def cast(tree: Any, dtype) -> Any:
  """`tree` (boxed or not) with its floating leaves in `dtype` (config.lora.base_dtype)."""
  dtype = jnp.dtype(dtype)
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                      else x, tree)


def merge(params: dict, lora: LoraSpec) -> dict:
  """The tree of a model without adapters: each adapter's update a b * scale added to its
  kernel (in float32, the whole tree float32), so decoding pays nothing for it."""
  flat = {path: jnp.asarray(v, jnp.float32)
          for path, v in traverse_util.flatten_dict(params).items()}
  for path in [p for p in flat if len(p) > 1 and p[-2].endswith(SUFFIX) and p[-1] == "a"]:
    projection = path[-2][:-len(SUFFIX)]
    a, b = flat.pop(path), flat.pop(path[:-1] + ("b",))
    kernel_path = path[:-2] + (projection, "kernel")
    flat[kernel_path] = flat[kernel_path] + update(a, b, lora, projection)
  return traverse_util.unflatten_dict(flat)


def update(a: Array, b: Array, lora: LoraSpec, projection: str) -> Array:
  """The kernel-shaped update scale * a b of one adapter."""
  if projection not in FUSED:
    return lora.scale * jnp.tensordot(a, b, axes=1)
  # [emb, parts, r] x [parts, r, h, d] -> [emb, parts, h, d].
  return _all_parts(lora.scale * jnp.einsum("epr,prhd->ephd", a, b), projection,
                    targeted_parts(lora, projection))


# ---- Several adapters per batch (a server's, one per row) -----------------------------------

def per_row_spec(specs: list[LoraSpec]) -> LoraSpec:
  """The per-row adapters that hold each of `specs`: the largest rank, every target, and
  scale 1 (each adapter's own scale is folded into its b by `stacked`)."""
  rank = max(spec.rank for spec in specs)
  targets = tuple(t for t in LORA_TARGETS if any(t in spec.targets for spec in specs))
  return LoraSpec(rank, float(rank), targets=targets, per_row=True)


def stacked(adapters: list[tuple[dict, LoraSpec]], wide: LoraSpec, like: dict) -> dict:
  """The adapter trees `adapters` (each with its own spec) stacked along a first axis, after
  an all-zero entry 0 (the base model alone), in the layout of per-row spec `wide`: ranks
  padded with zeros, a fused projection's parts placed among `wide`'s, and scales folded into
  b. `like`: one row's adapters of `wide`'s model (shapes [1, ...])."""
  entries = []
  for adapters_tree, lora in [({}, wide)] + adapters:
    flat = traverse_util.flatten_dict(adapters_tree)
    entry = {}
    for path, shape in traverse_util.flatten_dict(like).items():
      entry[path] = np.zeros(np.shape(shape)[1:], np.float32)
    for path in [p for p in entry if p[-1] == "a" and p in flat]:
      site, projection = path[:-1], path[-2][:-len(SUFFIX)]
      a, b = np.asarray(flat[path], np.float32), np.asarray(flat[site + ("b",)], np.float32)
      wide_a, wide_b = entry[path], entry[site + ("b",)]
      if projection not in FUSED:
        wide_a[..., :lora.rank], wide_b[:lora.rank] = a, b * lora.scale
        continue
      wide_parts = targeted_parts(wide, projection)
      for j, part in enumerate(targeted_parts(lora, projection)):
        k = wide_parts.index(part)
        wide_a[..., k, :lora.rank], wide_b[k, :lora.rank] = a[..., j, :], b[j] * lora.scale
    entries.append(entry)
  return traverse_util.unflatten_dict(
      {path: np.stack([entry[path] for entry in entries]) for path in entries[0]})


def for_rows(params: Any, adapter_ids: Array) -> Any:
  """`params` holding `stacked` adapters with each adapter gathered for the rows: x[ids]
  [rows, ...], row r's adapter adapter_ids[r] (0: none). Without adapters, `params`."""
  flat = traverse_util.flatten_dict(params)
  if not any(map(is_adapter, flat)):
    return params
  return traverse_util.unflatten_dict(
      {path: jnp.take(v, adapter_ids, axis=0) if is_adapter(path) else v
       for path, v in flat.items()})


def without(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of `config` for the merged model: adapters off."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.lora.rank = 0
  config.lora.alpha = None
  config.lora.init = ""
  return config

