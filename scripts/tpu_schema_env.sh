#!/usr/bin/env bash
# Checks tpurec against TorchTPU's own code on a host without a TPU: tpurec/embedding/tpu.py against
# its real op schemas (docs/tpu_schema_check.md), and tpurec/emulation/torchtpu_kernels.json against its
# dispatcher registrations (scripts/refresh_torchtpu_kernels.py regenerates it there). Creates a SEPARATE
# venv with torch-tpu + libtpu (never the repo's .venv: torch-tpu there would break the CPU suite),
# installs this checkout into it (editable), then runs TPU_VENV_TESTS (at the end) in it. Idempotent: a
# stamp records the hash of the requirement files and of this script; when nothing changed, a second
# run goes straight to pytest.
#
#   bash scripts/tpu_schema_env.sh            # venv at ../tpu-venv (beside the clone)
#   TPU_SCHEMA_VENV=/path/venv bash scripts/tpu_schema_env.sh -v
# Extra arguments go to pytest. Needs Python 3.11 (torch-tpu 0.2.0 ships cp311 wheels) and ~6 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd -P)
PY=${PYTHON:-python3.11}
VENV=${TPU_SCHEMA_VENV:-$(dirname "$REPO")/tpu-venv}
mkdir -p "$(dirname "$VENV")"
VENV_ABS=$(cd "$(dirname "$VENV")" && pwd -P)/$(basename "$VENV")
case "$VENV_ABS/" in
  "$REPO"/*) echo "tpu_schema_env: refusing venv $VENV_ABS inside the repository (keep torch-tpu out of .venv)" >&2; exit 1 ;;
esac

# No TPU here: no torch_tpu autoload on `import torch`, no cloud metadata query, jax on CPU.
export TORCH_DEVICE_BACKEND_AUTOLOAD=0 TPU_SKIP_MDS_QUERY=1 JAX_PLATFORMS=cpu
export PYTHONWARNINGS="ignore:<TorchTpu/Performance/TcMalloc/"

STAMP=$VENV_ABS/.tpurec-tpu-schema-stamp
want=$(cat requirements/base.txt requirements/tpu.txt requirements/torchrec.txt setup.py pyproject.toml \
  scripts/tpu_schema_env.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV_ABS/bin/python" ]; then
  echo "tpu_schema_env: $VENV_ABS is up to date"
else
  start=$(date +%s)
  [ -x "$VENV_ABS/bin/python" ] || "$PY" -m venv "$VENV_ABS"
  PIP="$VENV_ABS/bin/python -m pip --disable-pip-version-check"
  # torch==2.14.1 from base.txt satisfies torch-tpu 0.2.0 (torch>=2.11,<=2.15); libtpu from PyPI.
  $PIP install -q -r requirements/base.txt -r requirements/tpu.txt pytest pytest-timeout
  $PIP install -q --no-deps -r requirements/torchrec.txt
  $PIP install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$STAMP"
  echo "tpu_schema_env: installed $VENV_ABS in $(( $(date +%s) - start )) s ($(du -sh "$VENV_ABS" | cut -f1))"
fi

# The test skips itself when torch_tpu cannot be imported; here that is an error, not a skip.
if ! timeout 300 "$VENV_ABS/bin/python" -c \
    "import torch, torch_tpu; print('torch', torch.__version__, '/ torch_tpu schema:', torch.ops.tpu._sparse_dense_matmul.default._schema)"; then
  echo "tpu_schema_env: 'import torch_tpu' failed or hung in $VENV_ABS; see docs/tpu_schema_check.md" >&2
  exit 1
fi
TPU_VENV_TESTS=(tests/embedding/test_tpu_schema.py tests/emulation/test_torchtpu_kernels_data.py
  tests/emulation/test_torchtpu_launch_env.py)
exec timeout "${TPU_SCHEMA_TIMEOUT:-1800}" "$VENV_ABS/bin/python" -m pytest -rs "${TPU_VENV_TESTS[@]}" "$@"
