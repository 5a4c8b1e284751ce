"""The launch scripts' --dry_run prints the full command sequence (nothing is run)."""

import os
import shutil
import subprocess

import pytest

from tests.conftest import ROOT

TRAIN = ["--", "--config", "configs/wmt14_en_de.py", "--workdir", "/shared/runs/wmt"]


def _dry_run(script, *args):
  return subprocess.run([os.path.join(ROOT, "launch", script), "--dry_run", *args],
                        capture_output=True, text=True, check=True).stdout


def test_tpu_vm_dry_run_prints_each_gcloud_step():
  lines = [_dry_run("tpu_vm.sh", "--name", "wmt", "--type", "v4-32", action, *TRAIN)
           for action in ("create", "setup", "train", "status", "delete")]
  assert lines[0].strip() == ("gcloud compute tpus tpu-vm create wmt --zone=us-central2-b "
                              "--accelerator-type=v4-32 --version=tpu-ubuntu2204-base")
  assert "--worker=all" in lines[1] and "pip install -r requirements.txt" in lines[1]
  assert ("--worker=all '--command=cd ~/transformer_jax && nohup python3 -m "
          "transformer_jax.main --multihost --config configs/wmt14_en_de.py --workdir "
          "/shared/runs/wmt > ~/wmt.log 2>&1 &'") in lines[2]
  assert "tail -n 5 ~/wmt.log" in lines[3]
  assert lines[4].strip().endswith("delete wmt --zone=us-central2-b --quiet")


def test_gpu_cluster_dry_run_prints_sbatch_script_and_ssh_commands():
  slurm = _dry_run("gpu_cluster.sh", "slurm", "--nodes", "2", *TRAIN)
  assert "#SBATCH --nodes=2" in slurm and "#SBATCH --gpus-per-node=8" in slurm
  assert ("srun python -m transformer_jax.main --multihost --config configs/wmt14_en_de.py "
          "--workdir /shared/runs/wmt") in slurm
  ssh = _dry_run("gpu_cluster.sh", "ssh", "--hosts", "g0,g1", *TRAIN).splitlines()
  assert len(ssh) == 2
  for i, line in enumerate(ssh):
    assert line.startswith(f"ssh g{i} ")
    assert (f"--coordinator_address=g0:1234 --num_processes=2 --process_id={i} "
            "--config configs/wmt14_en_de.py") in line


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_launch_scripts_are_shellcheck_clean():
  for script in ("tpu_vm.sh", "gpu_cluster.sh"):
    subprocess.run(["shellcheck", "-x", os.path.join(ROOT, "launch", script)], check=True)
