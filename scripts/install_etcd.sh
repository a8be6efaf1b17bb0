#!/usr/bin/env bash
# Installs etcd (Debian package etcd-server) for sidecar mode and its tests, when `etcd` is not on PATH.
#
#   scripts/install_etcd.sh        (`make install-sidecar` runs it; `make test` too)
#
# As root, or with passwordless sudo; `apt-get update` first, because a fresh machine's package lists may be
# empty. The tests start their own private etcd on free ports; a system service the package may start is not
# used by them. Exits 1 with what to do when etcd is missing and cannot be installed.
set -u
command -v etcd >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ]; then sudo=(); elif sudo -n true 2>/dev/null; then sudo=(sudo -n); else
  echo "error: etcd is not installed and this user cannot install it (needs root or passwordless sudo):" >&2
  echo "  install the Debian package etcd-server (or any etcd >= 3.4 on PATH), then run make install-sidecar again" >&2
  exit 1
fi
echo "installing etcd (${sudo[*]:+${sudo[*]} }apt-get install etcd-server) for sidecar mode"
if ! out=$("${sudo[@]}" apt-get update -q 2>&1 && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q etcd-server 2>&1); then
  printf '%s\n' "${out: -3000}" >&2
  echo "error: could not install etcd-server with apt-get (see above)" >&2
  exit 1
fi
command -v etcd >/dev/null 2>&1 || { echo "error: etcd-server installed but no etcd on PATH" >&2; exit 1; }
