#!/usr/bin/env bash
# Makes the code-execution reward's sandbox work here at its default isolation level, bubblewrap.
#
#   scripts/install_sandbox.sh PYTHON [required|optional]      (`make install-sandbox` runs it; `make test` too; SANDBOX=optional)
#
# Installs bubblewrap (Debian package) when it is missing, as root or with passwordless sudo, then runs the
# sandbox's own probe with PYTHON (hybrid_rl.rewards.sandbox.check_isolation): bubblewrap can be installed and
# still not work (a kernel or container that forbids the namespaces it needs). Where bubblewrap is missing and
# cannot be installed, or does not work, the code reward would refuse to run untrusted code and the sandbox
# tests of `make test` would fail: this script says why and what to do, and exits 1. `optional` makes that a
# warning (exit 0), for a user who accepts both.
# Uses bash builtins and `id`, `apt-get`, `sudo` only (tests/integration/rewards/test_install_sandbox.py runs it on
# a PATH of stand-ins for those).
set -u
python=${1:?usage: install_sandbox.sh PYTHON [required|optional]}
mode=${2:-required}
case ${BASH_SOURCE[0]} in */*) root=${BASH_SOURCE[0]%/*}/.. ;; *) root=.. ;; esac
case $mode in required | optional) ;; *) echo "error: SANDBOX=$mode: choose required or optional" >&2; exit 2 ;; esac

stop() {  # $1: what is wrong; $2: what to do about it
  local without="The code reward then refuses untrusted code unless built with min_isolation='rlimits'
  (weaker: the network and your files stay reachable), and the sandbox tests of \`make test\` fail
  (deselect them: make test PYTEST_ARGS='-m \"not sandbox\"')."
  if [ "$mode" = optional ]; then
    printf 'WARNING: code sandbox: %s\n  Going on without it (SANDBOX=optional). %s\n' "$1" "$without" >&2
    exit 0
  fi
  printf 'error: code sandbox: %s\n%s\n  Then run make install-sandbox again. Or go on without it: make install-sandbox SANDBOX=optional.\n  %s\n' \
    "$1" "$2" "$without" >&2
  exit 1
}

apt_install() {  # "$@": how to become root (nothing, or sudo -n); apt's output is shown when it fails
  local out
  echo "installing bubblewrap (${*:+$* }apt-get) for the code sandbox"
  out=$("$@" apt-get install -y -q bubblewrap 2>&1) && return 0
  out=$("$@" apt-get update -q 2>&1 && "$@" apt-get install -y -q bubblewrap 2>&1) && return 0
  [ ${#out} -le 3000 ] || out=${out: -3000}
  printf '%s\n' "$out" >&2
  return 1
}

if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ] && ! { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; }; then
    stop "bubblewrap (bwrap) is not installed, and this user can install it neither as root nor with passwordless sudo." \
      "  Ask an administrator to install the package 'bubblewrap' (Debian/Ubuntu: apt-get install bubblewrap;
  Fedora: dnf install bubblewrap)."
  elif ! command -v apt-get >/dev/null 2>&1; then
    stop "bubblewrap (bwrap) is not installed, and this script installs it with apt-get only (Debian, Ubuntu)." \
      "  Install the package 'bubblewrap' with this system's package manager (e.g. dnf install bubblewrap)."
  elif [ "$(id -u)" = 0 ]; then
    apt_install || stop "bubblewrap (bwrap) is not installed, and apt-get failed to install it (its output is above)." \
      "  Fix what apt-get reports (network, package sources), or install the package 'bubblewrap' by hand."
  else
    apt_install sudo -n || stop "bubblewrap (bwrap) is not installed, and sudo apt-get failed to install it (its output is above)." \
      "  Fix what apt-get reports (network, package sources), or install the package 'bubblewrap' by hand."
  fi
  command -v bwrap >/dev/null 2>&1 || stop "apt-get installed bubblewrap, but bwrap is not on PATH ($PATH)." \
    "  Put the folder holding bwrap on PATH."
fi

# bwrap is there; whether it works is the sandbox's own probe to say (it runs a tiny program inside).
probe='
import logging, sys
logging.disable(logging.WARNING)  # the probe logs the reason too: say it once, below
from hybrid_rl.rewards.sandbox import SandboxConfig, SandboxUnavailableError, check_isolation
try:
    print(check_isolation(SandboxConfig()))
except SandboxUnavailableError as err:
    print(err)
    sys.exit(3)
'
out=$(PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$python" -c "$probe" 2>&1)
case $? in
  0) echo "code sandbox: isolation level '$out' works here" ;;
  3) stop "bubblewrap is installed but does not work here: $out" \
    "  Not root: unprivileged user namespaces must be allowed (Debian: sysctl -w kernel.unprivileged_userns_clone=1;
  Ubuntu 24.04+: sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile for bwrap;
  any kernel: user.max_user_namespaces > 0). In a container: one allowed to create namespaces." ;;
  *) stop "the sandbox probe could not run ($python):
$out" "  Fix the error above." ;;
esac
