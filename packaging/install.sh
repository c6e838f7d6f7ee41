#!/usr/bin/env bash
# Install appliance on a host (as root): packaging/install.sh [BINARY]
#
#   BINARY   the executable to install (default: dist/appliance, from `make binary`)
#
# Puts the binary at /usr/local/bin/appliance, both units in /etc/systemd/system,
# the env examples in /etc/appliance/ (hub.env and node.env are created from them only
# when absent: an operator's settings are never overwritten), creates the group
# `appliance` (it may read the env files, which hold keys) and the node's user
# `appliance`, and runs `systemctl daemon-reload`. It enables and starts nothing: a
# host runs the hub, a node, or both -- the last lines say how.
#
# DESTDIR=/some/root stages the files there instead (packagers, tests); users, file
# ownership and systemctl are then left to the package's own scripts.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BINARY=${1:-$ROOT/dist/appliance}
DESTDIR=${DESTDIR:-}
ETC=$DESTDIR/etc/appliance

[ -x "$BINARY" ] || { echo "install.sh: no executable at $BINARY (run: make binary)" >&2; exit 1; }
if [ -z "$DESTDIR" ] && [ "$(id -u)" != 0 ]; then
    echo "install.sh: run as root (or set DESTDIR to stage the files)" >&2
    exit 1
fi

if [ -z "$DESTDIR" ]; then
    getent group appliance >/dev/null || groupadd --system appliance
    if ! getent passwd appliance >/dev/null; then
        useradd --system --gid appliance --home-dir /var/lib/appliance-node --no-create-home \
            --shell /usr/sbin/nologin --comment "appliance node" appliance
    fi
    # Non-NVIDIA GPUs: /dev/dri render nodes and /dev/kfd belong to these groups.
    for g in video render; do
        if getent group "$g" >/dev/null; then usermod -a -G "$g" appliance; fi
    done
    OWNER=(-o root -g appliance)
else
    OWNER=()
fi

install -D -m 0755 "$BINARY" "$DESTDIR/usr/local/bin/appliance"
for unit in appliance-hub.service appliance-node.service; do
    install -D -m 0644 "$ROOT/systemd/$unit" "$DESTDIR/etc/systemd/system/$unit"
done
install -d -m 0750 "${OWNER[@]}" "$ETC"
for role in hub node; do
    install -m 0644 "$ROOT/systemd/$role.env.example" "$ETC/$role.env.example"
    if [ -e "$ETC/$role.env" ]; then
        echo "install.sh: keeping $ETC/$role.env"
    else
        install -m 0640 "${OWNER[@]}" "$ROOT/systemd/$role.env.example" "$ETC/$role.env"
    fi
done

if [ -z "$DESTDIR" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi

"$DESTDIR/usr/local/bin/appliance" --version
cat <<'NEXT'
Next: edit /etc/appliance/hub.env and/or /etc/appliance/node.env (at least
Auth__NodeToken, the same on both sides), then
  systemctl enable --now appliance-hub     # on the hub host
  systemctl enable --now appliance-node    # on each GPU host
  systemctl reload appliance-hub           # after editing hub.env
NEXT
