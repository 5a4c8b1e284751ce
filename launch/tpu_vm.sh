#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Cloud TPU VM (single host or slice): create, install, train on every worker, watch, delete.
#
#   launch/tpu_vm.sh [--dry_run] [--name N] [--zone Z] [--type v4-8] [--project P]
#                    [--version V] [--spot] [--queued] [--service_account SA]
#                    [--python 3.11] [--max_restarts 10] ACTION [-- ARGS]
#
# ACTION:
#   create   create the TPU VM (a slice such as v4-32 has several workers). --spot: a spot VM
#            (cheaper; may be preempted at any time). --queued: ask through a queued resource,
#            which waits for capacity (`status` shows its state); combines with --spot.
#   setup    copy this checkout to ~/transformer_jax on every worker (a tarball without runs/,
#            .git, virtual environments and caches), create the virtual environment ~/venv
#            with Python --python (default 3.11; requirements.txt needs 3.11+, and the
#            tpu-ubuntu2204-base image has 3.10) through uv, which uses the image's Python
#            when it is new enough and downloads one otherwise, then pip install -r
#            requirements.txt 'jax[tpu]' into it. Run it again after changing the checkout.
#   train    start `python -m transformer_jax.main --multihost ARGS` in ~/venv on every worker,
#            in the background, under a restart loop (launch/common.sh restart_loop): the run
#            is restarted after a crash, at most --max_restarts times, and not after exit 0
#            (done, or stopped and saved), 1 (an error), 2 (bad flags) or 75 (the workdir is
#            locked by a run still going). Output is appended to ~/NAME.log on each worker and,
#            when --workdir is gs://..., copied to WORKDIR/logs/HOSTNAME.log every minute.
#            Running the same train command again resumes from the latest checkpoint: after
#            `stop`, or on a new VM after a spot VM was preempted (delete, create, setup, train).
#   status   whether each worker's run is going, and the last lines of its log
#   logs     follow worker 0's log (Ctrl-C stops following, not training)
#   stop     SIGTERM to the runs: they finish the current step, save a checkpoint and exit
#   delete   delete the TPU VM (with --queued: the queued resource and its VM)
# --version is the TPU VM image; by default the one Google lists for the TPU generation
# (tpu-ubuntu2204-base for v4 and older, v2-alpha-tpuv5-lite for v5e, v2-alpha-tpuv5 for v5p,
# v2-alpha-tpuv6e for v6e). --service_account: the account the VMs act as (default: the
# project's Compute Engine default service account); it needs access to a gs:// workdir.
# --dry_run prints the commands instead of running them.
set -euo pipefail

name="transformer-jax"
zone="us-central2-b"
type="v4-8"
version=""
project=""
spot=false
queued=false
service_account=""
python="3.11"
max_restarts=10
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
    --spot) spot=true ;;
    --queued) queued=true ;;
    --service_account) service_account="$2"; shift ;;
    --python) python="$2"; shift ;;
    --max_restarts) max_restarts="$2"; shift ;;
    -h|--help) usage 0 ;;
    --) shift; train_args=("$@"); break ;;
    create|setup|train|status|logs|stop|delete) action="$1" ;;
    *) echo "unknown argument: $1" >&2; usage 2 ;;
  esac
  shift
done
[[ -n "$action" ]] || usage 2
[[ "$max_restarts" =~ ^[0-9]+$ ]] || { echo "--max_restarts needs a number" >&2; exit 2; }
if [[ -z "$version" ]]; then
  case "$type" in
    v6e*) version="v2-alpha-tpuv6e" ;;
    v5p*) version="v2-alpha-tpuv5" ;;
    v5e*|v5litepod*) version="v2-alpha-tpuv5-lite" ;;
    *) version="tpu-ubuntu2204-base" ;;
  esac
fi

# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"

gcloud_tpu=(gcloud compute tpus tpu-vm)
gcloud_queued=(gcloud compute tpus queued-resources)
where=(--zone="$zone")
[[ -n "$project" ]] && where+=(--project="$project")
on_workers() {  # on_workers WORKER COMMAND: WORKER is all or an index
  run "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker="$1" --command="$2"
}
# shellcheck disable=SC2088  # ~ is expanded on the workers
log="~/${name}.log"

case "$action" in
  create)
    options=(--accelerator-type="$type")
    "$spot" && options+=(--spot)
    [[ -n "$service_account" ]] && options+=(--service-account="$service_account")
    if "$queued"; then
      run "${gcloud_queued[@]}" create "$name" --node-id="$name" "${where[@]}" "${options[@]}" \
        --runtime-version="$version"
    else
      run "${gcloud_tpu[@]}" create "$name" "${where[@]}" "${options[@]}" --version="$version"
    fi
    ;;
  setup)
    repo="$(cd "$(dirname "$0")/.." && pwd)"
    printf -v python_q '%q' "$python"
    tarball="${TMPDIR:-/tmp}/${name}-transformer_jax.tar.gz"
    # COPYFILE_DISABLE: macOS tar leaves out its ._* metadata files.
    run env COPYFILE_DISABLE=1 tar -czf "$tarball" --exclude=./runs --exclude=./.git \
      --exclude=__pycache__ --exclude=.pytest_cache --exclude=.mypy_cache --exclude=.ruff_cache \
      --exclude=.ipynb_checkpoints --exclude='*.egg-info' --exclude=./.venv --exclude=./venv \
      -C "$repo" .
    run "${gcloud_tpu[@]}" scp "$tarball" "$name:transformer_jax.tar.gz" "${where[@]}" --worker=all
    run rm -f "$tarball"
    on_workers all "mkdir -p ~/transformer_jax && tar -xzf ~/transformer_jax.tar.gz \
-C ~/transformer_jax && rm ~/transformer_jax.tar.gz && export PATH=\"\$HOME/.local/bin:\$PATH\" \
&& (command -v uv > /dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh) \
&& rm -rf ~/venv && uv venv --python ${python_q} ~/venv && source ~/venv/bin/activate \
&& cd ~/transformer_jax && uv pip install -r requirements.txt 'jax[tpu]'"
    ;;
  train)
    [[ ${#train_args[@]} -gt 0 ]] || { echo "train needs: -- --config ... --workdir ..." >&2; exit 2; }
    workdir=""
    for ((i = 0; i < ${#train_args[@]}; i++)); do
      case "${train_args[i]}" in
        --workdir=*) workdir="${train_args[i]#--workdir=}" ;;
        --workdir) workdir="${train_args[i + 1]:-}" ;;
      esac
    done
    printf -v quoted '%q ' "${train_args[@]}"
    command="set -e; cd ~/transformer_jax; source ~/venv/bin/activate; nohup bash launch/common.sh \
restart_loop ${max_restarts} python -m transformer_jax.main --multihost ${quoted}>> ${log} 2>&1 \
< /dev/null &"
    if [[ "$workdir" == gs://* ]]; then
      printf -v log_copy '%q' "${workdir%/}/logs"
      command+=" nohup bash launch/common.sh upload_log \$! ${log} ${log_copy}/\$(hostname).log \
>> ~/${name}.upload.log 2>&1 < /dev/null &"
    else
      echo "note: --workdir is not gs://...: on a slice every worker must see the same folder" \
        "(NFS, Filestore, a mounted bucket)." >&2
    fi
    on_workers all "$command"
    ;;
  status)
    "$queued" && run "${gcloud_queued[@]}" describe "$name" "${where[@]}" \
      --format='value(state.state)'
    on_workers all "echo \"== \$(hostname): \$(pgrep -f '[r]estart_loop' > /dev/null \
&& echo running || echo 'not running')\"; tail -n 5 ${log}"
    ;;
  logs) on_workers 0 "tail -n 50 -F ${log}" ;;
  stop) on_workers all "pkill -TERM -f '[r]estart_loop' || true" ;;
  delete)
    if "$queued"; then
      run "${gcloud_queued[@]}" delete "$name" "${where[@]}" --force --quiet
    else
      run "${gcloud_tpu[@]}" delete "$name" "${where[@]}" --quiet
    fi
    ;;
esac
