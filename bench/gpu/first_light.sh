#!/usr/bin/env bash
# The GPU check (issue 40): one command, one call of a lent GPU, <= 8 minutes on one H100.
#   bash bench/gpu/first_light.sh                      # on the GPU machine: everything to $OUT
#   bash bench/gpu/first_light.sh --float8             # the bf16 training pair, then the float8 sections (issue 50)
#   bash bench/gpu/first_light.sh --device cpu --tiny  # the same code path on a CPU in seconds (CI)
# Wheels the machine lacks (fairscale, crc32c, zstandard, torchtitan and its needs) travel in .whl/
# (bench/gpu/README.md says how to fill it); they are installed into /tmp/site, nothing else changes.
set -uo pipefail
cd "$(dirname "$0")/../.."
if compgen -G ".whl/*.whl" >/dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else  # wheels for another Python (they are built for the GPU machine's): go on with what is installed
        echo "first_light: the wheels in .whl/ do not install here; going on without them" >&2
    fi
fi
# The `hybridpar` command for the tests that run it: this tree, editable, where it is not installed.
command -v hybridpar >/dev/null || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
    || echo "first_light: hybridpar not installed (the tests that run the command will say so)" >&2
args=("$@")
[[ -n "${OUT:-}" ]] && args=(--out "$OUT" "${args[@]}")
exec python3 -m bench.gpu.first_light "${args[@]}"
