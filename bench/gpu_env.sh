# Sourced by bench/run_gpu.sh and bench/lease.sh on the GPU machine, from the repository root.
# install_wheels: the packages it lacks, staged here in .whl/ (../shared/gpu/README.md's install line).
# with_specsched: `import specsched.x` without installing the project (pyproject maps specsched.<folder>
# onto the repo's folders, and a pip install there would try to resolve torch): a namespace folder of
# symlinks on PYTHONPATH.
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
}
with_specsched() {
  local ns=/tmp/specsched-ns d
  rm -rf "$ns" && mkdir -p "$ns/specsched"
  for d in engine daemon client models kernels proposers scorers policies bench gateway conf; do
    ln -s "$PWD/$d" "$ns/specsched/$d"
  done
  export PYTHONPATH=/tmp/site:$ns:$PWD PYTHONUNBUFFERED=1
}
