# shellcheck shell=bash
# Shared by the launch scripts: print or run a command (--dry_run sets dry_run=true).

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
