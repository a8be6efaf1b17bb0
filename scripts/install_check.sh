#!/usr/bin/env bash
# Says what `make install` left out, and the one command that adds each: the base install is what colocated mode
# (the hybrid engine: every recipe, `make demo`) needs; etcd and the code sandbox are for other deployments.
#
#   scripts/install_check.sh       (`make install` runs it last)
#
# Uses `command -v` only (tests/integration/test_install_scripts.py runs it on a PATH without etcd or bwrap).
set -u
missing=0
if ! command -v etcd >/dev/null 2>&1; then
  echo "skipped: etcd, needed only by sidecar mode (rollout.mode=sidecar) and its tests: make install-sidecar"
  missing=1
fi
if ! command -v bwrap >/dev/null 2>&1; then
  echo "skipped: bubblewrap, needed only by the code reward's sandbox (reward fn 'code') and the tests marked sandbox: make install-sandbox"
  missing=1
fi
if [ "$missing" = 1 ]; then
  echo "colocated mode (the hybrid engine, every recipe, make demo) needs neither; make test installs both first"
fi
exit 0
