#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Cloud TPU VM (single host or slice): create, install, train on every worker, watch, delete.
#
#   launch/tpu_vm.sh [--dry_run] [--name N] [--zone Z] [--type v4-8] [--project P] ACTION [-- ARGS]
#
# ACTION:
#   create   create the TPU VM (a slice such as v4-32 has several workers)
#   setup    copy this checkout to every worker and pip install its requirements
#   train    start `python -m transformer_jax.main --multihost ARGS` on --worker=all in the
#            background, output in ~/NAME.log on each worker
#   status   the last lines of every worker's log
#   stop     kill the training processes
#   delete   delete the TPU VM
# --dry_run prints the gcloud commands instead of running them.
set -euo pipefail

name="transformer-jax"
zone="us-central2-b"
type="v4-8"
version="tpu-ubuntu2204-base"
project=""
dry_run=false
action=""
train_args=()

usage() { awk 'NR > 2 && /^#/ { sub(/^# ?/, ""); print; next } NR > 2 { exit }' "$0"; exit "${1:-0}"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry_run) dry_run=true ;;
    --name) name="$2"; shift ;;
    --zone) zone="$2"; shift ;;
    --type) type="$2"; shift ;;
    --version) version="$2"; shift ;;
    --project) project="$2"; shift ;;
    -h|--help) usage 0 ;;
    --) shift; train_args=("$@"); break ;;
    create|setup|train|status|stop|delete) action="$1" ;;
    *) echo "unknown argument: $1" >&2; usage 2 ;;
  esac
  shift
done
[[ -n "$action" ]] || usage 2

# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"

gcloud_tpu=(gcloud compute tpus tpu-vm)
where=(--zone="$zone")
[[ -n "$project" ]] && where+=(--project="$project")
on_all_workers() { run "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command="$1"; }

case "$action" in
  create)
    run "${gcloud_tpu[@]}" create "$name" "${where[@]}" --accelerator-type="$type" \
      --version="$version"
    ;;
  setup)
    repo="$(cd "$(dirname "$0")/.." && pwd)"
    run "${gcloud_tpu[@]}" scp --recurse "$repo" "$name:~/transformer_jax" "${where[@]}" \
      --worker=all
    on_all_workers "cd ~/transformer_jax && pip install -r requirements.txt 'jax[tpu]'"
    ;;
  train)
    [[ ${#train_args[@]} -gt 0 ]] || { echo "train needs: -- --config ... --workdir ..." >&2; exit 2; }
    printf -v quoted '%q ' "${train_args[@]}"
    on_all_workers "cd ~/transformer_jax && nohup python3 -m transformer_jax.main --multihost \
${quoted}> ~/${name}.log 2>&1 &"
    ;;
  status) on_all_workers "tail -n 5 ~/${name}.log" ;;
  stop) on_all_workers "pkill -f transformer_jax.main || true" ;;
  delete) run "${gcloud_tpu[@]}" delete "$name" "${where[@]}" --quiet ;;
esac
