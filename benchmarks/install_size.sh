#!/usr/bin/env bash
# The lean install (`pip install -e .`, no extra) in a fresh virtualenv: it trains configs/reverse_deepnorm.yaml and
# writes the quick study's report (a few steps per run: what is checked is that nothing else needs installing), then
# its size and package count beside those of `make test`'s .venv (the dev and data extras). README "Set up" quotes them.
#   bash benchmarks/install_size.sh [VENV]    (default: a fresh virtualenv in a temporary folder, removed afterwards)
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
venv=${1:-$tmp/lean}
python3 -m venv "$venv"
# torch first, the CPU wheel as the Makefile installs it, so nothing pulls a CUDA build
"$venv/bin/pip" install --quiet torch==2.13.0
"$venv/bin/pip" install --quiet -c constraints.txt -e .
export OMP_NUM_THREADS=1
"$venv/bin/kilolayer" train configs/reverse_deepnorm.yaml --out "$tmp/train" \
  --set train.steps=20 --set train.eval_every=10 --set train.checkpoint_every=20 >/dev/null
"$venv/bin/kilolayer" study quick --out "$tmp/quick" --jobs 2 --set train.steps=4 --set train.eval_every=2 \
  --set train.checkpoint_every=4 --set train.log_every=2 >/dev/null
test -s "$tmp/quick/report.md" && test -s "$tmp/quick/report.html"
size() { echo "$1: $(du -sh "$2" | cut -f1), $("$2/bin/pip" list 2>/dev/null | tail -n +3 | wc -l) packages"; }
size "pip install -e . (trained, wrote the quick report)" "$venv"
echo "  of which torch: $(du -sh "$("$venv/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')" | cut -f1)"
if [ -x .venv/bin/pip ]; then size "make test's .venv (dev and data extras)" .venv; fi
