#!/usr/bin/env bash
# System packages selfdistill needs beyond pip: bubblewrap (`bwrap`), which isolates
# model-written code in `selfdistill.envs.sandbox`. Idempotent: does nothing when bwrap is
# present; installs it with apt-get when we are root on a Debian/Ubuntu system; otherwise
# prints what to do and exits 0, so `make` goes on (the sandbox then refuses to run model code
# until bwrap exists, unless SELFDISTILL_ALLOW_UNISOLATED=1).
set -euo pipefail

if command -v bwrap >/dev/null 2>&1; then
  echo "bubblewrap: $(command -v bwrap) ($(bwrap --version 2>/dev/null || echo 'version unknown'))"
  exit 0
fi

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "bubblewrap: installing with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq bubblewrap
  command -v bwrap >/dev/null 2>&1 && exit 0
  echo "bubblewrap: apt-get ran but bwrap is still missing" >&2
  exit 1
fi

cat >&2 <<'MSG'
bubblewrap (bwrap) is missing and cannot be installed automatically here.
Install it as an administrator:
  Debian/Ubuntu: sudo apt-get install -y bubblewrap
  Fedora/RHEL:   sudo dnf install -y bubblewrap
  Arch:          sudo pacman -S bubblewrap
Until then the code sandbox refuses to run model-written code (or set
SELFDISTILL_ALLOW_UNISOLATED=1 to run it with your own permissions, unsafely).
MSG
exit 0
