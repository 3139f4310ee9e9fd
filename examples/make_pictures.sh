#!/usr/bin/env bash
# Regenerate the pictures in docs/ (README and references) from a run's TensorBoard logs:
#   OUTDIR/report.png       `python -m lightning_gpumem report LOGDIR --png` (needs matplotlib)
#   OUTDIR/tensorboard.png  TensorBoard's Custom Scalars tab on loopback, in headless Chromium
#                           (Debian: apt-get install -y chromium)
#
# Usage: examples/make_pictures.sh [LOGDIR] [OUTDIR]
#   LOGDIR  logs with gpumem/ metrics; without it, examples/memory_report.py runs first and writes them
#           (on a GPU machine for GPU curves: on a CPU only host memory is logged)
#   OUTDIR  where the pictures go (default: docs)
# Environment: PYTHON (python3), TENSORBOARD (tensorboard), CHROMIUM (/usr/bin/chromium), WIDTH (1400),
# CHARTS (2: the train and validation charts; 0: all).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TENSORBOARD=${TENSORBOARD:-tensorboard}
export CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
OUTDIR=${2:-docs}
mkdir -p "$OUTDIR"
WORK=$(mktemp -d)
TB_PID=
cleanup() {
  local rc=$?
  if [ -n "$TB_PID" ]; then
    kill -- -"$TB_PID" 2>/dev/null || kill "$TB_PID" 2>/dev/null || true
    wait "$TB_PID" 2>/dev/null || true
  fi
  [ $rc -ne 0 ] && [ -f "$WORK/tb.log" ] && { echo "TensorBoard's log:" >&2; tail -n 20 "$WORK/tb.log" >&2; }
  rm -rf "$WORK"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ $# -ge 1 ]; then
  LOGDIR=$1
else
  LOGDIR="$WORK/logs"
  PYTHONPATH=. "$PYTHON" examples/memory_report.py --logdir "$LOGDIR" > "$WORK/run.log"
fi
[ -d "$LOGDIR" ] || { echo "make_pictures.sh: LOGDIR '$LOGDIR' is not a directory" >&2; exit 2; }

# 1. The report command's PNG.
# (--force: the committed picture may predate the report's own mark, which lets it replace its own files)
PYTHONPATH=. "$PYTHON" -m lightning_gpumem report "$LOGDIR" --png "$OUTDIR/report.png" --force

# 2. TensorBoard on a free loopback port, in its own process group; wait until it serves the layout.
command -v "$CHROMIUM" > /dev/null || { echo "make_pictures.sh: no $CHROMIUM (apt-get install -y chromium)" >&2; exit 2; }
PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
setsid "$TENSORBOARD" --logdir "$LOGDIR" --host 127.0.0.1 --port "$PORT" > "$WORK/tb.log" 2>&1 &
TB_PID=$!
BASE="http://127.0.0.1:$PORT"
for _ in $(seq 240); do
  kill -0 "$TB_PID" 2>/dev/null || { echo "make_pictures.sh: TensorBoard exited" >&2; exit 1; }
  layout=$(curl -sf "$BASE/data/plugin/custom_scalars/layout" 2>/dev/null || true)
  [[ "$layout" == *'"category"'* ]] && break
  sleep 0.5
done
[[ "$layout" == *'"category"'* ]] || { echo "make_pictures.sh: no custom-scalars layout in $LOGDIR" >&2; exit 1; }
sleep 2  # let TensorBoard finish loading the scalars

# 3. The screenshot: charts widened, outlier clipping off, the "Matches" legend open; the first CHARTS charts
#    (train and validation; 0: all five).
"$PYTHON" examples/tensorboard_screenshot.py "$BASE" "$OUTDIR/tensorboard.png" --expand --width "${WIDTH:-1400}" \
  --height 800 --timeout 90 --charts "${CHARTS:-2}"
echo "wrote $OUTDIR/report.png and $OUTDIR/tensorboard.png"
