#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Multi-node GPU training: one process per node, every local GPU used by that process.
#
#   launch/gpu_cluster.sh [--dry_run] slurm --nodes N [--gpus_per_node 8] [--time 24:00:00]
#       [--account A] [--partition P] [--env ENV] [--repo DIR] [--max_restarts 10] -- ARGS
#   launch/gpu_cluster.sh [--dry_run] ssh --hosts h0,h1,... [--port 1234] [--repo DIR]
#       [--env ENV] [--max_restarts 10] -- ARGS
#
# slurm: submits (sbatch) a job whose srun starts `python -m transformer_jax.main --multihost
#        ARGS` on every node; JAX reads the coordinator and process ids from SLURM. --repo is
#        this checkout by default (it must be on a file system the nodes share). Output goes
#        to transformer_jax_JOBID.log in the folder sbatch ran in. The job is requeueable:
#        SLURM sends SIGTERM 120 s before --time runs out (#SBATCH --signal=B:TERM@120), the
#        batch script passes it on to srun, every task finishes its step, saves a checkpoint
#        and exits, and the script requeues the job (scontrol requeue), which resumes from
#        that checkpoint when it starts again. It requeues only after a SIGTERM, so a job that
#        finished training, or failed with exit 1, 2 or 75, stays finished.
# ssh:   starts the same command on every host over ssh, in the background, with explicit
#        --coordinator_address=h0:PORT --num_processes=N --process_id=I; output appended to
#        ~/transformer_jax_train.log on each host. --repo defaults to ~/transformer_jax.
# Both run main under a restart loop (launch/common.sh restart_loop): a crashed run starts
# again, at most --max_restarts times, but not after exit 0 (done, or stopped and saved),
# 1 (an error), 2 (bad flags) or 75 (another run holds the workdir's lock).
# --env: the Python environment on the nodes: a path with a / is a virtual environment
# (source ENV/bin/activate), a bare name a conda environment (conda activate ENV; conda must
# be on the PATH of batch jobs). Without it, whatever `python` the nodes have.
# ARGS are main's flags: --config configs/X.py --workdir DIR (a folder every node shares, or
# gs://BUCKET/...).
# XLA_FLAGS: --xla_gpu_enable_latency_hiding_scheduler=true (collectives overlap compute) is
# set on every node, plus whatever XLA_FLAGS holds where this script runs.
# --dry_run prints the commands (and the sbatch script) instead of running them.
set -euo pipefail

dry_run=false
mode=""
nodes=""
partition=""
account=""
time_limit=""
env=""
gpus_per_node=8
hosts=""
port=1234
repo=""
max_restarts=10
train_args=()

usage() { awk 'NR > 2 && /^#/ { sub(/^# ?/, ""); print; next } NR > 2 { exit }' "$0"; exit "${1:-0}"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry_run) dry_run=true ;;
    --nodes) nodes="$2"; shift ;;
    --partition) partition="$2"; shift ;;
    --account) account="$2"; shift ;;
    --time) time_limit="$2"; shift ;;
    --env) env="$2"; shift ;;
    --gpus_per_node) gpus_per_node="$2"; shift ;;
    --hosts) hosts="$2"; shift ;;
    --port) port="$2"; shift ;;
    --repo) repo="$2"; shift ;;
    --max_restarts) max_restarts="$2"; shift ;;
    -h|--help) usage 0 ;;
    --) shift; train_args=("$@"); break ;;
    slurm|ssh) mode="$1" ;;
    *) echo "unknown argument: $1" >&2; usage 2 ;;
  esac
  shift
done
[[ -n "$mode" ]] || usage 2
[[ ${#train_args[@]} -gt 0 ]] || { echo "needs: -- --config ... --workdir ..." >&2; exit 2; }
[[ "$max_restarts" =~ ^[0-9]+$ ]] || { echo "--max_restarts needs a number" >&2; exit 2; }
printf -v quoted_args '%q ' "${train_args[@]}"
xla_flags="--xla_gpu_enable_latency_hiding_scheduler=true${XLA_FLAGS:+ ${XLA_FLAGS}}"
quoted_args="${quoted_args% }"
activate=""
if [[ "$env" == */* ]]; then
  printf -v activate 'source %q/bin/activate' "${env%/}"
elif [[ -n "$env" ]]; then
  # shellcheck disable=SC2016  # $(...) runs on the nodes
  printf -v activate 'eval "$(conda shell.bash hook)" && conda activate %q' "$env"
fi

# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"

if [[ "$mode" == slurm ]]; then
  [[ -n "$nodes" ]] || { echo "slurm needs --nodes N" >&2; exit 2; }
  [[ -n "$repo" ]] || repo="$(cd "$(dirname "$0")/.." && pwd)"
  printf -v repo_q '%q' "$repo"
  # SLURM reads #SBATCH lines only before the first command.
  script="#!/usr/bin/env bash
#SBATCH --job-name=transformer_jax
#SBATCH --nodes=${nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=${gpus_per_node}
#SBATCH --output=transformer_jax_%j.log
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:TERM@120
${time_limit:+#SBATCH --time=${time_limit}
}${account:+#SBATCH --account=${account}
}${partition:+#SBATCH --partition=${partition}
}cd ${repo_q} || exit 1
${activate:+${activate} || exit 1
}export XLA_FLAGS='${xla_flags}'
source launch/common.sh
# restart_loop passes a SIGTERM (SLURM's, before the time limit or on preemption) on to srun,
# which passes it to every task: they save a checkpoint and exit.
restart_loop ${max_restarts} srun python -m transformer_jax.main --multihost ${quoted_args}
code=\$?
if \"\$restart_loop_stopped\" && [[ ! \$code =~ ^(1|2|75)\$ ]]; then
  echo \"Requeueing job \$SLURM_JOB_ID to resume from its checkpoint.\"
  scontrol requeue \"\$SLURM_JOB_ID\"
fi
exit \"\$code\""
  if "$dry_run"; then
    echo "sbatch <<'SBATCH'"; echo "$script"; echo "SBATCH"
  else
    sbatch <<< "$script"
  fi
  exit 0
fi

[[ -n "$hosts" ]] || { echo "ssh needs --hosts h0,h1,..." >&2; exit 2; }
[[ -n "$repo" ]] || repo="\$HOME/transformer_jax"
IFS=, read -r -a host_list <<< "$hosts"
coordinator="${host_list[0]}:${port}"
for i in "${!host_list[@]}"; do
  run ssh "${host_list[$i]}" "cd ${repo} && ${activate:+${activate} && }XLA_FLAGS='${xla_flags}' \
nohup bash launch/common.sh restart_loop ${max_restarts} python -m transformer_jax.main \
--coordinator_address=${coordinator} --num_processes=${#host_list[@]} --process_id=${i} \
${quoted_args} >> ~/transformer_jax_train.log 2>&1 < /dev/null &"
done
