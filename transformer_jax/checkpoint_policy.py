"""What a training run saves and when: the step checkpoints (only after finite steps), the
best evaluation's parameters, and the restore that resumes a run. checkpoints.py is the
Orbax layer underneath."""

from __future__ import annotations

import math
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from flax.training import train_state
from jax.experimental import multihost_utils

from transformer_jax import checkpoints
from transformer_jax import saved_config
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import pipeline


class NonFiniteLossError(RuntimeError):
  """The loss or the gradient norm stopped being finite; nothing was saved after it."""


def check_finite(host_sums: dict, step: int, manager) -> None:
  """Raises NonFiniteLossError, naming the last good checkpoint, if a step since the last
  check had a non-finite loss or gradient."""
  if host_sums["nonfinite_steps"] == 0 and np.isfinite(host_sums["loss"]):
    return
  last_good = manager.latest_step()
  raise NonFiniteLossError(
      f"The training loss or gradient became non-finite by step {step}; stopped without "
      f"saving. Last good checkpoint: {'none' if last_good is None else f'step {last_good}'} "
      f"in {manager.directory}. Lower config.learning_rate, raise config.warmup_steps or set "
      "config.grad_clip_norm, then re-run the same command to resume from it.")


def whole_data_state(state: dict) -> dict:
  """The data position of every shard, from this process's (which knows its own shards)."""
  if jax.process_count() == 1 or "shards" not in state:
    return state
  gathered = multihost_utils.process_allgather(np.asarray(state["shards"]))
  return pipeline.merge_states([{"shards": part} for part in gathered.tolist()])


def save(manager, layout, step: int, state: train_state.TrainState, data_state: dict,
         sums, best: BestCheckpoint | None = None, *, wait: bool = False) -> None:
  """Starts writing the checkpoint of `step` in the background, once the steps since the
  last log line (`sums`) are known to be finite; with `wait` (the run stops), waits for it
  and for the best checkpoint's saves."""
  if sums is not None:  # else checked at this step's log line
    check_finite(layout.host_sums(sums), step, manager)
  start = time.time()
  # The parameters trained and their optimizer state: never a LoRA run's frozen base.
  params, opt_state = layout.checkpoint_state((state.params, state.opt_state))
  checkpoints.save(manager, step, params, opt_state, whole_data_state(data_state))
  logging.info("Saved checkpoint %d (%.1f s; written in the background) in %s.", step,
               time.time() - start, manager.directory)
  if wait:
    wait_for_saves(manager, best)


def restore(config: ml_collections.ConfigDict, workdir: str, manager,
            state: train_state.TrainState,
            train_batches: pipeline.TrainBatches) -> train_state.TrainState:
  """`state`, and the position of `train_batches`, from the newest good checkpoint (as they
  are when there is none)."""
  if manager.latest_step() is None:
    return state
  # Restored into the new state's shardings, whatever layout and devices saved it; a
  # damaged newest checkpoint falls back to the one before it.
  try:
    params, opt_state, step, data_state = checkpoints.restore(
        manager, state.params, state.opt_state, with_data_state=True)
  except checkpoints.CheckpointError as e:
    raise checkpoints.CheckpointError(f"{e} {_model_changes(workdir, config)}") from None
  damaged = checkpoints.damaged_steps_after(manager, step)  # the same list on every host
  if damaged and jax.process_index() == 0:
    checkpoints.set_aside(workdir, manager, damaged)
  if damaged and jax.process_count() > 1:
    multihost_utils.sync_global_devices("damaged checkpoints set aside")
    manager.reload()
  state = state.replace(step=step, params=params, opt_state=opt_state)
  train_batches.restore(data_state)
  logging.info("Resumed from checkpoint at step %d (data position %s).", step, data_state)
  return state


def _model_changes(workdir: str, config: ml_collections.ConfigDict) -> str:
  """The model / data keys in which `config` differs from the workdir's saved config."""
  try:
    changes = saved_config.fixed_key_changes(workdir_lib.load_config(workdir), config)
  except workdir_lib.WorkdirError:
    return ""
  return f"Changed since this workdir was trained: {'; '.join(changes)}." if changes else ""


class BestCheckpoint:
  """The parameters of the best evaluation by `config.checkpoint_best_metric`, in their own
  folder; `record` ({metric, value, step}, None before the first) is kept across resumes.
  Also counts the evaluations since the last best, for `config.early_stopping_evals` (within
  this run: a resumed run counts again from 0)."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, layout):
    self.metric, self._mode, self._layout = (config.checkpoint_best_metric,
                                             config.checkpoint_best_mode, layout)
    self._patience, self.evals_without_best = config.early_stopping_evals, 0
    self.manager = checkpoints.manager(workdir, 1, folder=checkpoints.BEST_DIR)
    self.record = checkpoints.best_record(self.manager)
    if self.record and self.record["metric"] != self.metric:
      raise ValueError(f"{self.manager.directory} keeps the best {self.record['metric']!r}, "
                       f"not config.checkpoint_best_metric={self.metric!r}; move that folder "
                       "away or keep the metric.")

  @classmethod
  def of(cls, config: ml_collections.ConfigDict, workdir: str, layout
         ) -> "BestCheckpoint | None":
    """The config's best checkpoint; None without `config.checkpoint_best_metric`."""
    return cls(config, workdir, layout) if config.checkpoint_best_metric else None

  def keep_if_best(self, step: int, result: dict, state: train_state.TrainState) -> bool:
    """Saves the parameters if `result` is the best evaluation yet; True if it is."""
    if self.metric not in result:
      raise ValueError(f"config.checkpoint_best_metric={self.metric!r} is not a metric of "
                       f"this evaluation ({', '.join(sorted(result))}).")
    if not _improved(result[self.metric], self.record, self._mode):
      return False
    self.record = dict(metric=self.metric, value=float(result[self.metric]), step=step)
    checkpoints.save_best(self.manager, step, self._layout.checkpoint_state(state.params),
                          self.record)
    logging.info("New best %s %.4f at step %d, kept in %s.", self.metric, self.record["value"],
                 step, self.manager.directory)
    return True

  def observe(self, step: int, result: dict, state: train_state.TrainState) -> bool:
    """Keeps `state` if `result` is the best yet; True when training should stop early."""
    self.evals_without_best = (0 if self.keep_if_best(step, result, state)
                               else self.evals_without_best + 1)
    if 0 < self._patience <= self.evals_without_best:
      logging.info("Early stopping at step %d: %d evaluations without a better %s.", step,
                   self.evals_without_best, self.metric)
      return True
    return False


def _improved(value: float, best: dict | None, mode: str) -> bool:
  if not math.isfinite(value):
    return False
  if best is None:
    return True
  return value > best["value"] if mode == "max" else value < best["value"]


def wait_for_saves(manager, best: BestCheckpoint | None) -> None:
  checkpoints.wait_for_saves(manager)
  if best:
    checkpoints.wait_for_saves(best.manager)


def close(manager, best: BestCheckpoint | None) -> int | None:
  """Waits for the saves in flight, closes the managers; returns the newest step saved."""
  wait_for_saves(manager, best)
  if best:
    best.manager.close()
  final_step = manager.latest_step()
  manager.close()
  return final_step
