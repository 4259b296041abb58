#!/usr/bin/env bash
# Regenerate BENCHMARKS.md: the whole-layer benchmark (kt-kernel vs plain torch, with this
# machine's limits measured in the same run), the criterion kernel benches, and — when the
# original kt-kernel 0.7.2 can be installed (benches/setup_original_venv.sh) — the original
# against this implementation through the same black-box script, one after the other; and
# llama.cpp's ggml CPU path (built from PyPI's llama-cpp-python sdist) against LLAMAFILE.
# Run nothing else heavy meanwhile: the machine has 2 cores.
# KT_BENCH_STEPS="layer threads convert wwsb cargo original peer" (default: all) reruns only some steps;
# the others keep their last results in bench-results/ and BENCHMARKS.md is assembled again.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${KT_VENV:-$HOME/.cache/kt-kernel/venv}"
OUT=bench-results
mkdir -p "$OUT"
STEPS="${KT_BENCH_STEPS:-layer threads convert wwsb cargo original peer}"
step() { [[ " $STEPS " == *" $1 "* ]]; }
# Each step leaves the date and commit it ran at, for BENCHMARKS.md's header (a single step
# rerun leaves the others' figures, and their stamps, as they were).
REV="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
git diff --quiet HEAD -- . ':!BENCHMARKS.md' 2>/dev/null || REV="$REV+uncommitted"
stamp() { echo "$(date -u +%F) at $REV" >"$OUT/$1.stamp"; }

if step layer; then
stamp layer
echo "[benchmarks] layer benchmark (kt-kernel vs torch)"
"$VENV/bin/python" -m kt_kernel bench --methods BF16 AMXINT8 AMXINT4 FP8 FP8_PERCHANNEL RAWINT4 \
  GPTQ_INT4 MXFP4 NVFP4 MXFP8 LLAMAFILE \
  --gguf-type Q4_K Q8_0 Q6_K --json "$OUT/layer.json" --markdown "$OUT/layer.md" "$@"

fi
if step threads; then
stamp threads
echo "[benchmarks] 1 thread against 2 threads"
"$VENV/bin/python" benches/thread_scaling.py --json "$OUT/threads.json" --markdown "$OUT/threads.md"
fi

if step convert; then
stamp convert
echo "[benchmarks] converter and loading of converted weights"
"$VENV/bin/python" benches/convert_bench.py --json "$OUT/convert.json" --markdown "$OUT/convert.md"
echo "[benchmarks] online quantization (load_weights_from_tensors)"
"$VENV/bin/python" benches/quantize_load.py --json "$OUT/quantize.json" --markdown "$OUT/quantize.md"
fi

if step wwsb; then
stamp wwsb
echo "[benchmarks] write_weight_scale_to_buffer (one expert into every GPU rank's buffers)"
"$VENV/bin/python" benches/write_weight_scale_bench.py --json "$OUT/wwsb-ours.json" >/dev/null
rm -f "$OUT/wwsb-original.json"
# The original on the same native files, where its venv can be set up.
if [ "${KT_SKIP_ORIGINAL:-0}" != 1 ] && bash benches/setup_original_venv.sh >"$OUT/orig-setup.log" 2>&1; then
  "${KT_ORIG_VENV:-/root/.cache/kt-kernel/orig-venv}/bin/python" benches/write_weight_scale_bench.py \
    --original --json "$OUT/wwsb-original.json" >"$OUT/wwsb-original.log" 2>&1 \
    || echo "[benchmarks] the original's write_weight_scale_to_buffer failed; see $OUT/wwsb-original.log"
fi
"$VENV/bin/python" benches/write_weight_scale_bench.py --merge "$OUT/wwsb-ours.json" \
  "$OUT/wwsb-original.json" >"$OUT/wwsb.md"
fi

if step cargo; then
stamp cargo
echo "[benchmarks] cargo bench"
cargo bench -p kt-benches --bench kernels --bench pool_vs_rayon -- --warm-up-time 1 --measurement-time 4 \
  2>&1 | tee "$OUT/cargo.txt" >/dev/null
fi

ORIG_OK=0
[ -s "$OUT/original.json" ] && [ -s "$OUT/ours.json" ] && ! step original && ORIG_OK=1
if step original && [ "${KT_SKIP_ORIGINAL:-0}" != 1 ] && bash benches/setup_original_venv.sh >"$OUT/orig-setup.log" 2>&1; then
  stamp original
  ORIG="${KT_ORIG_VENV:-/root/.cache/kt-kernel/orig-venv}"
  # The original's AMXINT8/AMXINT4 exist only in its AVX-512 and AMX builds.
  METHODS=$(KT_FORCE_SYNC_SUBMIT=1 "$ORIG/bin/python" -c "import kt_kernel
m = kt_kernel.kt_kernel_ext.moe
native = ['FP8', 'FP8_PERCHANNEL', 'RAWINT4', 'GPTQ_INT4', 'MXFP4', 'NVFP4', 'MXFP8']
print(' '.join(['BF16', 'LLAMAFILE'] + (['AMXINT8', 'AMXINT4'] if hasattr(m, 'AMXInt8_MOE') else []) + native))")
  echo "[benchmarks] original kt-kernel 0.7.2 (black box): $METHODS"
  # shellcheck disable=SC2086
  # Ours first: it writes the shared synthetic checkpoint and GGUF files (gguf-py cannot
  # quantize Q4_K, kt_kernel can), then the original reads the same files.
  if "$VENV/bin/python" benches/compare_original.py --methods $METHODS --gguf-type Q4_K \
      --weights-dir "$OUT/ckpt" --json "$OUT/ours.json" >"$OUT/ours.log" 2>&1 &&
     "$ORIG/bin/python" benches/compare_original.py --original --methods $METHODS --gguf-type Q4_K \
      --weights-dir "$OUT/ckpt" --json "$OUT/original.json" >"$OUT/original.log" 2>&1; then
    ORIG_OK=1
  else
    echo "[benchmarks] comparison failed; see $OUT/original.log and $OUT/ours.log"
  fi
  # Plain torch on the same native checkpoints (issue 19's baseline where the original cannot
  # run a method): keeps the native tensors, dequantizes each activated expert every call, then
  # multiplies in bf16 or in float32 (the table takes the faster).
  NATIVE="FP8 FP8_PERCHANNEL RAWINT4 GPTQ_INT4 MXFP4 NVFP4 MXFP8"
  rm -f "$OUT"/torch-dequant-*.json "$OUT"/avx2-*.json
  compare() {  # LABEL PYTHON ARGS...: one black-box run into $OUT/LABEL.json
    local label=$1 py=$2
    shift 2
    # shellcheck disable=SC2086
    "$py" benches/compare_original.py "$@" --weights-dir "$OUT/ckpt" --json "$OUT/$label.json" \
      >"$OUT/$label.log" 2>&1 || echo "[benchmarks] $label failed; see $OUT/$label.log"
  }
  for dt in bf16 float32; do
    # shellcheck disable=SC2086
    KT_TORCH_DEQUANT_DTYPE=$dt compare "torch-dequant-$dt" "$VENV/bin/python" --torch-dequant \
      --methods $NATIVE --tokens 1 512
  done
  # On an AVX-512 machine, the AVX2 level as well: ours and the original each load their AVX2
  # build, torch is held to AVX2 (ATen and oneDNN), as on an AVX2-only CPU.
  if grep -qw avx512f /proc/cpuinfo; then
    echo "[benchmarks] the same at the AVX2 level"
    export KT_KERNEL_CPU_VARIANT=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
    # shellcheck disable=SC2086
    compare avx2-ours "$VENV/bin/python" --methods $NATIVE --tokens 1 512
    # shellcheck disable=SC2086
    compare avx2-original "$ORIG/bin/python" --original --methods $NATIVE --tokens 1 512
    for dt in bf16 float32; do
      # shellcheck disable=SC2086
      KT_TORCH_DEQUANT_DTYPE=$dt compare "avx2-torch-dequant-$dt" "$VENV/bin/python" \
        --torch-dequant --methods $NATIVE --tokens 1 512
    done
    unset KT_KERNEL_CPU_VARIANT ATEN_CPU_CAPABILITY ONEDNN_MAX_CPU_ISA
  fi
  rm -rf "$OUT/ckpt"
fi

PEER_OK=0
[ -s "$OUT/llamacpp.json" ] && ! step peer && PEER_OK=1
if step peer && [ "${KT_SKIP_PEER:-0}" != 1 ]; then
  stamp peer
  echo "[benchmarks] llama.cpp (ggml mul_mat_id) vs LLAMAFILE, alternating"
  if "$VENV/bin/python" benches/compare_llamacpp.py --json "$OUT/llamacpp.json" \
      --markdown "$OUT/llamacpp.md" >"$OUT/llamacpp.log" 2>&1; then
    PEER_OK=1
  else
    echo "[benchmarks] llama.cpp comparison failed; see $OUT/llamacpp.log"
  fi
fi

"$VENV/bin/python" - "$OUT" "$ORIG_OK" "$PEER_OK" <<'PY'
import json, re, subprocess, sys, datetime
out, orig_ok, peer_ok = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
import os
# A step whose output is missing here (a fresh clone that reran only some steps) keeps its
# section from the BENCHMARKS.md being replaced, marked as such.
previous = open("BENCHMARKS.md").read() if os.path.exists("BENCHMARKS.md") else ""
def section(name, heading, intro=True):
    """The step's output `name`, or the old section `heading` less the intro paragraph the
    assembler writes itself (`intro`)."""
    if name and os.path.exists(f"{out}/{name}"):
        return open(f"{out}/{name}").read()
    at = previous.find("\n## " + heading)
    if at < 0:
        return f"(not run in this regeneration: no {out}/{name})"
    body = previous[previous.index("\n", at + 1) + 1:]
    end = body.find("\n## ")
    paragraphs = [p for p in (body[:end] if end >= 0 else body).split("\n\n") if p.strip()]
    note = "_Kept from the previous regeneration: this step was not rerun._"
    paragraphs = paragraphs[1:] if intro else paragraphs
    return "\n\n".join([note] + [p.strip("\n") for p in paragraphs if p.strip() != note]) + "\n"
lines = ["# Benchmarks", ""]
lines.append(f"Assembled by `bash scripts/benchmarks.sh` on {datetime.date.today()} from its steps' "
             "latest outputs. The machine is a shared 2-core VM whose speed swings run to run; "
             "compare figures as ratios within one run.")
stamps = []
for name in ("layer", "threads", "convert", "wwsb", "cargo", "original", "peer"):
    path = f"{out}/{name}.stamp"
    # A step not rerun in this clone keeps the stamp the previous BENCHMARKS.md gave it.
    kept = re.search(rf"[:;] {name} (\d{{4}}-\d\d-\d\d at [^;.]+)", previous.split("\n## ")[0])
    stamps.append(f"{name} {open(path).read().strip()}" if os.path.exists(path)
                  else f"{name} {kept.group(1)}" if kept else f"{name} (not recorded)")
lines += ["", "Each step as last run (date, commit): " + "; ".join(stamps) + "."]
lines += ["", "## Whole layer: kt-kernel's methods vs plain torch (`python -m kt_kernel bench`)", ""]
lines.append(open(f"{out}/layer.md").read())
threads_heading = "1 thread against 2 threads (`benches/thread_scaling.py`)"
if os.path.exists(f"{out}/threads.md") or ("## " + threads_heading) in previous:
    lines += ["", "## " + threads_heading, "",
              "The layer benchmark at each thread count, no torch baseline; `python -m kt_kernel "
              "bench --threads 1|2`.", ""]
    lines.append(section("threads.md", threads_heading))
lines += ["", "## Converter and loading converted weights (`benches/convert_bench.py`)", "",
          "The original's converter cannot run here: its PyPI wheel does not ship "
          "`scripts/convert_cpu_weights.py` (its `kt quant` looks for it), and its AVX2 build "
          "has no AMXINT8/AMXINT4 classes to quantize with. Conversion writes to the local disk "
          "(fsync included). Load times include the first touch of the layer's fresh memory, "
          "which is slow on this VM the first time a process uses it.", ""]
lines.append(section("convert.md", "Converter and loading converted weights"))
lines += ["", "## Online quantization (`benches/quantize_load.py`, part of the convert step)", "",
          "`load_weights_from_tensors` of one S1 layer (128 experts, H=2048, I=768) from bf16 "
          "tensors: each method quantizes to its own format on the pool while it loads (the "
          "original has no online path for the native formats). Reference: a torch per-row FP8 "
          "quantization of the same tensors (row amax, divide, cast to `float8_e4m3fn`) on as "
          "many threads, run after each load; × torch above 1 means our load is faster.", ""]
lines.append(section("quantize.md", "Online quantization"))
lines += ["", "## write_weight_scale_to_buffer and native loads (`benches/write_weight_scale_bench.py`)", "",
          "One S1 expert (H=2048, I=768) written from the CPU parts into every GPU rank's "
          "buffers, in the bytes the original writes (tests compare them); ranks in parallel; "
          "2 threads, loaded from native checkpoints, the experts taken in turn. The copy "
          "column: a torch copy of as many bytes in the same run (a plain copy has no "
          "transposing to do; most of it comes from cache at these sizes). The original: "
          "kt-kernel 0.7.2 on the same files, one run after ours. The second table times "
          "`load_weights` of the same checkpoints (fresh layer each time, file in the page "
          "cache), against a 1-thread read of the file in the same run.", ""]
lines.append(section("wwsb.md", "write_weight_scale_to_buffer"))
lines += ["", "## Kernels and pool (`cargo bench -p kt-benches`)", "",
          "Median of criterion's estimate. Panel kernels: throughput counts 2 flops per "
          "multiply-add (Gelem/s = GFLOP/s). Layer benches: bytes of expert weights touched per "
          "second. `parallel_phase`: one parallel phase of N tasks of about M µs each on our "
          "pinned pool and on a 2-thread rayon pool, and four such phases back to back as one "
          "decode forward issues them.", "", "```"]
name = None
cargo_lines = open(f"{out}/cargo.txt") if os.path.exists(f"{out}/cargo.txt") else []
if not cargo_lines:
    lines[-1:] = [section(None, "Kernels and pool").rstrip("\n").removesuffix("```").rstrip("\n")]
for line in cargo_lines:
    m = re.match(r"^(\S+/\S+)\s*$", line) or re.match(r"^(\S+/\S+)\s+time:", line)
    if m:
        name = m.group(1)
    t = re.search(r"time:\s+\[\S+ \S+ (\S+ \S+) \S+ \S+\]", line)
    if t and name:
        lines.append(f"{name:<48} time {t.group(1)}")
    r = re.search(r"thrpt:\s+\[\S+ \S+ (\S+ \S+) \S+ \S+\]", line)
    if r and name:
        lines[-1] += f"   thrpt {r.group(1)}"
        name = None
lines.append("```")
if orig_ok:
    o = json.load(open(f"{out}/original.json"))
    u = json.load(open(f"{out}/ours.json"))
    key = lambda r: (r["method"], r["tokens"])
    ours = {key(r): r for r in u["results"]}
    lines += ["", "## Against the original kt-kernel 0.7.2 (`benches/compare_original.py`, same script, one after the other)", "",
              f"Original: {o['implementation'].get('label')}; ours: {u['implementation'].get('label')}. "
              f"Read bandwidth measured by the script: {o['machine'].get('read_bandwidth_gbps')} / "
              f"{u['machine'].get('read_bandwidth_gbps')} GB/s.", "",
              "| method | tokens | original median ms | ours median ms | speed-up | original GB/s | ours GB/s | original GFLOP/s | ours GFLOP/s | rel L2 err original / ours |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in o["results"]:
        m = ours.get(key(r))
        if not m:
            continue
        lines.append(f"| {r['method']} | {r['tokens']} | {r['median_ms']:.2f} | {m['median_ms']:.2f} | "
                     f"{r['median_ms'] / m['median_ms']:.2f}× | {r['gbps']:.1f} | {m['gbps']:.1f} | "
                     f"{r['gflops']:.1f} | {m['gflops']:.1f} | {r['rel_l2']:.1e} / {m['rel_l2']:.1e} |")
elif not os.path.exists(f"{out}/original.log"):
    heading = "Against the original kt-kernel 0.7.2"
    lines += ["", "## " + heading + " (`benches/compare_original.py`, same script, one after the "
              "other)", "", section(None, heading, intro=False)]
else:
    lines += ["", "The original kt-kernel could not be run in this regeneration (see bench-results/)."]

def load(name):
    path = f"{out}/{name}.json"
    return json.load(open(path)) if os.path.exists(path) and os.path.getsize(path) else None
def rows(rep):
    return {(r["method"], r["tokens"]): r for r in rep["results"]} if rep else {}
def faster_torch(prefix):
    """Per (method, tokens): the faster of the bf16 and float32 torch dequantize runs."""
    best = {}
    for dt in ("bf16", "float32"):
        for k, r in rows(load(f"{prefix}torch-dequant-{dt}")).items():
            if k not in best or r["median_ms"] < best[k][1]["median_ms"]:
                best[k] = (dt, r)
    return best
torch_best = faster_torch("")
if torch_best and orig_ok:
    u = rows(json.load(open(f"{out}/ours.json")))
    lines += ["", "### The native formats against plain torch (`compare_original.py --torch-dequant`)", "",
              "Issue 19's baseline where the original cannot run a method: `benches/torch_dequant_moe.py` "
              "keeps the checkpoint's native tensors, dequantizes each activated expert's three matrices "
              "on every call (table lookups, scales), then runs the layer benchmark's plain-torch loop. "
              "It ran in bf16 and in float32; the faster is listed. Same script, files and inputs as "
              "the table above. Its times swing 2-5× between runs on this VM (each call allocates "
              "and frees the dequantized matrices); `bench-results/torch-dequant-*.json` keep its "
              "best calls.", "",
              "| method | tokens | torch ms (dtype) | ours ms | × torch | rel L2 err torch / ours |",
              "|---|---|---|---|---|---|"]
    for k, (dt, t) in sorted(torch_best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        m = u.get(k)
        if m:
            lines.append(f"| {k[0]} | {k[1]} | {t['median_ms']:.2f} ({dt}) | {m['median_ms']:.2f} | "
                         f"{t['median_ms'] / m['median_ms']:.2f}× | {t['rel_l2']:.1e} / {m['rel_l2']:.1e} |")
avx2_ours, avx2_orig = load("avx2-ours"), load("avx2-original")
if avx2_ours:
    a_u, a_o, a_t = rows(avx2_ours), rows(avx2_orig), faster_torch("avx2-")
    errors = (avx2_orig or {}).get("errors", {})
    lines += ["", "### The AVX2 level on this CPU", "",
              f"Ours: {avx2_ours['implementation'].get('label')}; original: "
              f"{(avx2_orig or {}).get('implementation', {}).get('label', 'not run')}; torch held to "
              "AVX2 (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`), the faster of bf16 and "
              "float32. `KT_KERNEL_CPU_VARIANT=avx2` makes both libraries load their AVX2 build, as on "
              "an AVX2-only CPU (whose own speeds differ: see the records).", "",
              "| method | tokens | original ms | torch ms (dtype) | ours ms | × original | × torch | rel L2 err ours |",
              "|---|---|---|---|---|---|---|---|"]
    for k, m in sorted(a_u.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        o, t = a_o.get(k), a_t.get(k)
        if o:
            o_ms, x_o = f"{o['median_ms']:.2f}", f"{o['median_ms'] / m['median_ms']:.2f}×"
        else:
            why = " ".join(x.strip() for x in errors.get(k[0], "not run").splitlines()[:2])
            o_ms, x_o = f"– ({why[:140]})", "–"
        t_ms = f"{t[1]['median_ms']:.2f} ({t[0]})" if t else "–"
        x_t = f"{t[1]['median_ms'] / m['median_ms']:.2f}×" if t else "–"
        lines.append(f"| {k[0]} | {k[1]} | {o_ms} | {t_ms} | {m['median_ms']:.2f} | {x_o} | {x_t} | "
                     f"{m['rel_l2']:.1e} |")
lines += ["", "## Against llama.cpp's CPU path (`benches/compare_llamacpp.py`, alternating rounds)", ""]
if peer_ok:
    p = json.load(open(f"{out}/llamacpp.json"))["meta"]
    lines += [f"Peer: {p['peer']}, built with -march=native by `benches/llamacpp_peer/setup.sh`; "
              "`benches/llamacpp_peer/moe_layer.cpp` runs gate, up (`mul_mat_id`), SwiGLU and down "
              "(`mul_mat_id`) of the same layer shape, 3 layers cycled, fresh random top-8 routing, "
              f"{p['threads']} threads, a persistent ggml thread pool. Q4_K runs from llama.cpp's "
              "CPU_REPACK buffer (its default for Q4_K on AVX2) and from plain memory; the faster is "
              "listed. Q8_0 has no x86 repacked layout in ggml. Ours: `python -m kt_kernel bench "
              f"--methods LLAMAFILE --no-torch`. {p['rounds']} rounds, peer then ours; each side keeps "
              "its lowest per-round median.", ""]
    lines.append(open(f"{out}/llamacpp.md").read())
elif not os.path.exists(f"{out}/llamacpp.log"):
    lines.append(section("llamacpp.md", "Against llama.cpp's CPU path", intro=False))
else:
    lines.append("llama.cpp could not be built or run in this regeneration (see bench-results/llamacpp.log).")
import os
if os.path.exists(f"{out}/ab.md"):
    lines += ["", "## Same-run A/B against an earlier commit (`bash scripts/ab_bench.sh REV`)", "",
              "Both builds installed side by side and run alternately (`benches/ab_compare.py`); "
              "the table is the last A/B run's, kept in bench-results/ab.md.", ""]
    lines.append(open(f"{out}/ab.md").read())
# Recorded A/B runs against commits that a regeneration does not rebuild (benches/records/).
import glob
records = sorted(glob.glob("benches/records/*.md"))
if records:
    lines += ["", "## Recorded same-run A/B runs (`benches/records/`)", ""]
    for path in records:
        lines.append(open(path).read())
open("BENCHMARKS.md", "w").write("\n".join(lines) + "\n")
print("wrote BENCHMARKS.md")
PY
