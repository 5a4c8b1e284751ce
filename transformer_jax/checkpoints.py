"""Orbax checkpoints: periodic async saves named by step, keep the last N, verified restores.

Every checkpoint carries a fingerprint of its arrays (see `fingerprint`), checked after each
restore. A checkpoint that fails to restore or to match its fingerprint is reported in one
line and the newest good one before it is used instead; training moves the damaged ones out of
the way (into `checkpoints_damaged/`), so nothing saved is deleted.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from transformer_jax import parallel
from transformer_jax import workdir as workdir_lib

DAMAGED_DIR = "checkpoints_damaged"
# The parameters of the best evaluation (config.checkpoint_best_metric), one step at a time.
BEST_DIR = "checkpoints_best"
# A LoRA run's frozen base (lora.py), written once when the run starts, as step 0.
LORA_BASE_DIR = "lora_base"


class CheckpointError(RuntimeError):
  """A checkpoint is missing or does not fit the model; the message says what to do."""


class DamagedCheckpointError(CheckpointError):
  """A checkpoint's files cannot be read back as they were written."""


def manager(workdir: str, max_to_keep: int | None = 3, *, read_only: bool = False,
            folder: str = "checkpoints") -> ocp.CheckpointManager:
  """A CheckpointManager over `workdir/folder/<step>` (BEST_DIR: the best checkpoint, saved
  by `save_best`); saves are asynchronous."""
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=not read_only,
                                         read_only=read_only, enable_async_checkpointing=True)
  handlers = dict(params=ocp.StandardCheckpointHandler(),
                  opt_state=ocp.StandardCheckpointHandler(),
                  fingerprint=ocp.JsonCheckpointHandler(), data_state=ocp.JsonCheckpointHandler(),
                  best=ocp.JsonCheckpointHandler())
  return ocp.CheckpointManager(workdir_lib.path(workdir) / folder, options=options,
                               item_handlers=handlers)


def save_best(checkpoints: ocp.CheckpointManager, step: int, params: Any, record: dict) -> None:
  """Starts saving the parameters of a new best evaluation (without the optimizer state:
  they are for inference) with `record` ({metric, value, step}); with max_to_keep=1 the
  previous best is deleted once this one is written."""
  check_background_saves(checkpoints)
  items = dict(params=ocp.args.StandardSave(params),
               fingerprint=ocp.args.JsonSave({"params": fingerprint(params)}),
               best=ocp.args.JsonSave(record))
  try:
    checkpoints.save(step, args=ocp.args.Composite(**items), force=True)
  except Exception as e:  # Orbax re-raises a previous background save's error here too
    raise _save_failed(checkpoints, e) from None


def best_record(checkpoints: ocp.CheckpointManager) -> dict | None:
  """{metric, value, step} of the best checkpoint in `checkpoints`, or None if it has none."""
  step = checkpoints.latest_step()
  if step is None:
    return None
  return dict(checkpoints.restore(step, args=ocp.args.Composite(best=ocp.args.JsonRestore()))
              ["best"])


def _as_words(x: jax.Array) -> jax.Array:
  """The array's bits as uint32 words (narrower types widened, wider ones split)."""
  if jnp.dtype(x.dtype) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)):
    x = x.astype(jnp.int8)  # a quantized LoRA base's half-bytes, widened exactly
  size = jnp.dtype(x.dtype).itemsize
  if size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
  return jax.lax.bitcast_convert_type(x, unsigned).reshape(-1).astype(jnp.uint32)


@jax.jit
def _leaf_fingerprints(tree: Any) -> Any:
  def leaf(x):
    words = _as_words(jnp.asarray(x))
    # Wrapping uint32 sums are exact and independent of the order of summation, so the
    # fingerprint is the same however the array is sharded; the position weights make a
    # permutation of the values count too.
    weights = jax.lax.iota(jnp.uint32, words.size) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32),
                      jnp.sum(words * weights, dtype=jnp.uint32)])

  return jax.tree.map(leaf, tree)


def fingerprint(tree: Any) -> dict[str, list[int]]:
  """Exact checksums of every array in `tree` (two uint32 per leaf, keyed by tree path),
  computed where the arrays live: a flipped bit anywhere changes them."""
  sums = _leaf_fingerprints(tree)
  return {jax.tree_util.keystr(path): [int(v) for v in np.asarray(value)]
          for path, value in jax.tree_util.tree_leaves_with_path(sums)}


def save(checkpoints: ocp.CheckpointManager, step: int, params: Any, opt_state: Any,
         data_state: dict | None = None) -> None:
  """Starts saving params, optimizer state, their fingerprint and the input pipeline's
  position in the background (separate items, so inference restores the parameters alone).

  Raises:
    CheckpointError: an earlier background save failed.
  """
  check_background_saves(checkpoints)
  items = dict(params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
               fingerprint=ocp.args.JsonSave({"params": fingerprint(params),
                                              "opt_state": fingerprint(opt_state)}))
  if data_state is not None:
    items["data_state"] = ocp.args.JsonSave(data_state)
  try:
    checkpoints.save(step, args=ocp.args.Composite(**items), force=True)
  except Exception as e:  # Orbax re-raises a previous background save's error here too
    raise _save_failed(checkpoints, e) from None


def save_lora_base(workdir: str, base: Any) -> None:
  """Writes a LoRA run's frozen base into WORKDIR/lora_base (replacing one left by a start
  that saved no step checkpoint after it) and waits for it: the step checkpoints hold only
  what trains."""
  folder = workdir_lib.path(workdir) / LORA_BASE_DIR
  if jax.process_index() == 0 and folder.exists():
    folder.rmtree()
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("old lora_base removed")
  base_manager = manager(workdir, 1, folder=LORA_BASE_DIR)
  items = dict(params=ocp.args.StandardSave(base),
               fingerprint=ocp.args.JsonSave({"params": fingerprint(base)}))
  base_manager.save(0, args=ocp.args.Composite(**items), force=True)
  base_manager.wait_until_finished()
  base_manager.close()


def restore_lora_base(workdir: str, like: Any) -> Any:
  """A LoRA run's frozen base, restored into the shapes, dtypes and shardings of `like`."""
  if not (workdir_lib.path(workdir) / LORA_BASE_DIR).exists():
    raise CheckpointError(f"{workdir} holds LoRA adapters but not the frozen base they adapt "
                          f"({LORA_BASE_DIR}/): restore that folder, or train in a new workdir.")
  base, _, _ = restore(manager(workdir, read_only=True, folder=LORA_BASE_DIR), like)
  return base


def check_background_saves(checkpoints: ocp.CheckpointManager) -> None:
  """Raises CheckpointError if a background save has failed since the last check."""
  try:
    checkpoints.check_for_errors()
  except Exception as e:  # Orbax re-raises whatever the writing thread hit
    raise _save_failed(checkpoints, e) from None


def _save_failed(checkpoints: ocp.CheckpointManager, error: Exception) -> CheckpointError:
  try:
    checkpoints.reload()  # its own list already holds the step whose save just failed
  except Exception:  # pylint: disable=broad-except
    pass  # the list as it is: the message must not fail too
  complete = checkpoints.all_steps()
  return CheckpointError(
      f"Saving a checkpoint in {checkpoints.directory} failed: {_short(error)}. Check that the "
      f"workdir is writable and has space, then re-run the same command to resume from the "
      f"last complete checkpoint ({max(complete) if complete else 'none yet'}).")


def wait_for_saves(checkpoints: ocp.CheckpointManager) -> None:
  """Blocks until background saves are written; raises CheckpointError if one failed."""
  try:
    checkpoints.wait_until_finished()
  except Exception as e:
    raise _save_failed(checkpoints, e) from None
  check_background_saves(checkpoints)


def _short(error: Exception, limit: int = 300) -> str:
  text = " ".join(str(error).split())
  # TensorStore's messages name the failing file twice over; the OS error says what to fix.
  os_error = re.search(r"os_error_code='(\d+)'", text)
  if os_error:
    text = f"{text.split(':')[0]}: {os.strerror(int(os_error.group(1)))}"
  return text if len(text) <= limit else text[:limit] + " ..."


def _restore_target(leaf) -> jax.ShapeDtypeStruct:
  """Shape, dtype and sharding to restore into. Without a sharding of its own a leaf goes to
  the first local device, never to the saved sharding (whose devices may not exist here: a
  checkpoint written by 8 devices or 2 processes is read by one)."""
  target = ocp.utils.to_shape_dtype_struct(leaf)
  if isinstance(target, jax.ShapeDtypeStruct) and target.sharding is None:
    target = jax.ShapeDtypeStruct(target.shape, target.dtype,
                                  sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
  return target


def _shape_mismatches(metadata: Any, params: Any) -> list[str]:
  """Parameters whose saved shape (in the step's item `metadata`) differs from the model's (a
  config problem, not damage; the optimizer state follows the parameters)."""
  saved = metadata["params"]
  return shape_differences(getattr(saved, "tree", saved), params, "saved", prefix="params")


def shape_differences(have: Any, wanted: Any, have_name: str, prefix: str = "") -> list[str]:
  """One line per leaf whose shape in `have` differs from the model's (`wanted`), a leaf
  missing from either tree showing None."""
  wanted = {_key(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(wanted)}
  have = {_key(p): tuple(getattr(x, "shape", ()))
          for p, x in jax.tree_util.tree_leaves_with_path(have)}
  return [f"{prefix}{key}: {have_name} {have.get(key)}, model {wanted.get(key)}"
          for key in sorted(set(wanted) | set(have)) if wanted.get(key) != have.get(key)]


def _key(path) -> str:
  """A leaf's path as ['a']['b'], whether its nodes are dicts or (a quantized kernel's)
  dataclasses: Orbax's metadata holds the latter as dicts."""
  names = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
  return "".join(f"[{name!r}]" for name in names)


def _restore_step(checkpoints: ocp.CheckpointManager, step: int, items: dict,
                  with_data_state: bool) -> dict:
  """Restores and verifies one step. Raises CheckpointError (model mismatch) or
  DamagedCheckpointError (unreadable or altered files)."""
  try:
    metadata = checkpoints.item_metadata(step)  # read once: a request per file on a bucket
    mismatches = _shape_mismatches(metadata, items["params"])
  except Exception as e:
    raise DamagedCheckpointError(f"its metadata cannot be read ({_short(e, 150)})") from None
  if mismatches:
    raise CheckpointError(
        f"The checkpoint at step {step} in {checkpoints.directory} does not match this model "
        f"(was it trained with another config.model?): {'; '.join(mismatches[:3])}"
        f"{' ...' if len(mismatches) > 3 else ''}. Use the workdir's own config.json or a new "
        "workdir.")
  args = {name: ocp.args.StandardRestore(jax.tree.map(_restore_target, tree))
          for name, tree in items.items()}
  if with_data_state:
    args["data_state"] = ocp.args.JsonRestore()
  has_fingerprint = "fingerprint" in metadata.keys()
  if has_fingerprint:
    args["fingerprint"] = ocp.args.JsonRestore()
  try:
    restored = checkpoints.restore(step, args=ocp.args.Composite(**args))
  except Exception as e:
    raise DamagedCheckpointError(f"it cannot be read back ({_short(e, 150)})") from None
  if has_fingerprint:
    for name in items:
      if fingerprint(restored[name]) != restored["fingerprint"][name]:
        raise DamagedCheckpointError(f"its {name} differ from the fingerprint saved with them")
  return restored


def restore(checkpoints: ocp.CheckpointManager, abstract_params: Any,
            abstract_opt_state: Any = None, step: int | None = None, *,
            with_data_state: bool = False) -> tuple:
  """Restores `step` (default: the newest good checkpoint) into the shapes, dtypes and
  shardings of the abstract trees, verified against its saved fingerprint.

  Returns:
    (params, opt_state or None when `abstract_opt_state` is None, step), and the input
    pipeline's saved position as a fourth item when `with_data_state`.

  Raises:
    CheckpointError: there is no such checkpoint, no readable one, or it was saved by a
      different model.
  """
  available = sorted(checkpoints.all_steps(), reverse=True)
  if step is not None and step not in available:
    raise CheckpointError(
        f"No checkpoint at step {step} in {checkpoints.directory}; available steps: "
        f"{sorted(available) or 'none'}. Pass an available --checkpoint_step.")
  if not available:
    raise CheckpointError(
        f"No checkpoint in {checkpoints.directory}. Train first (python -m transformer_jax.main "
        "--config ... --workdir ...).")
  items = {"params": abstract_params}
  if abstract_opt_state is not None:
    items["opt_state"] = abstract_opt_state
  damaged = []
  for candidate in [step] if step is not None else available:
    try:
      restored = _restore_step(checkpoints, candidate, items, with_data_state)
    except DamagedCheckpointError as e:
      logging.warning("Checkpoint %d in %s is damaged: %s.", candidate, checkpoints.directory, e)
      damaged.append(candidate)
      continue
    if damaged:
      logging.warning("Using checkpoint %d instead of the damaged %s.", candidate, damaged)
    result = (restored["params"], restored.get("opt_state"), int(candidate))
    return result + (dict(restored["data_state"]),) if with_data_state else result
  raise CheckpointError(
      f"No readable checkpoint in {checkpoints.directory}: step(s) {damaged} are damaged "
      f"(see the warnings above). Train again in a new workdir, or restore the files.")


def damaged_steps_after(checkpoints: ocp.CheckpointManager, step: int) -> list[int]:
  return sorted(s for s in checkpoints.all_steps() if s > step)


def set_aside(workdir: str, checkpoints: ocp.CheckpointManager, steps: list[int]) -> None:
  """Moves damaged checkpoints to workdir/checkpoints_damaged/, so training can save those
  step numbers again without deleting anything."""
  target_dir = workdir_lib.path(workdir) / DAMAGED_DIR
  target_dir.mkdir(parents=True, exist_ok=True)
  for step in steps:
    source = checkpoints.directory / str(step)
    target = target_dir / str(step)
    if target.exists():
      target.rmtree()
    source.rename(target)
    logging.warning("Moved the damaged checkpoint %d to %s.", step, target)
  checkpoints.reload()


def restore_params(workdir: str, init_params, step: int | str | None = None,
                   average_last: int = 1, layout=None) -> tuple[Any, int]:
  """A workdir's parameters at `step` (default: the newest good checkpoint; 'best': the best
  evaluation's, kept by config.checkpoint_best_metric), or the mean of the last
  `average_last` checkpoints up to it (the paper averages the last 5 or 20).

  `init_params(rng)` gives the parameters' shapes and logical axes (it is never run); they
  are restored into `layout`'s shardings (default: one device), whatever layout saved them.
  Returns (params, step).
  """
  abstract = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0)))
  abstract = parallel.unbox(abstract) if layout is None else layout.abstract_params(abstract)
  if step == "best":
    if average_last > 1:
      raise CheckpointError("--checkpoint best is one checkpoint: it cannot be averaged "
                            "(drop --average_last).")
    if not (workdir_lib.path(workdir) / BEST_DIR).exists():
      raise CheckpointError(
          f"No best checkpoint in {workdir}: train with --config.checkpoint_best_metric=NAME "
          "(e.g. bleu), or use the latest checkpoint (drop --checkpoint best).")
    params, _, step = restore(manager(workdir, read_only=True, folder=BEST_DIR), abstract)
    return params, step
  checkpoints = manager(workdir, read_only=True)
  params, _, step = restore(checkpoints, abstract, step=step)
  if average_last <= 1:
    return params, step
  steps = sorted(s for s in checkpoints.all_steps() if s <= step)[-average_last:]
  if len(steps) < average_last:
    logging.warning("Averaging %d checkpoints %s: only these are kept (config.keep_checkpoints).",
                    len(steps), steps)
  total = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  for other in steps[:-1]:
    other_params, _, _ = restore(checkpoints, abstract, step=other)
    total = jax.tree.map(lambda t, x: t + np.asarray(x, np.float64), total, other_params)
  logging.info("Averaged the parameters of checkpoints %s.", steps)
  return jax.tree.map(lambda t, x: (t / len(steps)).astype(x.dtype), total, params), step
