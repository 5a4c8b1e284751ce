"""What a run does when things go wrong: SIGTERM / Ctrl-C, a second run on a busy workdir, a
non-finite loss, damaged checkpoints, bad settings. Each case checks the one-line message (no
traceback) and that nothing already saved is lost."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import cli
from transformer_jax import checkpoints
from transformer_jax import commands
from transformer_jax import families
from transformer_jax import run_lock
from transformer_jax import train
from transformer_jax import workdir as workdir_lib


def _steps(workdir) -> list[int]:
  folder = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_checkpoint_and_exits_zero_and_a_second_run_is_refused(
    tmp_path, data_cache, sig):
  workdir = str(tmp_path / "run")
  first = cli.start(workdir, "--config.num_train_steps=100000", cache=data_cache)
  # Any saved step: at 100 steps/s the rotation removes step 10 between two looks.
  cli.wait_for(lambda: bool(_steps(workdir)), first)

  second = cli.run(workdir, "--config.num_train_steps=100000", cache=data_cache, timeout=120)
  assert second.returncode == 75
  message = cli.user_error(second.stderr)
  assert f"pid {first.pid}" in message and "is held by another run" in message

  code, _, err = cli.stop(first, sig)
  assert code == 0, err[-3000:]
  assert "Traceback" not in err
  assert "Re-run the same command to resume." in err.splitlines()[-1]
  assert _steps(workdir)[-1] > 10  # the step it stopped at, beside the periodic ones
  assert not os.path.exists(os.path.join(workdir, run_lock.LOCK_FILE))


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
  workdir = str(tmp_path)
  dead = subprocess.Popen([sys.executable, "-c", "pass"])  # a pid that existed and is gone
  dead.wait()
  held = run_lock.RunLock(workdir)
  held._holder["pid"] = dead.pid
  held.acquire()
  held._stop.set()
  held._thread.join()  # the "dead" run left its lock behind
  with run_lock.RunLock(workdir) as lock:
    assert f'"pid": {os.getpid()}' in open(lock.url).read()
  assert not os.path.exists(lock.url)


def test_lock_of_another_machine_is_stale_only_after_its_heartbeat_stops(tmp_path):
  lock = run_lock.RunLock(str(tmp_path), stale_after=600)
  other = dict(host="elsewhere", pid=1, boot_id="x", started="then")
  assert not lock._is_stale(dict(other, heartbeat=time.time() - 60))
  assert lock._is_stale(dict(other, heartbeat=time.time() - 601))


def test_non_finite_loss_stops_without_saving_and_keeps_the_good_checkpoints(tmp_path,
                                                                            data_cache):
  workdir = str(tmp_path)
  ok = cli.run(workdir, "--config.num_train_steps=10", cache=data_cache)
  assert ok.returncode == 0, ok.stderr[-3000:]
  # Checkpoints every 2 steps, log lines every 50: the check runs every step regardless.
  blown = cli.run(workdir, "--config.num_train_steps=30", "--config.learning_rate=1e30",
                  "--config.checkpoint_every_steps=2", "--config.log_every_steps=50",
                  cache=data_cache)
  assert blown.returncode == 1
  message = cli.user_error(blown.stderr)
  assert "non-finite" in message and "Last good checkpoint: step 10" in message
  assert _steps(workdir) == [10]
  evaluated = commands.run_evaluate(workdir, split="validation")
  assert np.isfinite(evaluated["loss"]) and evaluated["step"] == 10


def _flip_bytes(step_dir: str) -> None:
  """Flips bytes in the middle of the biggest array data file of a checkpoint."""
  files = [os.path.join(root, name) for root, _, names in os.walk(os.path.join(step_dir, "params"))
           for name in names if os.sep + "d" + os.sep in os.path.join(root, name)]
  biggest = max(files, key=os.path.getsize)
  data = bytearray(open(biggest, "rb").read())
  middle = len(data) // 2
  data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
  open(biggest, "wb").write(bytes(data))


def test_damaged_checkpoint_falls_back_to_the_newest_good_one(tmp_path, tiny_config):
  workdir = str(tmp_path)
  uninterrupted = train.train_and_evaluate(tiny_config, workdir)
  assert _steps(workdir) == [10, 20]
  _flip_bytes(os.path.join(workdir, "checkpoints", "20"))

  evaluated = commands.run_evaluate(workdir, split="validation")
  assert evaluated["step"] == 10
  with pytest.raises(checkpoints.CheckpointError, match="damaged"):
    commands.run_evaluate(workdir, step=20, split="validation")

  # Training sets the damaged step aside (kept, not deleted) and redoes it from step 10.
  resumed = train.train_and_evaluate(tiny_config, workdir)
  assert _steps(workdir) == [10, 20]
  assert os.listdir(os.path.join(workdir, checkpoints.DAMAGED_DIR)) == ["20"]
  np.testing.assert_allclose(resumed["loss"], uninterrupted["loss"], rtol=1e-5)

  for step in (10, 20):
    _flip_bytes(os.path.join(workdir, "checkpoints", str(step)))
  result = cli.run(workdir, "--mode", "evaluate")
  assert result.returncode == 1
  assert "No readable checkpoint" in cli.user_error(result.stderr)


@pytest.mark.parametrize("override", ["per_device_batch_size=0", "log_every_steps=0",
                                      "checkpoint_every_steps=-1", "num_train_steps=-5"])
def test_bad_settings_are_refused_before_the_workdir_is_made(tmp_path, data_cache, override):
  workdir = tmp_path / "never"
  result = cli.run(workdir, f"--config.{override}", cache=data_cache, timeout=120)
  assert result.returncode == 2  # a usage error: fix the command, do not retry it
  assert override.split("=")[0] in cli.user_error(result.stderr)
  assert not workdir.exists()


@pytest.fixture
def small_disk(tmp_path):
  """A 1.9 MB file system: room for the tiny run's token cache (340 KB) and two or three
  checkpoints of the tiny model (seen both in the full suite: the free space at each save
  varies), never all ten of a 100-step run."""
  disk = tmp_path / "disk"
  disk.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1900k", "tmpfs", str(disk)],
                    capture_output=True).returncode:
    pytest.skip("mounting a small tmpfs needs root")
  yield str(disk)
  subprocess.run(["umount", "-l", str(disk)], check=False)


def test_failed_background_save_stops_the_run_with_one_line(small_disk, data_cache):
  workdir = os.path.join(small_disk, "run")
  result = cli.run(workdir, "--config.num_train_steps=100", "--config.eval_every_steps=1000",
                   cache=data_cache)
  assert result.returncode == 1
  # Orbax's and TensorStore's writer threads print their own tracebacks as the write fails
  # (asyncio's "Event loop is closed", sometimes the write error at exit); the run's report is
  # one "error:" line among them. Their output can end without a line break, so the report
  # may start mid-line (seen in CI as "...RuntimeErrorE1123 ..."): it is looked for anywhere.
  errors = [line[line.index("error: "):] for line in result.stderr.splitlines()
            if "error: " in line]
  assert len(errors) == 1, result.stderr[-3000:]
  message = errors[0]
  assert "No space left on device" in message, message
  complete = _steps(workdir)  # the complete ones are still there and readable
  assert complete in ([10, 20], [10, 20, 30]), complete
  # Usually a checkpoint's write fails first; on a busy machine the TensorBoard file's can.
  assert (message.startswith("error: Saving a checkpoint")
          and f"from the last complete checkpoint ({complete[-1]})" in message) or (
              message.startswith(f"error: No space left on device: {workdir}/")
              and message.endswith("re-run the same command to resume)")), message
  _, step = checkpoints.restore_params(
      workdir, families.get(workdir_lib.load_config(workdir)).init_params)
  assert step == complete[-1]
