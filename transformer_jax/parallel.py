"""Device layout for `jax.pmap` data parallelism: replicate state, split batches per device."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

AXIS = "batch"  # the pmap axis name that collectives reduce over


def replicate(tree: Any) -> Any:
  """One copy of `tree` on every local device (leading axis = local device).

  Placed with the same sharding that pmap gives its outputs, so a step fed the replicated
  state and then its own output compiles once, not twice.
  """
  devices = jax.local_devices()
  sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), (AXIS,)),
                                        jax.sharding.PartitionSpec(AXIS))
  return jax.tree.map(lambda x: jax.device_put(
      np.broadcast_to(np.asarray(x), (len(devices),) + np.shape(x)), sharding), tree)


def unreplicate(tree: Any) -> Any:
  """The copy on the first local device."""
  return jax.tree.map(lambda x: x[0], tree)


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
