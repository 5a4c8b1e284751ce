"""The launch scripts: --dry_run prints the full command sequence (nothing is run); the
restart loop, the TPU workers' train command and the SLURM batch script run here against
stand-ins for python, srun, scontrol and gcloud."""

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time

import pytest

from tests.conftest import ROOT

TRAIN = ["--", "--config", "configs/wmt14_en_de.py", "--workdir", "/shared/runs/wmt"]
GS_TRAIN = ["--", "--config", "configs/wmt14_en_de.py", "--workdir", "gs://bkt/runs/wmt"]
COMMON = os.path.join(ROOT, "launch", "common.sh")

# A stand-in for a training run: records its arguments, then exits with the next code of
# $CODES (one per run); the code "term" waits for SIGTERM, "saves" and exits 0.
FAKE_RUN = textwrap.dedent("""\
    #!{python}
    import os, signal, sys, time
    with open(os.environ["RUNS_FILE"], "a") as f:
      f.write(" ".join(sys.argv[1:]) + "\\n")
    with open(os.environ["RUNS_FILE"]) as f:
      run = len(f.readlines()) - 1
    codes = os.environ.get("CODES", "0").split()
    code = codes[min(run, len(codes) - 1)]
    if code == "term":
      got = []
      signal.signal(signal.SIGTERM, lambda *_: got.append(1))
      open(os.environ["RUNS_FILE"] + ".waiting", "w").close()
      while not got:
        time.sleep(0.02)
      time.sleep(0.3)  # finishing the step and saving
      print("saved", flush=True)
      sys.exit(0)
    sys.exit(int(code))
    """).format(python=sys.executable)


def _dry_run(script, *args, env=None):
  return subprocess.run([os.path.join(ROOT, "launch", script), "--dry_run", *args],
                        capture_output=True, text=True, check=True, env=env).stdout


def _fake(directory, name, text):
  path = directory / name
  path.write_text(text)
  path.chmod(0o755)
  return str(path)


def _wait_for(predicate, timeout=30):
  deadline = time.time() + timeout
  while not predicate():
    assert time.time() < deadline, "timed out"
    time.sleep(0.05)


def _ssh_command(line):
  """The --command of a printed `gcloud ... ssh` line, as the worker's shell receives it."""
  words = shlex.split(line)
  return next(w for w in words if w.startswith("--command="))[len("--command="):]


def test_tpu_vm_dry_run_prints_each_gcloud_step():
  out = {action: _dry_run("tpu_vm.sh", "--name", "wmt", "--type", "v4-32", action, *TRAIN)
         for action in ("create", "setup", "train", "status", "logs", "stop", "delete")}
  assert out["create"].strip() == ("gcloud compute tpus tpu-vm create wmt --zone=us-central2-b "
                                   "--accelerator-type=v4-32 --version=tpu-ubuntu2204-base")
  setup = out["setup"].splitlines()
  assert len(setup) == 4
  assert setup[0].startswith("env COPYFILE_DISABLE=1 tar -czf /")
  for exclude in ("./runs", "./.git", "__pycache__", ".pytest_cache", ".mypy_cache",
                  ".ruff_cache", "./.venv", "./venv"):
    assert f" --exclude={exclude} " in setup[0]
  assert setup[0].endswith(f" -C {ROOT} .")
  assert setup[1].startswith("gcloud compute tpus tpu-vm scp /")
  assert setup[1].endswith(" wmt:transformer_jax.tar.gz --zone=us-central2-b --worker=all")
  assert setup[2].startswith("rm -f /")
  install = _ssh_command(setup[3])
  assert "--worker=all" in setup[3]
  assert "tar -xzf ~/transformer_jax.tar.gz -C ~/transformer_jax" in install
  assert "uv venv --python 3.11 ~/venv && source ~/venv/bin/activate" in install
  assert install.endswith("cd ~/transformer_jax && uv pip install -r requirements.txt "
                          "'jax[tpu]'")
  assert "--worker=all" in out["train"]
  assert _ssh_command(out["train"]) == (
      "set -e; cd ~/transformer_jax; source ~/venv/bin/activate; nohup bash launch/common.sh "
      "restart_loop 10 python -m transformer_jax.main --multihost --config "
      "configs/wmt14_en_de.py --workdir /shared/runs/wmt >> ~/wmt.log 2>&1 < /dev/null &")
  assert "tail -n 5 ~/wmt.log" in _ssh_command(out["status"])
  assert "--worker=0" in out["logs"] and _ssh_command(out["logs"]) == "tail -n 50 -F ~/wmt.log"
  assert _ssh_command(out["stop"]) == "pkill -TERM -f '[r]estart_loop' || true"
  assert out["delete"].strip().endswith("tpu-vm delete wmt --zone=us-central2-b --quiet")


def test_tpu_vm_spot_queued_python_and_restart_options():
  create = _dry_run("tpu_vm.sh", "--name", "wmt", "--type", "v4-32", "--spot", "create")
  assert create.strip() == ("gcloud compute tpus tpu-vm create wmt --zone=us-central2-b "
                            "--accelerator-type=v4-32 --spot --version=tpu-ubuntu2204-base")
  queued = _dry_run("tpu_vm.sh", "--name", "wmt", "--type", "v5litepod-16", "--spot",
                    "--queued", "--project", "p", "create")
  assert queued.strip() == ("gcloud compute tpus queued-resources create wmt --node-id=wmt "
                            "--zone=us-central2-b --project=p --accelerator-type=v5litepod-16 "
                            "--spot --runtime-version=v2-alpha-tpuv5-lite")
  status = _dry_run("tpu_vm.sh", "--name", "wmt", "--queued", "status").splitlines()
  assert status[0] == ("gcloud compute tpus queued-resources describe wmt "
                       "--zone=us-central2-b '--format=value(state.state)'")
  delete = _dry_run("tpu_vm.sh", "--name", "wmt", "--queued", "delete")
  assert delete.strip() == ("gcloud compute tpus queued-resources delete wmt "
                            "--zone=us-central2-b --force --quiet")
  setup = _dry_run("tpu_vm.sh", "--python", "3.12", "setup").splitlines()
  assert "uv venv --python 3.12 ~/venv" in _ssh_command(setup[-1])
  train = _dry_run("tpu_vm.sh", "--max_restarts", "3", "train", *TRAIN)
  assert "restart_loop 3 python -m transformer_jax.main" in _ssh_command(train)


def test_tpu_vm_setup_tarball_leaves_out_runs_git_and_caches(tmp_path):
  """The tar command of `setup`, run on a checkout with a run, git data and caches in it."""
  repo = tmp_path / "repo"
  files = ["launch/tpu_vm.sh", "launch/common.sh", "requirements.txt", "pkg/model.py",
           "pkg/runs/kept.py", "runs/demo/checkpoint", ".git/HEAD", "pkg/__pycache__/model.pyc",
           ".pytest_cache/v", ".mypy_cache/m", ".ruff_cache/r", "pkg.egg-info/PKG-INFO",
           ".venv/bin/python", "venv/bin/python", ".ipynb_checkpoints/n.ipynb"]
  for name in files:
    (repo / name).parent.mkdir(parents=True, exist_ok=True)
    if name.startswith("launch/"):
      shutil.copy(os.path.join(ROOT, name), repo / name)
    else:
      (repo / name).write_text("x")
  (repo / "launch" / "tpu_vm.sh").chmod(0o755)
  env = dict(os.environ, TMPDIR=str(tmp_path))
  tar_line = subprocess.run([str(repo / "launch" / "tpu_vm.sh"), "--dry_run", "--name", "wmt",
                             "setup"], capture_output=True, text=True, check=True,
                            env=env).stdout.splitlines()[0]
  subprocess.run(shlex.split(tar_line), check=True, cwd=tmp_path)
  with tarfile.open(tmp_path / "wmt-transformer_jax.tar.gz") as tar:
    names = {name for name in tar.getnames() if tar.getmember(name).isfile()}
  assert names == {"./launch/tpu_vm.sh", "./launch/common.sh", "./requirements.txt",
                   "./pkg/model.py", "./pkg/runs/kept.py"}


def test_tpu_vm_train_command_runs_on_a_worker_with_restarts_and_log_upload(tmp_path):
  """The worker's shell command, run here: ~/transformer_jax is this checkout, ~/venv puts a
  stand-in python first on the PATH, and gcloud records the log copies."""
  home = tmp_path / "home"
  bin_dir = tmp_path / "bin"
  (home / "venv" / "bin").mkdir(parents=True)
  bin_dir.mkdir()
  os.symlink(ROOT, home / "transformer_jax")
  (home / "venv" / "bin" / "activate").write_text(f'PATH="{bin_dir}:$PATH"\n')
  _fake(bin_dir, "python", FAKE_RUN)
  _fake(bin_dir, "gcloud", '#!/usr/bin/env bash\necho "$*" >> "$GCLOUD_FILE"\n')
  runs, copies = tmp_path / "runs.txt", tmp_path / "gcloud.txt"
  line = _dry_run("tpu_vm.sh", "--name", "wmt", "train", *GS_TRAIN)
  command = _ssh_command(line)
  assert command.endswith(
      "nohup bash launch/common.sh upload_log $! ~/wmt.log gs://bkt/runs/wmt/logs/$(hostname).log"
      " >> ~/wmt.upload.log 2>&1 < /dev/null &")
  env = dict(os.environ, HOME=str(home), RUNS_FILE=str(runs), GCLOUD_FILE=str(copies),
             CODES="139 137 0", RESTART_DELAY_S="0", LOG_UPLOAD_S="0.1")
  subprocess.run(["bash", "-c", command], check=True, env=env, cwd=tmp_path, timeout=30)
  hostname = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
  destination = f"gs://bkt/runs/wmt/logs/{hostname}.log"
  # upload_log makes its last copy once the restart loop has ended, then ends too.
  uploading = ["pgrep", "-f", f"[u]pload_log .* {home}/wmt.log"]
  _wait_for(lambda: copies.exists() and subprocess.run(uploading).returncode == 1)
  assert runs.read_text().splitlines() == [
      "-m transformer_jax.main --multihost --config configs/wmt14_en_de.py "
      "--workdir gs://bkt/runs/wmt"] * 3
  log = (home / "wmt.log").read_text()
  assert "exit status 139; restart 1 of 10" in log and "exit status 137; restart 2 of 10" in log
  assert copies.read_text().splitlines()[-1] == (
      f"storage cp --quiet {home}/wmt.log {destination}")


def _restart_loop(tmp_path, codes, max_restarts=3, signal_after_start=False):
  runs = tmp_path / "runs.txt"
  fake = _fake(tmp_path, "fake_run", FAKE_RUN)
  env = dict(os.environ, RUNS_FILE=str(runs), CODES=codes, RESTART_DELAY_S="0")
  process = subprocess.Popen(["bash", COMMON, "restart_loop", str(max_restarts), fake, "x"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  if signal_after_start:
    _wait_for(lambda: os.path.exists(str(runs) + ".waiting"))
    process.send_signal(signal.SIGTERM)
  stdout, stderr = process.communicate(timeout=30)
  return process.returncode, len(runs.read_text().splitlines()), stdout, stderr


@pytest.mark.parametrize("codes, exit_code, runs", [
    ("0", 0, 1),              # finished (or stopped after saving)
    ("139 137 134 0", 0, 4),  # crashes are restarted
    ("139 1", 1, 2),          # an error the run reported: no restart
    ("2", 2, 1),              # bad flags or config
    ("75", 75, 1),            # the workdir is locked by another run
    ("9 9 9 9 9 9", 9, 4),    # at most --max_restarts (3) restarts
])
def test_restart_loop_restarts_crashes_only(tmp_path, codes, exit_code, runs):
  code, count, _, stderr = _restart_loop(tmp_path, codes)
  assert (code, count) == (exit_code, runs), stderr
  if runs == 4 and exit_code == 9:
    assert "gave up after 3 restarts" in stderr


def test_restart_loop_passes_sigterm_on_and_does_not_restart(tmp_path):
  code, count, stdout, stderr = _restart_loop(tmp_path, "term 0", signal_after_start=True)
  assert (code, count) == (0, 1)
  assert stdout == "saved\n"
  assert "stopped by a signal; exit status 0" in stderr


def _slurm_script(tmp_path, *flags):
  out = _dry_run("gpu_cluster.sh", "slurm", "--nodes", "2", "--repo", ROOT, *flags, *TRAIN)
  lines = out.splitlines()
  assert lines[0] == "sbatch <<'SBATCH'" and lines[-1] == "SBATCH"
  path = tmp_path / "job.sh"
  path.write_text("\n".join(lines[1:-1]) + "\n")
  return path


def test_gpu_cluster_dry_run_prints_sbatch_script_and_ssh_commands(tmp_path):
  slurm = _slurm_script(tmp_path, "--time", "24:00:00", "--account", "acct", "--partition",
                        "gpu", "--env", "/shared/venvs/tj").read_text()
  header = [line for line in slurm.splitlines() if line.startswith("#SBATCH")]
  assert header == ["#SBATCH --job-name=transformer_jax", "#SBATCH --nodes=2",
                    "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                    "#SBATCH --output=transformer_jax_%j.log", "#SBATCH --open-mode=append",
                    "#SBATCH --requeue", "#SBATCH --signal=B:TERM@120",
                    "#SBATCH --time=24:00:00", "#SBATCH --account=acct",
                    "#SBATCH --partition=gpu"]
  body = slurm.split("#SBATCH --partition=gpu\n")[1]
  assert body.startswith(f"cd {ROOT} || exit 1\nsource /shared/venvs/tj/bin/activate || exit 1\n"
                         "export XLA_FLAGS='--xla_gpu_enable_latency_hiding_scheduler=true")
  assert ("restart_loop 10 srun python -m transformer_jax.main --multihost --config "
          "configs/wmt14_en_de.py --workdir /shared/runs/wmt\n") in body
  assert 'scontrol requeue "$SLURM_JOB_ID"' in body
  conda = _slurm_script(tmp_path, "--env", "tj").read_text()
  assert 'eval "$(conda shell.bash hook)" && conda activate tj || exit 1\n' in conda
  assert "#SBATCH --time" not in conda and "#SBATCH --partition" not in conda

  ssh = _dry_run("gpu_cluster.sh", "ssh", "--hosts", "g0,g1", "--env", "/v", *TRAIN).splitlines()
  assert len(ssh) == 2
  for i, line in enumerate(ssh):
    assert line.startswith(f"ssh g{i} ")
    command = shlex.split(line)[2]
    assert command.startswith("cd $HOME/transformer_jax && source /v/bin/activate && XLA_FLAGS=")
    assert (f"nohup bash launch/common.sh restart_loop 10 python -m transformer_jax.main "
            f"--coordinator_address=g0:1234 --num_processes=2 --process_id={i} "
            "--config configs/wmt14_en_de.py --workdir /shared/runs/wmt "
            ">> ~/transformer_jax_train.log 2>&1 < /dev/null &") in command


@pytest.mark.parametrize("codes, signalled, requeued", [
    ("term", True, True),  # SIGTERM before the time limit: save, exit 0, requeue
    ("0", False, False),   # training finished: the job ends
    ("75", False, False),  # the workdir is locked: the job ends
])
def test_slurm_batch_script_requeues_after_sigterm_only(tmp_path, codes, signalled, requeued):
  """The batch script, run here with srun and scontrol stand-ins; the signal goes to the batch
  shell alone, as `#SBATCH --signal=B:TERM@120` sends it."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  _fake(bin_dir, "srun", FAKE_RUN)
  _fake(bin_dir, "scontrol", '#!/usr/bin/env bash\necho "$*" >> "$SCONTROL_FILE"\n')
  runs, scontrol = tmp_path / "runs.txt", tmp_path / "scontrol.txt"
  env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242",
             RUNS_FILE=str(runs), SCONTROL_FILE=str(scontrol), CODES=codes)
  process = subprocess.Popen(["bash", str(_slurm_script(tmp_path))], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  if signalled:
    _wait_for(lambda: os.path.exists(str(runs) + ".waiting"))
    process.send_signal(signal.SIGTERM)
  stdout, stderr = process.communicate(timeout=30)
  assert runs.read_text().splitlines() == [
      "python -m transformer_jax.main --multihost --config configs/wmt14_en_de.py "
      "--workdir /shared/runs/wmt"]
  assert process.returncode == (0 if signalled else int(codes)), stderr
  if requeued:
    assert scontrol.read_text() == "requeue 4242\n"
    assert "Requeueing job 4242" in stdout
  else:
    assert not scontrol.exists()


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_launch_scripts_are_shellcheck_clean(tmp_path):
  for script in ("tpu_vm.sh", "gpu_cluster.sh", "common.sh"):
    subprocess.run(["shellcheck", "-x", os.path.join(ROOT, "launch", script)], check=True)
  # The generated batch script too (SC1091: the virtual environment is not here to follow).
  job = _slurm_script(tmp_path, "--env", "/shared/venvs/tj")
  subprocess.run(["shellcheck", "-x", "-e", "SC1091", str(job)], check=True, cwd=ROOT)
