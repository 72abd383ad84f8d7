#!/usr/bin/env bash
# One-command setup: creates .venv/ at the repository root and installs tpurec (editable) with its
# test extras. Idempotent: a stamp records the hash of every requirements file; when nothing changed
# a second run only re-checks the editable install and exits in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.tpurec-install-stamp
want=$(cat requirements/*.txt setup.py pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "tpurec: .venv is up to date (delete $STAMP to force a reinstall)"
  exit 0
fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_quiet() {
  # The machine's pip config lists local index folders, some missing, and pip warns about each one
  # on every call; keep real warnings and errors. pipefail keeps pip's exit status.
  "$VENV/bin/python" -m pip --disable-pip-version-check install -q "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
pip_quiet --upgrade pip setuptools wheel
pip_quiet -r requirements/base.txt -r requirements/test.txt
# torchrec without its dependency on the CUDA fbgemm-gpu (it would overwrite fbgemm-gpu-cpu).
pip_quiet --no-deps -r requirements/torchrec.txt
# tpurec itself, editable; its dependencies are all above.
pip_quiet --no-deps --no-build-isolation -e .
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
# Fail loudly if something dragged in the CUDA fbgemm-gpu.
if $PIP show -q fbgemm-gpu >/dev/null 2>&1; then
  echo "tpurec: fbgemm-gpu (CUDA) got installed and shadows fbgemm-gpu-cpu; remove .venv and retry" >&2
  exit 1
fi
echo "$want" > "$STAMP"
echo "tpurec: installed into $VENV in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
