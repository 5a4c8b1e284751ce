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

# The default `config.parallel.logical_axis_rules`: logical axis name -> mesh axes. Parameters
# are created with vocab / embed / heads / kv_heads / kv / mlp names
# (`nn.with_logical_partitioning` in models.py, attention.py, layers.py); activations are
# constrained with batch / length / heads / kv_heads / kv / mlp (their embedding dimension
# stays whole: see blocks.residual_stream). kv_heads are grouped-query attention's fewer
# key/value heads; a parameter dimension that does not divide its mesh axes stays whole
# (multi-query's one head: `MeshParallel._sharding`).
LOGICAL_RULES = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("kv", None),
    ("length", None),
)


def psum(tree: Any, axis_name: str | None) -> Any:
  """Sum over the devices of a pmap axis; the identity under jit (arrays are global)."""
  return tree if axis_name is None else jax.lax.psum(tree, axis_name)


def unbox(tree: Any) -> Any:
  """`tree` with every logical-partitioning box replaced by its value. Unlike
  `nn.meta.unbox` this adds no sharding constraint, so it works on abstract and host trees
  under any mesh; shardings are given explicitly where arrays are placed."""
  return jax.tree.map(lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x, tree,
                      is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def as_rules(rules) -> tuple:
  """Logical axis rules as tuples (a saved config holds them as JSON lists)."""
  return tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes)
               for name, axes in rules)


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

  @property
  def decode_parts(self) -> int:
    """Parts of a decode's rows that each run a program of their own: one per device."""
    return len(self.devices)

  def place_state(self, tree: Any) -> Any:
    """One copy of `tree` (host or single-device arrays) on every local device (leading axis
    = local device), never sharing the input's buffers.

    Placed with the sharding that pmap gives its outputs, so a step fed the replicated state
    and then its own output compiles once, not twice.
    """
    count = len(self.devices)
    return jax.tree.map(lambda x: jax.device_put(
        np.broadcast_to(np.asarray(x), (count,) + np.shape(x)), self._replicated), tree)

  def place_params(self, params: Any, boxed_abstract: Any = None) -> Any:
    """Parameters for decoding, replicated on every local device (a copy)."""
    del boxed_abstract  # every device holds all of them
    return self.place_state(params)

  def abstract_params(self, boxed_abstract: Any) -> Any:
    return unbox(boxed_abstract)  # restored on the default device, then replicated

  def create_state(self, create: Callable[[], Any]) -> Any:
    """`create()` (boxed parameters) run on the default device; `place_state` replicates it
    (after any restore)."""
    return jax.jit(lambda: unbox(create()))()

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
    """fn(params, inputs, row keys) -> outputs per row (no collectives)."""
    return jax.pmap(fn, axis_name=AXIS)

  def compile_decode_steps(self, fn: Callable) -> Callable:
    """fn(params, state, settings) -> (state, outputs per row): a decode advanced in segments
    (a server streaming tokens); the state is donated, so its KV cache is updated in place."""
    return jax.pmap(fn, axis_name=AXIS, donate_argnums=(1,))

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

  def __init__(self, data: int = -1, fsdp: int = 1, tensor: int = 1, rules=LOGICAL_RULES):
    self.mesh = make_mesh(data, fsdp, tensor)
    self.rules = as_rules(rules)
    self.replicated = NamedSharding(self.mesh, P())
    self.batch_sharding = NamedSharding(self.mesh, P(("data", "fsdp")))

  @property
  def eval_devices(self) -> int:
    return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

  @property
  def decode_parts(self) -> int:
    """One program decodes all rows: they are one part."""
    return 1

  def _sharding(self, leaf, logical: P) -> NamedSharding:
    """The rules' sharding of one array; a dimension that does not divide stays whole."""
    shape = np.shape(leaf)
    spec = nn.logical_to_mesh_axes(tuple(logical) + (None,) * (len(shape) - len(logical)),
                                   self.rules)
    dims = []
    for size, mesh_axes in zip(shape, spec):
      names = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
      ways = math.prod(self.mesh.shape[n] for n in names)
      dims.append(mesh_axes if names and size % ways == 0 else None)
    return NamedSharding(self.mesh, P(*dims))

  def shardings(self, boxed_tree: Any) -> Any:
    """Shardings of the unboxed `boxed_tree`: parameters (and their optimizer moments) by the
    logical axis names they were created with, everything else replicated."""
    return jax.tree.map(self._sharding, unbox(boxed_tree),
                        nn.get_partition_spec(boxed_tree))

  def place_state(self, tree: Any) -> Any:
    """Arrays stay where they are (created or restored into their shardings already); host
    values, such as a restored step number, are replicated."""
    return jax.tree.map(
        lambda x: x if isinstance(x, jax.Array) else jax.device_put(x, self.replicated), tree)

  def place_params(self, params: Any, boxed_abstract: Any) -> Any:
    """A copy of `params` in the shardings their logical axes give (`boxed_abstract`: the
    parameters' shapes, boxed with those axes), sharing no buffers with them."""
    return jax.device_put(params, self.shardings(boxed_abstract), may_alias=False)

  def abstract_params(self, boxed_abstract: Any) -> Any:
    """Restore targets that carry their shardings: each device reads only its part."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        unbox(boxed_abstract), self.shardings(boxed_abstract))

  def create_state(self, create: Callable[[], Any]) -> Any:
    """`create()` (boxed parameters) run directly into its shardings: no device ever holds
    the whole state."""
    abstract = jax.eval_shape(create)
    # Leaves in, leaves out: each create() builds its own optimizer object (static metadata of
    # the state), which would not match the shardings' tree.
    shardings = jax.tree.leaves(self.shardings(abstract))
    with self.tracing():
      leaves = jax.jit(lambda: jax.tree.leaves(unbox(create())), out_shardings=shardings)()
    return jax.tree.unflatten(jax.tree.structure(unbox(abstract)), leaves)

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

  def compile_decode_steps(self, fn: Callable) -> Callable:
    # Replicated as compile_decode's outputs are, so that the state a segment returns has the
    # sharding of the one it took (no second compilation).
    return self._jit(fn, out_shardings=self.replicated, donate_argnums=(1,))

  def host_sums(self, tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)

  def host_rows(self, tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)

  def checkpoint_state(self, tree: Any) -> Any:
    return tree  # global sharded arrays: every process writes its own shards

  @contextlib.contextmanager
  def tracing(self):
    """Mesh and logical rules in scope, so the models' activation constraints take effect."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
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
      layout = MeshParallel(p.data, p.fsdp, p.tensor, p.logical_axis_rules)
    except ValueError as e:
      if not fit_devices:
        raise
      logging.info("%s Using a data-parallel mesh instead.", e)
      layout = MeshParallel(-1, 1, 1, p.logical_axis_rules)
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
