#!/usr/bin/env bash
# The GPU suite in one command, for a bare H200 machine (PyTorch 2.11, Python 3.12, no network, no
# install step): runs from source the GPU tests, the throughput/MFU/memory benchmarks and the
# WikiText-2 diagnostic table inside a wall-time budget (default 290 s), prints a summary table
# last and writes it into benchmarks/RESULTS.md (copied to $OUT when that is set).
#
#   bash benchmarks/gpu_suite.sh DATA_DIR [--smoke] [more benchmarks/gpu_bench.py options]
#
# DATA_DIR holds wikitext-2/wiki.{train,valid,test}.tokens and gpt2-tokenizer/{encoder.json,
# vocab.bpe} (a copy of those files from ../shared/data, ~17 MB). To run it on the device machine:
#   echo /.data/ >> .git/info/exclude
#   mkdir -p .data/wikitext-2 .data/gpt2-tokenizer
#   cp ../shared/data/wikitext-2/wiki.*.tokens .data/wikitext-2/
#   cp ../shared/data/gpt2-tokenizer/{encoder.json,vocab.bpe} .data/gpt2-tokenizer/
#   device run: command "bash benchmarks/gpu_suite.sh .data", carry [".data"], timeout_s 420
# --smoke runs everything at toy size on the CPU (PYTHON=/work/venv/bin/python here).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
DATA=${1:?usage: gpu_suite.sh DATA_DIR [--smoke] [gpu_bench.py options]}
shift
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export LOOPLM_NO_PROGRESS=1 PYTHONUNBUFFERED=1
LOOPLM_SUITE_T0=$(date +%s.%N)
export LOOPLM_SUITE_T0
if [ -d "$DATA/gpt2-tokenizer" ]; then
  LOOPLM_GPT2_DIR=$(cd "$DATA/gpt2-tokenizer" && pwd)
  export LOOPLM_GPT2_DIR
fi
export LOOPLM_CACHE_DIR=${LOOPLM_CACHE_DIR:-/tmp/looplm-cache}
DEST=${OUT:-/tmp}
echo "gpu_suite: $($PY -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# First the compiled-step yardstick (looplm eager/compiled vs the Listing-1 reference eager/compiled
# whole; T = 8 and T ~ U{1..8}) at 22m and 95.6m, batch 32 × 128 on a GPU; --smoke: tiny on the CPU.
if [[ " $* " == *" --smoke "* ]]; then
  YARD=(--batch 2 --rounds 2 --schedules fixed --no-write)
  PRESETS=(tiny)
else
  YARD=(--batch 32 --rounds 10)
  PRESETS=(22m 95.6m)
fi
for p in "${PRESETS[@]}"; do
  timeout 900 "$PY" benchmarks/compiled_step.py --threads 0 "${YARD[@]}" --preset "$p" 2>&1 \
    | tee -a "$DEST/compiled_step.log"
done
"$PY" benchmarks/gpu_bench.py --data-dir "$DATA" --cache-dir "$LOOPLM_CACHE_DIR" \
  --json "$DEST/gpu_bench.json" "$@" 2>&1 | tee "$DEST/gpu_suite.log"
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ] && [ -f benchmarks/RESULTS.md ]; then
  cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
fi
echo "gpu_suite: exit $rc after $(printf '%.0f' "$(echo "$(date +%s.%N) - $LOOPLM_SUITE_T0" | bc 2>/dev/null || echo 0)") s"
exit "$rc"
