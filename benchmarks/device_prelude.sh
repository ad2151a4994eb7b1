# Sourced by the device_*.sh scripts on the lent H200: strict mode, $out, the
# package installed over the carried tree, and b NAME LIMIT SCRIPT ARGS... which
# runs one benchmark under a timeout, appending its output to $out/NAME.md.
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
b() { local name=$1 limit=$2; shift 2; echo "== $name: $*" | tee -a "$out/$name.md"
      timeout "$limit" python3 "$@" 2>&1 | tee -a "$out/$name.md" | tail -25; }
