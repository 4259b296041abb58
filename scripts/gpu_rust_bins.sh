#!/usr/bin/env bash
# Prebuild kt-core's Rust test binaries for scripts/gpu_check.sh's `rust` stage (the GPU
# machine has no Rust): release builds in .gpu-shared/rust/tests, with the libhwloc and libudev
# they link, and the checkout path they were built in (their fixture paths are absolute).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpu-shared/rust
rm -rf "$dest" && mkdir -p "$dest/tests" "$dest/lib"
cargo test --release -p kt-core --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' |
  while read -r exe; do cp "$exe" "$dest/tests/"; done
for lib in $(ldd "$dest"/tests/* | grep -oE "/[^ ]*lib(hwloc|udev)\.so[^ ]*" | sort -u); do
  cp -L "$lib" "$dest/lib/"
done
pwd > "$dest/built_in"
ls -l "$dest/tests" "$dest/lib"
