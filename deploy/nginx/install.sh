#!/bin/sh
# Install nginx from the Debian/Ubuntu archive, for the load-balancer example and its test.
# Idempotent: does nothing when nginx is already installed (on PATH or in /usr/sbin).
# Prefers the small nginx-light package (Debian 12) and falls back to nginx (Debian 13 dropped the
# flavours); runs apt-get update only when the package lists do not know either package yet.
set -eu

if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "deploy/nginx/install.sh: no apt-get here; install nginx with your package manager" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

candidate() {
    apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ { print $2 }' | grep -qv '(none)'
}

pick() {
    for pkg in nginx-light nginx; do
        if candidate "$pkg"; then
            echo "$pkg"
            return 0
        fi
    done
    return 1
}

if ! PKG=$(pick); then
    $SUDO apt-get update -q
    PKG=$(pick)
fi
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "$PKG"
