# shellcheck shell=bash
# Shared by the launch scripts, and run on the training hosts as well:
#   source launch/common.sh     defines the functions below (--dry_run sets dry_run=true)
#   bash launch/common.sh restart_loop MAX_RESTARTS COMMAND...
#   bash launch/common.sh upload_log PID FILE gs://DEST

# Prints a command as it could be pasted into a shell: plain words bare, others single-quoted.
show() {
  local word out=()
  for word in "$@"; do
    if [[ "$word" =~ ^[A-Za-z0-9_./:=,@%+~-]+$ ]]; then
      out+=("$word")
    else
      out+=("'${word//\'/\'\\\'\'}'")
    fi
  done
  echo "${out[*]}"
}

run() {
  if "${dry_run:-false}"; then show "$@"; else "$@"; fi
}

# restart_loop MAX_RESTARTS COMMAND...: runs COMMAND, and runs it again (at most MAX_RESTARTS
# times) while it fails in a way a restart may cure: a crash, a kill, a lost peer. It stops
#   on exit 0  training finished, or stopped on a signal after saving a checkpoint;
#   on exit 1  an error the run reported (bad data, non-finite loss, a bug): it would recur;
#   on exit 2  a bad flag or config;
#   on exit 75 the workdir is locked by another run;
#   on exit 130 an interrupt (a second Ctrl-C);
#   when it gets SIGTERM or SIGINT itself: it passes SIGTERM on to COMMAND (which saves a
#   checkpoint and exits), waits for it and sets restart_loop_stopped=true.
# Restarts wait RESTART_DELAY_S (30) seconds, doubling each time up to 10 minutes; a run that
# lasted RESTART_RESET_S (3600) seconds or more before failing starts the count over.
# Returns COMMAND's last exit status.
restart_loop() {
  local max_restarts=$1 restarts=0 code again started delay seen
  shift
  restart_loop_stopped=false
  _restart_child=""
  _restart_signals=0
  trap '_restart_signals=$((_restart_signals + 1)); restart_loop_stopped=true
        [[ -z "$_restart_child" ]] || kill -TERM "$_restart_child" 2>/dev/null || true' TERM INT
  while true; do
    started=$SECONDS
    "$@" &
    _restart_child=$!
    wait "$_restart_child"
    code=$?
    # A trapped signal cuts `wait` short (status > 128) while COMMAND is still saving: wait
    # again. Once COMMAND's status has been collected, another wait answers 127.
    seen=0
    while ((code > 128 && seen < _restart_signals)); do
      seen=$((seen + 1))
      wait "$_restart_child"
      again=$?
      ((again == 127)) && break
      code=$again
    done
    _restart_child=""
    if "$restart_loop_stopped"; then
      echo "restart_loop: stopped by a signal; exit status $code." >&2
      break
    fi
    case "$code" in
      0|1|2|75|130) break ;;
    esac
    ((SECONDS - started >= ${RESTART_RESET_S:-3600})) && restarts=0
    if ((restarts >= max_restarts)); then
      echo "restart_loop: exit status $code; gave up after $restarts restarts." >&2
      break
    fi
    restarts=$((restarts + 1))
    delay=$((${RESTART_DELAY_S:-30} << (restarts - 1)))
    ((delay > 600)) && delay=600
    echo "restart_loop: exit status $code; restart $restarts of $max_restarts in ${delay} s." >&2
    sleep "$delay" &
    wait $! || true
    if "$restart_loop_stopped"; then
      echo "restart_loop: stopped by a signal before restarting." >&2
      break
    fi
  done
  trap - TERM INT
  return "$code"
}

# upload_log PID FILE DEST: copies FILE to DEST (gs://...) every LOG_UPLOAD_S (60) seconds
# while process PID runs, and once more when it has ended.
upload_log() {
  local pid=$1 file=$2 dest=$3
  while kill -0 "$pid" 2>/dev/null; do
    sleep "${LOG_UPLOAD_S:-60}"
    gcloud storage cp --quiet "$file" "$dest" || echo "upload_log: copy to $dest failed" >&2
  done
  gcloud storage cp --quiet "$file" "$dest"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then  # run as a script, not sourced
  case "${1:-}" in
    restart_loop|upload_log) "$@" ;;
    *) echo "usage: bash launch/common.sh restart_loop|upload_log ARGS..." >&2; exit 2 ;;
  esac
fi
