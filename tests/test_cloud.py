"""gs:// workdirs against a real GCS emulator (fake-gcs-server): train, kill -9, resume from
the bucket, evaluate, predict from and to the bucket, TensorBoard events, and two processes
sharing one gs:// workdir through a SIGTERM and a resume. Everything goes through the command
line, with STORAGE_EMULATOR_HOST the only setting, as a user would run it."""

import datetime
import json
import os
import signal
import time

import pytest
from tensorboard.backend.event_processing import event_accumulator

from tests import cli
from tests.conftest import ROOT


@pytest.fixture
def bucket(gcs_emulator):
  return cli.Bucket(gcs_emulator, "test-bucket")


def test_train_kill_resume_evaluate_predict_on_a_bucket(gcs_emulator, bucket, data_cache,
                                                        tmp_path):
  workdir = "gs://test-bucket/run"
  environ = cli.env(STORAGE_EMULATOR_HOST=gcs_emulator)
  # Killed with SIGKILL once a checkpoint is in the bucket (which one depends on the machine's
  # speed: a busy one may look after several); the resumed run trains 10 steps past it.
  first = cli.start(workdir, "--config.num_train_steps=100000", cache=data_cache,
                    environ=environ)
  cli.wait_for(lambda: bool(bucket.steps("run")), first)
  first.kill()
  first.communicate()
  last = bucket.steps("run")[-1] + 10
  names = bucket.names("run/")
  assert {"run/config.json", "run/tokenizer.model", "run/RUN_LOCK"} <= set(names)
  assert not os.path.exists(os.path.join(ROOT, "gs:"))  # nothing went to a local "gs:" folder

  # The same command resumes from the bucket; the dead run's lock is taken over.
  resumed = cli.run(workdir, f"--config.num_train_steps={last}", cache=data_cache,
                    environ=environ)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Taking over the lock of a run that is gone" in resumed.stderr
  assert "Resumed from checkpoint at step" in resumed.stderr
  assert bucket.steps("run")[-1] == last
  assert "run/RUN_LOCK" not in bucket.names("run/")  # released at the end

  # TensorBoard events in the bucket: scalars at log steps, eval metrics and samples.
  runs = {}
  for run in ("train", "eval"):
    events = [n for n in bucket.names(f"run/{run}/events.out.tfevents")]
    assert events
    local = tmp_path / "events" / run
    local.mkdir(parents=True)
    for name in events:
      (local / name.split("/")[-1]).write_bytes(bucket.read(name))
    runs[run] = event_accumulator.EventAccumulator(str(local))
    runs[run].Reload()
  assert "loss" in runs["train"].Tags()["scalars"]
  assert {"loss", "bleu"} <= set(runs["eval"].Tags()["scalars"])
  assert [e.step for e in runs["eval"].Scalars("loss")][-1] == last
  assert "samples" in runs["eval"].Tags()["tensors"]

  evaluated = cli.run(workdir, "--mode", "evaluate", environ=environ)
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  result = json.loads(evaluated.stdout.strip().splitlines()[-1])
  assert result["step"] == last and result["loss"] > 0

  bucket.write("inputs/in.txt", b"The dog sees the cat.\r\n\nOften a child finds our birds.\n")
  predicted = cli.run(workdir, "--mode", "predict", "--input", "gs://test-bucket/inputs/in.txt",
                      "--output", "gs://test-bucket/outputs/out.txt", environ=environ)
  assert predicted.returncode == 0, predicted.stderr[-3000:]
  lines = bucket.read("outputs/out.txt").decode().split("\n")
  assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # 3 lines, the 2nd empty


def _log_time(stderr: str, text: str) -> float:
  """Seconds since the epoch of the absl log line (this year, local time) containing `text`."""
  line = next(l for l in reversed(stderr.splitlines()) if text in l)
  stamp = datetime.datetime.strptime(f"{datetime.date.today().year}{line[1:21]}",
                                     "%Y%m%d %H:%M:%S.%f")
  return stamp.timestamp()


def test_two_processes_share_a_workdir_through_sigterm_and_resume(gcs_emulator, bucket,
                                                                  data_cache):
  """On a bucket (the preemption path is the same on a local disk, where the rest of the
  suite saves and resumes)."""
  workdir, steps = "gs://test-bucket/two", lambda: bucket.steps("two")
  environ = cli.env(devices=4, STORAGE_EMULATOR_HOST=gcs_emulator)

  def start_both(num_steps):
    port = cli.free_port()
    return [cli.start(workdir, f"--coordinator_address=localhost:{port}", "--num_processes=2",
                      f"--process_id={i}", f"--config.num_train_steps={num_steps}",
                      "--config.per_device_batch_size=2", cache=data_cache, environ=environ)
            for i in range(2)]

  runs = start_both(1000)
  cli.wait_for(lambda: 10 in steps(), runs[0])
  # A preemption notice to one host: JAX's preemption service tells the other, both save the
  # same step and exit 0.
  code, _, err = cli.stop(runs[1], signal.SIGTERM)
  _, other_err = runs[0].communicate(timeout=cli.HANG)
  assert code == 0 and runs[0].returncode == 0, (err[-2000:], other_err[-2000:])
  assert "Traceback" not in err + other_err
  assert "Re-run the same command to resume" in err
  saved = steps()[-1]
  assert saved > 10

  # The same command on both hosts resumes there, finishes, saves and exits without hanging
  # after its last step.
  final = saved + 10
  runs = start_both(final)
  outputs = [r.communicate(timeout=300) for r in runs]
  ended = time.time()
  for run, (_, err) in zip(runs, outputs):
    assert run.returncode == 0, err[-3000:]
    assert f"Resumed from checkpoint at step {saved}" in err
    assert ended - _log_time(err, f"step {final}/{final}:") < cli.HANG
  assert steps()[-1] == final
