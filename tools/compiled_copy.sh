#!/usr/bin/env bash
# A mypyc-compiled copy of celery_lockguard, for measurement only (issue 33): is compiling the delivery path a
# lever for the task logic's CPU? Not shipped: lockguard is pure Python.
#
#   tools/compiled_copy.sh /tmp/compiled
#   .bench/venv/bin/python tools/instructions.py --root /tmp/compiled default floor
#
# Copies celery_lockguard and bench into DIR and compiles the modules a delivery runs through with the mypyc
# of .venv (mypy's compiler; needs gcc and the Python headers). Left pure Python: _wire (its Channel is
# weakly referenced, which a compiled class refuses), _renewer (mypyc emits `self->__thread` for its `_thread`
# attribute, which C cannot compile) and _task (the Celery task class).
set -euo pipefail
dir=${1:?usage: tools/compiled_copy.sh DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
mypyc="$root/.venv/bin/mypyc"
[ -x "$mypyc" ] || { echo "compiled_copy: $mypyc not found: run 'make install' first" >&2; exit 1; }
rm -rf "$dir" && mkdir -p "$dir"
cp -r "$root/celery_lockguard" "$root/bench" "$dir/"
find "$dir" -name __pycache__ -prune -exec rm -rf {} +
printf '[mypy]\nignore_missing_imports = True\n' > "$dir/mypy.ini"
modules=(_calls _keys _metrics _events _decision _request _headers _delivery _release _lease _resp _records
  _completion _config _connection _handoff _multi _taskclass _claims _errors _process _tracing _otel_metrics
  _cluster _scripts _waits)
cd "$dir"
files=()
for m in "${modules[@]}"; do files+=("celery_lockguard/$m.py"); done
"$mypyc" "${files[@]}" > build.log 2>&1 || { tail -20 build.log >&2; exit 1; }
echo "compiled ${#modules[@]} modules into $dir/celery_lockguard (build log: $dir/build.log)"
