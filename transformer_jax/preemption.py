"""Stop cleanly on SIGTERM (how spot TPUs, SLURM and Kubernetes preempt) or Ctrl-C.

The training loop asks `should_stop(step)` after every step; when it says yes the loop saves
a checkpoint at that step and exits 0, and re-running the same command resumes there. Several
hosts must stop at the same step: there JAX's preemption service (started by
jax.distributed.initialize) owns SIGTERM, spreads the notice to every host and names the step
they all stop at (`reached_preemption_sync_point`); Ctrl-C is turned into a SIGTERM for it.
A second Ctrl-C interrupts at once, without saving.
"""

from __future__ import annotations

import os
import signal

import jax
from absl import logging
from jax.experimental import multihost_utils


class PreemptionWatcher:
  """Installs the signal handlers for its lifetime (use as a context manager)."""

  def __init__(self):
    self.received: int | None = None
    self._multihost = jax.process_count() > 1
    # jax.distributed.initialize installed JAX's SIGTERM notifier from C++ (Python's
    # signal.getsignal cannot see it); a Python SIGTERM handler would replace it.
    self._jax_owns_sigterm = self._multihost and jax.config.jax_enable_preemption_service
    self._previous = {}

  def __enter__(self) -> "PreemptionWatcher":
    signals = [signal.SIGINT] if self._jax_owns_sigterm else [signal.SIGINT, signal.SIGTERM]
    if self._multihost and not self._jax_owns_sigterm:
      logging.warning("JAX's preemption service is off: a SIGTERM stops each host at its own "
                      "step, which may leave the hosts' checkpoints inconsistent.")
    for sig in signals:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _handle(self, signum, frame) -> None:
    del frame
    if self.received is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # the second Ctrl-C: stop now
    self.received = signum
    logging.warning("Received %s: finishing this step, then saving a checkpoint and stopping "
                    "(Ctrl-C again stops without saving).", signal.Signals(signum).name)
    if self._jax_owns_sigterm:
      os.kill(os.getpid(), signal.SIGTERM)  # JAX's notifier tells the other hosts

  def should_stop(self, step: int) -> bool:
    """Whether to save and stop after `step`; called by every host after every step."""
    if self._jax_owns_sigterm:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.received is not None
