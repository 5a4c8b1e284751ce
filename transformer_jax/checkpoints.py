"""Orbax checkpoints: periodic async saves named by step, keep the last N, restore, resume."""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
  """A checkpoint is missing or does not fit the model; the message says what to do."""


def manager(workdir: str, max_to_keep: int | None = 3, *, read_only: bool = False
            ) -> ocp.CheckpointManager:
  """A CheckpointManager over `workdir/checkpoints/<step>`; saves are asynchronous."""
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=not read_only,
                                         read_only=read_only, enable_async_checkpointing=True)
  return ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "checkpoints"),
                               options=options)


def save(checkpoints: ocp.CheckpointManager, step: int, params: Any, opt_state: Any,
         data_state: dict | None = None) -> None:
  """Starts saving params, optimizer state and the input pipeline's position in the
  background (separate items, so inference restores the parameters alone)."""
  items = dict(params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state))
  if data_state is not None:
    items["data_state"] = ocp.args.JsonSave(data_state)
  checkpoints.save(step, args=ocp.args.Composite(**items), force=True)


def _restore_target(leaf) -> jax.ShapeDtypeStruct:
  """Shape, dtype and sharding to restore into. Without a sharding of its own a leaf goes to
  the first local device, never to the saved sharding (whose devices may not exist here: a
  checkpoint written by 8 devices or 2 processes is read by one)."""
  target = ocp.utils.to_shape_dtype_struct(leaf)
  if isinstance(target, jax.ShapeDtypeStruct) and target.sharding is None:
    target = jax.ShapeDtypeStruct(target.shape, target.dtype,
                                  sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
  return target


def restore(checkpoints: ocp.CheckpointManager, abstract_params: Any,
            abstract_opt_state: Any = None, step: int | None = None, *,
            with_data_state: bool = False) -> tuple:
  """Restores `step` (default: latest) into the shapes and dtypes of the abstract trees.

  Returns:
    (params, opt_state or None when `abstract_opt_state` is None, step), and the input
    pipeline's saved position as a fourth item when `with_data_state`.

  Raises:
    CheckpointError: there is no such checkpoint, or it was saved by a different model.
  """
  available = checkpoints.all_steps()
  if step is None:
    step = checkpoints.latest_step()
  if step is None or step not in available:
    raise CheckpointError(
        f"No checkpoint{'' if step is None else f' at step {step}'} in "
        f"{checkpoints.directory}; available steps: {sorted(available) or 'none'}. Train first "
        "(python -m transformer_jax.main --config ... --workdir ...) or pass an available "
        "--checkpoint_step.")
  items = {"params": abstract_params}
  if abstract_opt_state is not None:
    items["opt_state"] = abstract_opt_state
  args = {name: ocp.args.StandardRestore(jax.tree.map(_restore_target, tree))
          for name, tree in items.items()}
  if with_data_state:
    args["data_state"] = ocp.args.JsonRestore()
  try:
    restored = checkpoints.restore(step, args=ocp.args.Composite(**args))
  except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
    raise CheckpointError(
        f"The checkpoint at step {step} in {checkpoints.directory} does not match this model "
        f"(was it trained with another config.model?). Use the workdir's own config.json or a "
        f"new workdir. Details: {str(e)[:500]}") from None
  result = (restored["params"], restored.get("opt_state"), int(step))
  return result + (dict(restored["data_state"]),) if with_data_state else result
