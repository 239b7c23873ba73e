#!/usr/bin/env bash
# The device run: carried wheels installed, then bench/bench_device.py, all output in $OUT/device.log.
# From the repository root on the GPU machine, with the wheels in .whl/ (bench/device/README.md):
#   bash bench/device/run.sh [bench_device.py arguments, e.g. --images 24000 --budget 330]
# PYTHON overrides the interpreter (default python3); without .whl/ the install is skipped.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
: "${OUT:?set OUT to the folder for device.json, device.md and device.log}"
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
{
    echo "== $(date -u +%FT%TZ) $(uname -srm); nproc $(nproc); $($PY -V 2>&1)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1 || true
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "== pip install $(ls .whl | tr '\n' ' ')"
        timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || { echo "!! pip install failed"; exit 1; }
        export PYTHONPATH=/tmp/site:$PWD
    else
        echo "== no .whl/: using the installed packages"
        export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    fi
    "$PY" -c "import blosc2, carraystore; print('blosc2', blosc2.__version__, 'carraystore', carraystore.__file__)" || exit 1
    timeout 400 "$PY" bench/bench_device.py --out "$OUT" --workdir /tmp/bench-device "$@"  # data kept: no time spent deleting
    rc=$?
    echo "== bench_device.py exit code $rc"
    exit $rc
} 2>&1 | tee "$OUT/device.log"
