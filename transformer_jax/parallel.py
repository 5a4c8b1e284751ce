"""Device layouts, chosen by `config.parallel.mode`; the step functions are written once.

  pmap  data parallel: the state replicated on every local device, each process's rows of the
        global batch split over its devices, `psum` over the pmap axis inside the steps.
  jit   one `jax.jit` program over a `Mesh` with axes (data, fsdp, tensor): the batch split over
        data x fsdp, parameters (and their optimizer state) split by logical axis rules, fsdp
        over the embedding dimension (ZeRO-3 style) and tensor over heads / MLP / vocabulary
        (Megatron style); XLA inserts the collectives. The state is created already sharded.

A layout places states and batches on devices, compiles step functions, and brings results back
to the host. Steps call `psum(x, layout.axis_name)`: a cross-device sum under pmap, the
identity under jit (arrays there are global already).
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any, Callable

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "batch"  # the pmap axis name that collectives reduce over
MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis name -> mesh axes. Parameters use vocab / embed / heads / kv / mlp; activations
# batch / length / heads / kv / mlp (their embedding dimension stays whole: see models.py).
LOGICAL_RULES = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("kv", None),
    ("length", None),
)


def psum(tree: Any, axis_name: str | None) -> Any:
  """Sum over the devices of a pmap axis; the identity under jit (arrays are global)."""
  return tree if axis_name is None else jax.lax.psum(tree, axis_name)


def param_logical_axes(path: tuple[str, ...], ndim: int) -> tuple[str | None, ...]:
  """Logical axis names of a parameter (or its optimizer moments) from its module path.

  Names follow models.py: the attention projections `qkv` / `query` / `kv` have kernels
  [embed, parts, heads, head_dim] and `out` [heads, head_dim, embed]; the FFN's `wi` / `wi_gate`
  [embed, mlp] and `wo` [mlp, embed]; embeddings [vocab, embed]. Anything else is replicated.
  """
  name = path[-1] if path else ""
  parent = path[-2] if len(path) > 1 else ""
  by_parent = {
      ("qkv", "kernel"): ("embed", None, "heads", "kv"), ("qkv", "bias"): (None, "heads", "kv"),
      ("query", "kernel"): ("embed", None, "heads", "kv"),
      ("query", "bias"): (None, "heads", "kv"),
      ("kv", "kernel"): ("embed", None, "heads", "kv"), ("kv", "bias"): (None, "heads", "kv"),
      ("out", "kernel"): ("heads", "kv", "embed"), ("out", "bias"): ("embed",),
      ("wi", "kernel"): ("embed", "mlp"), ("wi", "bias"): ("mlp",),
      ("wi_gate", "kernel"): ("embed", "mlp"), ("wi_gate", "bias"): ("mlp",),
      ("wo", "kernel"): ("mlp", "embed"), ("wo", "bias"): ("embed",),
      ("logits_dense", "kernel"): ("embed", "vocab"), ("logits_dense", "bias"): ("vocab",),
  }
  axes = by_parent.get((parent, name))
  if axes is None and name == "embedding":
    axes = ("vocab", "embed")
  elif axes is None and name == "pos_embedding":
    axes = (None, "embed")
  elif axes is None and re.search("norm", parent) and name in ("scale", "bias"):
    axes = ("embed",)
  if axes is None or len(axes) != ndim:
    return (None,) * ndim
  return axes


def _path_names(path) -> tuple[str, ...]:
  names = []
  for entry in path:
    for attr in ("key", "name"):
      if hasattr(entry, attr):
        names.append(str(getattr(entry, attr)))
        break
  return tuple(names)


class DataParallel:
  """`jax.pmap` over the local devices: replicated state, batches split per device."""
  mode = "pmap"
  axis_name = AXIS

  def __init__(self):
    self.devices = jax.local_devices()
    self._replicated = NamedSharding(jax.sharding.Mesh(np.array(self.devices), (AXIS,)), P(AXIS))

  @property
  def eval_devices(self) -> int:
    """Devices an evaluation batch is split over (each process evaluates all examples)."""
    return len(self.devices)

  def place_state(self, tree: Any) -> Any:
    """One copy of `tree` on every local device (leading axis = local device).

    Placed with the sharding that pmap gives its outputs, so a step fed the replicated state
    and then its own output compiles once, not twice.
    """
    count = len(self.devices)
    return jax.tree.map(lambda x: jax.device_put(
        np.broadcast_to(np.asarray(x), (count,) + np.shape(x)), self._replicated), tree)

  place_params = place_state

  def abstract_params(self, abstract: Any) -> Any:
    return abstract  # restored on the default device, then replicated

  def create_state(self, create: Callable[[], Any]) -> Any:
    """On the default device; `place_state` replicates it (after any restore)."""
    return jax.jit(create)()

  def train_batch(self, batch: Any) -> Any:
    return shard(batch)

  eval_batch = train_batch

  def compile_train_step(self, fn: Callable) -> Callable:
    """fn(state, batch, rng) -> (state, sums); the state is donated (updated in place)."""
    return jax.pmap(fn, axis_name=AXIS, in_axes=(0, 0, None), donate_argnums=(0,))

  def compile_eval(self, fn: Callable) -> Callable:
    """fn(params, batch) -> sums reduced over devices."""
    return jax.pmap(fn, axis_name=AXIS)

  def compile_decode(self, fn: Callable) -> Callable:
    """fn(params, inputs, rng) -> outputs per row (no collectives)."""
    return jax.pmap(fn, axis_name=AXIS, in_axes=(0, 0, None))

  def host_sums(self, tree: Any) -> Any:
    return jax.tree.map(first_local_copy, tree)

  def host_rows(self, tree: Any) -> Any:
    return unshard(tree)

  def checkpoint_state(self, tree: Any) -> Any:
    # Host numpy copies: every process holds the same values and Orbax writes them once
    # (per-process replicas are not global arrays, which Orbax needs).
    return jax.tree.map(first_local_copy, tree)

  @contextlib.contextmanager
  def tracing(self):
    yield


class MeshParallel:
  """`jax.jit` over a (data, fsdp, tensor) Mesh of all devices, arrays sharded by rules."""
  mode = "jit"
  axis_name = None

  def __init__(self, data: int = -1, fsdp: int = 1, tensor: int = 1):
    self.mesh = make_mesh(data, fsdp, tensor)
    self.replicated = NamedSharding(self.mesh, P())
    self.batch_sharding = NamedSharding(self.mesh, P(("data", "fsdp")))

  @property
  def eval_devices(self) -> int:
    return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

  def sharding_of(self, path, leaf) -> NamedSharding:
    """The parameter rule's sharding; a dimension that does not divide stays whole."""
    shape = np.shape(leaf)
    axes = param_logical_axes(_path_names(path), len(shape))
    spec = nn.logical_to_mesh_axes(axes, LOGICAL_RULES)
    dims = []
    for size, mesh_axes in zip(shape, spec):
      names = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
      ways = math.prod(self.mesh.shape[n] for n in names)
      dims.append(mesh_axes if names and size % ways == 0 else None)
    return NamedSharding(self.mesh, P(*dims))

  def shardings(self, tree: Any) -> Any:
    return jax.tree_util.tree_map_with_path(self.sharding_of, tree)

  def place_state(self, tree: Any) -> Any:
    return jax.device_put(tree, self.shardings(tree))

  place_params = place_state

  def abstract_params(self, abstract: Any) -> Any:
    """Restore targets that carry their shardings: each device reads only its part."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract, self.shardings(abstract))

  def create_state(self, create: Callable[[], Any]) -> Any:
    """Initialised directly into its shardings: no device ever holds the whole state.
    `place_state` then leaves it where it is."""
    with self.tracing():
      shardings = self.shardings(jax.eval_shape(create))
      return jax.jit(create, out_shardings=shardings)()

  def train_batch(self, batch: Any) -> Any:
    """This process's rows of the global batch -> global arrays split over data x fsdp."""
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), batch)

  def eval_batch(self, batch: Any) -> Any:
    """A batch every process holds whole -> global arrays split over data x fsdp."""
    return jax.tree.map(lambda x: jax.make_array_from_callback(
        x.shape, self.batch_sharding, lambda index: x[index]), batch)

  def _jit(self, fn: Callable, **kwargs) -> Callable:
    compiled = jax.jit(fn, **kwargs)

    def run(*args):
      with self.tracing():  # tracing happens at the first call: rules and mesh must be set
        return compiled(*args)

    return run

  def compile_train_step(self, fn: Callable) -> Callable:
    cache = {}

    def run(state, batch, rng):
      # The output state keeps the input state's shardings (donation reuses its buffers).
      if "step" not in cache:
        shardings = jax.tree.map(lambda x: x.sharding, state)
        cache["step"] = self._jit(fn, out_shardings=(shardings, self.replicated),
                                  donate_argnums=(0,))
      return cache["step"](state, batch, rng)

    return run

  def compile_eval(self, fn: Callable) -> Callable:
    return self._jit(fn, out_shardings=self.replicated)

  def compile_decode(self, fn: Callable) -> Callable:
    # Outputs replicated: every process gets every row back.
    return self._jit(fn, out_shardings=self.replicated)

  def host_sums(self, tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)

  def host_rows(self, tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)

  def checkpoint_state(self, tree: Any) -> Any:
    return tree  # global sharded arrays: every process writes its own shards

  @contextlib.contextmanager
  def tracing(self):
    """Mesh and logical rules in scope, so the models' activation constraints take effect."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(LOGICAL_RULES):
      yield


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1) -> jax.sharding.Mesh:
  """A (data, fsdp, tensor) mesh of all devices; one size may be -1 = the rest."""
  count = jax.device_count()
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1:
    raise ValueError(f"config.parallel: at most one of data / fsdp / tensor may be -1, got "
                     f"{sizes}.")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if count % known:
      raise ValueError(f"config.parallel: {count} devices do not divide by "
                       f"{dict(zip(MESH_AXES, sizes))}.")
    sizes[sizes.index(-1)] = count // known
  if math.prod(sizes) != count:
    raise ValueError(f"config.parallel sizes {dict(zip(MESH_AXES, sizes))} use "
                     f"{math.prod(sizes)} devices, but there are {count}; set one of them to -1.")
  # Auto axes: XLA propagates shardings from the inputs and the constraints in the models.
  return jax.make_mesh(tuple(sizes), MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def make_layout(config: ml_collections.ConfigDict, *, fit_devices: bool = False):
  """The layout named by `config.parallel.mode`.

  `fit_devices` (evaluate / predict from a workdir): a saved mesh that does not fit this
  machine's devices (trained on 64 chips, evaluated on 1) becomes a data-parallel mesh.
  """
  p = config.parallel
  if p.mode == "pmap":
    return DataParallel()
  if p.mode == "jit":
    try:
      layout = MeshParallel(p.data, p.fsdp, p.tensor)
    except ValueError as e:
      if not fit_devices:
        raise
      logging.info("%s Using a data-parallel mesh instead.", e)
      layout = MeshParallel(-1, 1, 1)
    tensor = layout.mesh.shape["tensor"]
    for key in ("num_heads", "mlp_dim"):
      if config.model[key] % tensor:
        raise ValueError(f"config.model.{key}={config.model[key]} does not split over "
                         f"config.parallel.tensor={tensor} devices; pick a divisor.")
    return layout
  raise ValueError(f"Unknown config.parallel.mode={p.mode!r}; use 'pmap' or 'jit'.")


def replicate(tree: Any) -> Any:
  """One copy of `tree` on every local device (the pmap layout's state placement)."""
  return DataParallel().place_state(tree)


def unreplicate(tree: Any) -> Any:
  """The copy on the first local device."""
  return jax.tree.map(first_local_copy, tree)


def first_local_copy(x: Any) -> np.ndarray:
  """Host copy of the first local device's slice of a pmap-replicated array.

  Read from this process's own shard: `x[0]` would be a computation over every process's
  devices, which deadlocks when the processes issue their indexing ops in different orders
  (it hung two-process runs at their first checkpoint save).
  """
  if isinstance(x, jax.Array):
    return np.asarray(x.addressable_shards[0].data).reshape(x.shape[1:])
  return np.asarray(x[0])


def shard(batch: Any) -> Any:
  """Splits the leading (local batch) axis into [local_devices, per_device, ...]."""
  count = jax.local_device_count()

  def split(x):
    if x.shape[0] % count:
      raise ValueError(f"Batch of {x.shape[0]} does not split over {count} local devices; "
                       "make the batch a multiple of the device count.")
    return x.reshape((count, x.shape[0] // count) + x.shape[1:])

  return jax.tree.map(split, batch)


def unshard(tree: Any) -> Any:
  """Inverse of `shard`, fetched to host numpy: [devices, per_device, ...] -> [batch, ...]."""
  return jax.tree.map(lambda x: np.asarray(x).reshape((-1,) + x.shape[2:]), tree)
