#!/usr/bin/env bash
# Runs pytest with the given arguments as the unprivileged user `nobody`, the way most users
# run pinpool: no CAP_IPC_LOCK (so `mlock` obeys `ulimit -l`), no CAP_SYS_PTRACE (so opening a
# worker's memfd through /proc/<pid>/fd follows the ordinary ptrace rules), no reading or
# writing other users' files.
#
# Run as root (CI and the development machines are root). The checkout is bind-mounted at a
# fresh path in a private mount namespace, so `nobody` reaches it even when a parent folder
# (root's home) is closed to others; the interpreter is the system's python3.11 (the venv's
# own may live in such a folder), with the venv's site-packages and python/ on PYTHONPATH.
# Already unprivileged: pytest runs as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
venv=${VENV:-.venv}

if [ "$(id -u)" != 0 ]; then
    exec "$venv/bin/python" -m pytest "$@"
fi

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
site=${site#"$repo/"}
version=$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
python=/usr/bin/python$version
for tool in unshare setpriv mount "$python"; do
    if ! command -v "$tool" >/dev/null; then
        echo "unprivileged run impossible: $tool is missing" >&2
        exit 1
    fi
done

mnt=$(mktemp -d /tmp/pinpool-unprivileged.XXXXXX)
chmod 755 "$mnt"
trap 'rmdir "$mnt" 2>/dev/null || true' EXIT
# Arguments travel as positional parameters, never through a shell string.
unshare --mount --propagation private -- bash -c '
    set -euo pipefail
    mnt=$1 repo=$2 site=$3 python=$4
    shift 4
    mount --bind "$repo" "$mnt"
    cd "$mnt"
    exec setpriv --reuid=nobody --regid=nogroup --clear-groups --inh-caps=-all \
        env HOME=/tmp HYPOTHESIS_STORAGE_DIRECTORY=/tmp/pinpool-unprivileged-hypothesis \
        PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$mnt/python:$mnt/$site" \
        "$python" -c "import os, sys; assert os.geteuid() != 0; import pytest; sys.exit(pytest.main())" \
        -p no:cacheprovider "$@"
' unprivileged "$mnt" "$repo" "$site" "$python" "$@"
