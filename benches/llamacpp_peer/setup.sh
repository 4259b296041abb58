#!/usr/bin/env bash
# Build the llama.cpp peer benchmark: ggml's CPU backend from the llama.cpp tree vendored in the
# llama-cpp-python sdist on PyPI (pinned, checksum-verified), plus moe_layer.cpp linked against it.
# Prints the path of the built binary on its last line. Needs network access to PyPI once; the
# result is cached in $KT_PEER_DIR (default ~/.cache/kt-kernel/llamacpp-peer).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PEER="${KT_PEER_DIR:-$HOME/.cache/kt-kernel/llamacpp-peer}"
VERSION=0.3.36
SDIST=llama_cpp_python-$VERSION.tar.gz
URL=https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/$SDIST
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
GGML="$PEER/llama_cpp_python-$VERSION/vendor/llama.cpp/ggml"
BIN="$PEER/moe_layer"
mkdir -p "$PEER"

if ! command -v cmake >/dev/null; then
  echo "[peer] installing cmake" >&2
  apt-get install -y -q cmake >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q cmake >/dev/null; }
fi

if [ ! -f "$GGML/CMakeLists.txt" ]; then
  if ! echo "$SHA256  $PEER/$SDIST" | sha256sum -c --status 2>/dev/null; then
    echo "[peer] downloading $SDIST from PyPI" >&2
    curl -fsSL -o "$PEER/$SDIST.part" "$URL"
    echo "$SHA256  $PEER/$SDIST.part" | sha256sum -c --status || { echo "[peer] checksum mismatch" >&2; exit 1; }
    mv "$PEER/$SDIST.part" "$PEER/$SDIST"
  fi
  tar -xzf "$PEER/$SDIST" -C "$PEER" "llama_cpp_python-$VERSION/vendor/llama.cpp/ggml"
  # The sdist omits ggml.pc.in, which ggml's standalone CMake configures unconditionally.
  touch "$GGML/ggml.pc.in"
fi

if [ ! -f "$GGML/build/src/libggml-cpu.a" ]; then
  echo "[peer] building ggml (Release, -march=native, CPU backend only)" >&2
  cmake -S "$GGML" -B "$GGML/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=OFF \
    -DBUILD_SHARED_LIBS=OFF -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF >&2
  cmake --build "$GGML/build" -j"$(nproc)" >&2
fi

if [ ! -x "$BIN" ] || [ "$HERE/moe_layer.cpp" -nt "$BIN" ]; then
  # shellcheck disable=SC2046
  g++ -O2 -std=c++17 "$HERE/moe_layer.cpp" -I"$GGML/include" -o "$BIN" \
    -Wl,--start-group $(find "$GGML/build" -name "*.a") -Wl,--end-group -lpthread -ldl -lm
fi
echo "$BIN"
