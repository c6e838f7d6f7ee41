#!/usr/bin/env bash
# Build the one-file executable: packaging/build.sh [DISTDIR]   (default: dist/)
#
# 1. A build venv (build/venv-binary, or $BUILD_VENV) holding only the runtime
#    dependencies from pyproject.toml plus PyInstaller -- never the test extras, which
#    would otherwise be swept into the binary. Rebuilt when pyproject.toml changes.
# 2. appliance/_build.py with COMMIT = the git short hash (+ "-dirty" when the files
#    that go into the binary differ from it), for `appliance --version`; removed again
#    afterwards so a source checkout keeps reporting "source".
# 3. PyInstaller with packaging/appliance.spec -> DISTDIR/appliance.
# Builds are serialised with a lock: several people may share one checkout.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PY:-python3.11}
VENV=${BUILD_VENV:-$ROOT/build/venv-binary}
DIST=$(realpath -m "${1:-$ROOT/dist}")
WORK=${BUILD_WORK:-$ROOT/build/pyinstaller}
PYINSTALLER_SPEC='pyinstaller>=6.10,<7'

mkdir -p "$ROOT/build" "$DIST"
exec 9>"$ROOT/build/.binary.lock"
flock 9

command -v "$PY" >/dev/null || { echo "build.sh: need $PY" >&2; exit 1; }
deps=$("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
want=$(printf '%s\n%s\n%s\n' "$deps" "$PYINSTALLER_SPEC" "$("$PY" -V)" | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.deps" 2>/dev/null)" != "$want" ]; then
    echo "build.sh: build venv $VENV (runtime dependencies + PyInstaller)" >&2
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    # (pip's notes about this host's unused index locations are filtered out)
    { "$VENV/bin/pip" install -q --upgrade pip 2>&1 >&3 | { grep -v "is ignored: it is neither" >&2 || true; }; } 3>&1
    # shellcheck disable=SC2086
    { "$VENV/bin/pip" install -q $deps "$PYINSTALLER_SPEC" 2>&1 >&3 | { grep -v "is ignored: it is neither" >&2 || true; }; } 3>&1
    echo "$want" > "$VENV/.deps"
fi

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ "$commit" != unknown ] && [ -n "$(git status --porcelain -- appliance pyproject.toml packaging/appliance.spec 2>/dev/null)" ]; then
    commit="$commit-dirty"
fi
cleanup() { rm -f "$ROOT/appliance/_build.py"; }
trap cleanup EXIT
printf '"""Written by packaging/build.sh for the binary; not in git."""\n\nCOMMIT = "%s"\n' "$commit" > appliance/_build.py

start=$(date +%s)
"$VENV/bin/pyinstaller" --noconfirm --log-level WARN \
    --distpath "$DIST" --workpath "$WORK" packaging/appliance.spec
echo "build.sh: $DIST/appliance ($commit, $(du -h "$DIST/appliance" | cut -f1), $(( $(date +%s) - start )) s)" >&2
# What went in, beside the binary: tests check every role is inside and no test tooling is.
"$VENV/bin/pyi-archive_viewer" --list --recursive "$DIST/appliance" > "$DIST/appliance.contents.txt"
