#!/usr/bin/env bash
# System packages for the simulated multi-node tests (scripts/simulate_nodes.py):
#   sshfs + fuse3        each simulated node mounts the shared workspace over SFTP (FUSE)
#   openssh-server       the private sshd on 127.0.0.1 that exports it (ssh-keygen comes with
#                        openssh-client, a dependency)
#   util-linux, mount    unshare / mount / umount (essential on Debian, checked only)
# Idempotent and quiet; a no-op (milliseconds) when everything is present. Debian/Ubuntu, as root.
# Without root or apt-get it only explains what is missing: the tests that need it then skip.
set -euo pipefail

have_all() {
    command -v sshfs >/dev/null 2>&1 &&
        { command -v fusermount3 >/dev/null 2>&1 || command -v fusermount >/dev/null 2>&1; } &&
        command -v ssh-keygen >/dev/null 2>&1 &&
        { [ -x /usr/sbin/sshd ] || command -v sshd >/dev/null 2>&1; } &&
        command -v unshare >/dev/null 2>&1
}

warn_fuse() {
    if [ ! -e /dev/fuse ]; then
        echo "system-deps: /dev/fuse is missing; sshfs tests will skip (containers need --device /dev/fuse --cap-add SYS_ADMIN)" >&2
    fi
}

if have_all; then
    warn_fuse
    exit 0
fi

PACKAGES=(sshfs fuse3 openssh-server openssh-client)
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        echo "system-deps: not root; install ${PACKAGES[*]} to run the simulated multi-node tests (they skip otherwise)" >&2
        exit 0
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: no apt-get; install ${PACKAGES[*]} by hand (the simulated multi-node tests skip otherwise)" >&2
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# Installing openssh-server must not start a system-wide sshd on port 22: forbid service starts
# for the duration of the install (policy-rc.d exit 101), unless a policy already exists.
POLICY=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$POLICY" >/dev/null
    "${SUDO[@]}" chmod 755 "$POLICY"
    made_policy=1
fi
LOG=$(mktemp)
cleanup() {
    rm -f "$LOG"
    if [ "$made_policy" = 1 ]; then "${SUDO[@]}" rm -f "$POLICY"; fi
}
trap cleanup EXIT

install() {
    "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >"$LOG" 2>&1
}

# apt-get update only when the package lists are missing or too old to install from.
if ! compgen -G "/var/lib/apt/lists/*_Packages*" >/dev/null || ! install; then
    "${SUDO[@]}" apt-get update -qq >"$LOG" 2>&1 || { cat "$LOG" >&2; exit 1; }
    install || { cat "$LOG" >&2; exit 1; }
fi

if ! have_all; then
    echo "system-deps: installed ${PACKAGES[*]} but something is still missing" >&2
    exit 1
fi
warn_fuse
echo "system-deps: installed ${PACKAGES[*]}"
