#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Multi-node GPU training: one process per node, every local GPU used by that process.
#
#   launch/gpu_cluster.sh [--dry_run] slurm --nodes N [--partition P] [--gpus_per_node 8] -- ARGS
#   launch/gpu_cluster.sh [--dry_run] ssh --hosts h0,h1,... [--port 1234] [--repo DIR] -- ARGS
#
# slurm: submits (sbatch) a job whose srun starts `python -m transformer_jax.main --multihost
#        ARGS` on every node; JAX reads the coordinator and process ids from SLURM.
# ssh:   starts the same command on every host over ssh, in the background, with explicit
#        --coordinator_address=h0:PORT --num_processes=N --process_id=I; output in
#        ~/transformer_jax_train.log on each host.
# ARGS are main's flags: --config configs/X.py --workdir DIR (a folder every node shares).
# XLA_FLAGS: --xla_gpu_enable_latency_hiding_scheduler=true (collectives overlap compute) is
# set on every node, plus whatever XLA_FLAGS holds where this script runs.
# --dry_run prints the commands (and the sbatch script) instead of running them.
set -euo pipefail

dry_run=false
mode=""
nodes=""
partition=""
gpus_per_node=8
hosts=""
port=1234
repo="\$HOME/transformer_jax"
train_args=()

usage() { awk 'NR > 2 && /^#/ { sub(/^# ?/, ""); print; next } NR > 2 { exit }' "$0"; exit "${1:-0}"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry_run) dry_run=true ;;
    --nodes) nodes="$2"; shift ;;
    --partition) partition="$2"; shift ;;
    --gpus_per_node) gpus_per_node="$2"; shift ;;
    --hosts) hosts="$2"; shift ;;
    --port) port="$2"; shift ;;
    --repo) repo="$2"; shift ;;
    -h|--help) usage 0 ;;
    --) shift; train_args=("$@"); break ;;
    slurm|ssh) mode="$1" ;;
    *) echo "unknown argument: $1" >&2; usage 2 ;;
  esac
  shift
done
[[ -n "$mode" ]] || usage 2
[[ ${#train_args[@]} -gt 0 ]] || { echo "needs: -- --config ... --workdir ..." >&2; exit 2; }
printf -v quoted_args '%q ' "${train_args[@]}"
xla_flags="--xla_gpu_enable_latency_hiding_scheduler=true${XLA_FLAGS:+ ${XLA_FLAGS}}"

# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"

if [[ "$mode" == slurm ]]; then
  [[ -n "$nodes" ]] || { echo "slurm needs --nodes N" >&2; exit 2; }
  script="#!/usr/bin/env bash
#SBATCH --job-name=transformer_jax
#SBATCH --nodes=${nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=${gpus_per_node}
#SBATCH --output=transformer_jax_%j.log
${partition:+#SBATCH --partition=${partition}
}cd ${repo}
export XLA_FLAGS='${xla_flags}'
srun python -m transformer_jax.main --multihost ${quoted_args}"
  if "$dry_run"; then
    echo "sbatch <<'SBATCH'"; echo "$script"; echo "SBATCH"
  else
    sbatch <<< "$script"
  fi
  exit 0
fi

[[ -n "$hosts" ]] || { echo "ssh needs --hosts h0,h1,..." >&2; exit 2; }
IFS=, read -r -a host_list <<< "$hosts"
coordinator="${host_list[0]}:${port}"
for i in "${!host_list[@]}"; do
  run ssh "${host_list[$i]}" "cd ${repo} && XLA_FLAGS='${xla_flags}' nohup python -m transformer_jax.main \
--coordinator_address=${coordinator} --num_processes=${#host_list[@]} --process_id=${i} \
${quoted_args}> ~/transformer_jax_train.log 2>&1 &"
done
