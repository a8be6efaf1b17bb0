#!/usr/bin/env bash
# Installs bubblewrap (Linux namespaces) for the code-execution reward's sandbox.
# Without it the sandbox falls back to a weaker level and says so at start-up (hybrid_rl/rewards/sandbox.py).
set -u
if command -v bwrap >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing bubblewrap (apt-get) for the code sandbox"
  (apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; }) \
    || echo "WARNING: could not install bubblewrap; the code sandbox will run at a weaker isolation level" >&2
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo apt-get install -y -q bubblewrap >/dev/null 2>&1 || echo "WARNING: could not install bubblewrap" >&2
else
  echo "WARNING: bubblewrap (bwrap) not found and cannot be installed without root; install it for full code-sandbox isolation" >&2
fi
exit 0
