#!/usr/bin/env bash
# Runs the test suite with .venv. Default: all tests not marked slow. `--all`: every test.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "tpurec: .venv is missing; run 'make install' first" >&2
  exit 1
fi
# Lint and format first (configuration: [tool.ruff] in pyproject.toml): seconds, and a failure names
# the file and line. `.venv/bin/ruff format .` and `.venv/bin/ruff check --fix .` repair most findings.
.venv/bin/ruff check --quiet . || { echo "tpurec: ruff check found problems (see above)" >&2; exit 1; }
.venv/bin/ruff format --check --quiet . || { echo "tpurec: files need 'ruff format' (listed above)" >&2; exit 1; }
# Types (configuration: [tool.mypy] in pyproject.toml; its cache in .mypy_cache, so only a clean clone
# pays the full check; docs/results.md has its time); a failure names the file, line and error code.
.venv/bin/mypy || { echo "tpurec: mypy found type errors (see above)" >&2; exit 1; }
# No TPU here: keep jax on CPU and stop a torch_tpu install from autoloading or querying metadata.
export JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
# Two cores: one intra-op thread per process keeps multi-rank tests from oversubscribing.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
marker=(-m "not slow and not tpu")
if [ "${1:-}" = "--all" ]; then shift; marker=(-m "not tpu"); fi
# Parallel workers (pytest-xdist), one per core of the 2-core VMs the suite is timed on; worksteal
# hands a worker left idle the queued tests of a busier one. TPUREC_TEST_WORKERS=0 runs serially in
# this one process (as pytest alone does); a later `-n N` among the arguments wins too.
workers=${TPUREC_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != 0 ]; then
  parallel=(-n "$workers" --dist worksteal)
  .venv/bin/python -c "import xdist" 2>/dev/null \
    || { echo "tpurec: pytest-xdist is missing from .venv; run 'make install' (or TPUREC_TEST_WORKERS=0)" >&2; exit 1; }
fi
exec .venv/bin/python -m pytest "${marker[@]}" "${parallel[@]}" "$@"
