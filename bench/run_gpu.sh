# The one script for the H200: (i) GPU tests, (ii) the benchmark on a grid sized for ~6 minutes,
# (iii) every log under $OUT. Run from the repository root:
#   bash bench/run_gpu.sh [SMOLLM2_GGUF [BENCH_OVERRIDE ...]]
# SMOLLM2_GGUF defaults to /root/m/SmolLM2-135M-Instruct.Q4_1.gguf (pass "-" for it); extra hydra
# overrides shrink or skip parts, e.g. bench.e2e.batch=[1] bench.peers.enabled=false. Each step is
# guarded: a failing step is marked "!!! FAILED" in $OUT/summary.txt and the next still runs. Time
# limits add up to < 10 minutes; the bench writes its results after each part, so a bench killed by
# its limit still leaves the parts it finished.
# Stage first (on the dev machine): ../shared/gpu/stage-wheels.sh gguf pytest pluggy iniconfig
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
GGUF=${1:--}
[ "$GGUF" = "-" ] && GGUF=/root/m/SmolLM2-135M-Instruct.Q4_1.gguf
shift $(( $# > 0 ? 1 : 0 ))

# the staged wheels (hydra-core, omegaconf, antlr4, pytest, gguf, ...) and `import specsched`
. "$(dirname "$0")/gpu_env.sh"
install_wheels
with_specsched

summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
# BUNDLE=1: leave at most 8 files under $OUT, as a device call brings back no more (nor any file over
# 16 MiB, nor 64 MiB in all): summary.txt, tables.md, and everything else (decision logs gzipped) in
# one tar split into 15 MiB parts; here: cat out.tar.part_* | tar xf -
bundle() {
  [ "${BUNDLE:-0}" = 1 ] || return 0
  local d=$OUT/.bundle
  rm -rf "$d" && mkdir -p "$d"
  find "$OUT" -path "$d" -prune -o -name '*.sqlite' -print0 | xargs -0 -r gzip -f
  (cd "$OUT" && tar cf - --exclude=./.bundle .) | split -b 15M - "$d/out.tar.part_"
  cp "$OUT/summary.txt" "$d/" 2>/dev/null
  cp "$OUT/bench/tables.md" "$d/" 2>/dev/null
  find "$OUT" -mindepth 1 -maxdepth 1 ! -name .bundle -exec rm -rf {} +
  mv "$d"/* "$OUT/" && rmdir "$d"
  ls -l "$OUT"
}
step() {  # step NAME LIMIT_S CMD...: run guarded, full log in $OUT/NAME.log, outcome in summary.txt
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  summary "=== $name: $*"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then summary "=== $name: OK in $((SECONDS - t0)) s"
  elif [ $rc -eq 5 ] && [ "$3" = "pytest" ]; then summary "=== $name: no tests selected (pytest rc 5)"
  else summary "!!! FAILED $name: rc=$rc after $((SECONDS - t0)) s (124 = timed out); see $name.log"; fi
  tail -n 15 "$OUT/$name.log"
  return 0
}

: >"$OUT/summary.txt"
{
  date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git rev-parse HEAD 2>/dev/null
  # the device copies the working tree, not always its git metadata: a HEAD older than the tree shows
  # as changed files here (2026-12-06: HEAD a0c535b printed for a tree at 0b46755)
  changed=$(git status --porcelain --untracked-files=no 2>/dev/null | wc -l)
  [ "$changed" -eq 0 ] || echo "!!! the tree differs from that HEAD in $changed tracked files: name the tree's commit by hand"
  python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__)"
  python3 -c "import hydra, omegaconf; print('hydra', hydra.__version__, 'omegaconf', omegaconf.__version__)" || echo "!!! hydra/omegaconf missing: stage their wheels"
  python3 -c "import pytest; print('pytest', pytest.__version__)" || echo "!!! pytest missing: stage pytest pluggy iniconfig"
  python3 -c "import gguf; print('gguf', getattr(gguf, '__version__', 'ok'))" || echo "!!! gguf missing: the SmolLM2 parts will fail"
  ls -l "$GGUF" || echo "!!! no SmolLM2 GGUF at $GGUF: the real-model and peer parts are skipped"
} >"$OUT/env.txt" 2>&1 || true
cat "$OUT/env.txt"

# (i) GPU tests (marked `gpu`); -s shows the measured bf16 relative errors. SKIP_TESTS=1 skips them.
# GPU_TESTS="tests/x tests/y": only those (one guarded step, GPU_TESTS_LIMIT_S, default 300 s).
if [ -n "${GPU_TESTS:-}" ] && [ "${SKIP_TESTS:-0}" != 1 ]; then
step test_selected "${GPU_TESTS_LIMIT_S:-300}" python3 -m pytest -m gpu -q -rA -s $GPU_TESTS || true
SKIP_TESTS=1
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
step test_kernels 150 python3 -m pytest -m gpu -q -rA -s tests/kernels/ || true
step test_scorers 110 python3 -m pytest -m gpu -x -q -rA -s tests/scorers/ || true
step test_other_gpu 240 python3 -m pytest -m gpu -q -rA --continue-on-collection-errors \
  tests/models tests/proposers tests/policies tests/engine || true
fi
[ "${SKIP_BENCH:-0}" = 1 ] && { cat "$OUT/summary.txt"; bundle; exit 0; }

# (ii) the benchmark (bench=h200_quick: ~6 minutes); results, tables and the markdown under $OUT.
PRESET=bench=h200_quick  # a first override of the form bench=NAME picks another preset
if [[ "${1:-}" == bench=* ]]; then PRESET=$1; shift; fi
BENCH_ARGS=("$PRESET" "bench.out_dir=$OUT/bench" "bench.append_to=$OUT/benchmarks.md" "hydra.run.dir=$OUT/hydra")
if [ -f "$GGUF" ]; then BENCH_ARGS+=("bench.real.source=$GGUF" "bench.peers.source=$GGUF" "bench.serve.source=$GGUF")
else BENCH_ARGS+=(bench.real.enabled=false bench.peers.enabled=false); fi
step bench "${BENCH_LIMIT_S:-360}" python3 -m specsched.bench.cli "${BENCH_ARGS[@]}" "$@" || true

# (iii) what comes back: summary first, then the tables.
echo; echo "################ summary"; cat "$OUT/summary.txt"
grep -h -E "rel\. error|GPU runner|GPU engine|passed|failed" "$OUT"/test_*.log 2>/dev/null | tail -n 30 || true
echo; echo "################ tables"; cat "$OUT/bench/tables.md" 2>/dev/null || echo "!!! no tables (see bench.log)"
bundle
