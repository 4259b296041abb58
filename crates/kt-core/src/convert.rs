//! The converter: a Hugging Face MoE checkpoint (bf16, fp16, fp32 or block-FP8 experts) to the
//! original kt-kernel's AMXINT8 / AMXINT4 files, the bytes its `convert_cpu_weights.py` writes.
//!
//! Output, merged layout (default): one shard per MoE layer,
//! `model-{i:05}-of-{n:05}.safetensors` (i-th MoE layer, `n` = MoE layers + 1), then one shard
//! of every non-expert tensor (renamed `model.layers.` → `blk.`, `model.` dropped, bytes
//! unchanged), `model.safetensors.index.json` (`total_size` 0, the original's key order) and
//! copies of `config.json` and the tokenizer files. Folder layout (`merge: false`): only
//! `_layer_{L}/_numa_{N}/*.kt`, nothing else, as the original.
//!
//! It streams: one layer at a time, each (part, expert, projection) quantized by a pool task
//! straight from the memory-mapped input into a buffer of that one matrix, then written at its
//! place in the output. Memory is therefore bounded by `threads ×` one expert matrix (int8
//! bytes, its f32 row and a 32-row group of int8 values), whatever the model size, and each
//! expert matrix's input pages are dropped from the process once all its parts are written. Every file (and each `_layer_{L}` folder)
//! appears under its final name only when complete, so an interrupted run leaves no
//! half-written shard, and `resume_layer` continues where it stopped.
use crate::converted::{
    is_partial_name, merged_index_order, partial_name, LayerShape, LayerWriter, SafetensorsWriter,
    TensorEntry, PROJS,
};
use crate::dtype::FloatType;
use crate::error::FirstError;
use crate::expert::{ExpertSource, Proj};
use crate::method::Method;
use crate::pool::Pool;
use crate::quant::{
    k_step, matrix_bytes, quantize_matrix, to_file_layout, FILE_K_BLOCK, GROUP_ROWS,
};
use crate::weights::{Checkpoint, HfLayerSource};
use crate::{kt_bail, kt_ensure, Error, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// What the converter needs from `config.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    /// `hidden_size`.
    pub hidden: usize,
    /// `moe_intermediate_size` (else `intermediate_size`).
    pub intermediate: usize,
    /// `n_routed_experts` (else `num_experts`, else `num_local_experts`).
    pub experts: usize,
    /// `quantization_config.weight_block_size`, if present.
    pub fp8_block: Option<Vec<usize>>,
}

impl ModelConfig {
    /// Read `dir/config.json` (fields of a nested `text_config` win, as in the original).
    pub fn read(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                Error::NotFound(format!("config.json not found in {}", dir.display()))
            }
            _ => Error::from(e),
        })?;
        let root: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Format(format!("{}: not valid JSON: {e}", path.display())))?;
        let cfg = root.get("text_config").unwrap_or(&root);
        let field = |names: &[&str]| -> Option<usize> {
            names
                .iter()
                .find_map(|n| cfg.get(*n).and_then(|v| v.as_u64()))
                .map(|v| v as usize)
        };
        let missing = |what: &str| {
            Error::Format(format!(
                "{}: missing {what}; the converter needs hidden_size, moe_intermediate_size and \
                 the expert count",
                path.display()
            ))
        };
        let quant = root
            .get("quantization_config")
            .or_else(|| cfg.get("quantization_config"));
        Ok(ModelConfig {
            hidden: field(&["hidden_size"]).ok_or_else(|| missing("hidden_size"))?,
            intermediate: field(&["moe_intermediate_size", "intermediate_size"])
                .ok_or_else(|| missing("moe_intermediate_size"))?,
            experts: field(&["n_routed_experts", "num_experts", "num_local_experts"])
                .ok_or_else(|| missing("n_routed_experts / num_experts"))?,
            fp8_block: quant
                .and_then(|q| q.get("weight_block_size"))
                .and_then(|b| b.as_array())
                .map(|b| {
                    b.iter()
                        .filter_map(|v| v.as_u64())
                        .map(|v| v as usize)
                        .collect()
                }),
        })
    }
}

/// Precision of the input experts (`--input-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputType {
    /// bf16 tensors.
    Bf16,
    /// fp16 tensors (cast to bf16 before quantizing, as the original does).
    Fp16,
    /// fp32 tensors (cast to bf16 likewise).
    Fp32,
    /// e4m3 tensors with 128×128 `weight_scale_inv` blocks (dequantized, then cast to bf16).
    Fp8,
}

impl InputType {
    /// From the option spelling: `bf16`, `fp16`, `fp32`, `fp8`.
    pub fn parse(s: &str) -> Result<InputType> {
        Ok(match s {
            "bf16" => InputType::Bf16,
            "fp16" => InputType::Fp16,
            "fp32" => InputType::Fp32,
            "fp8" => InputType::Fp8,
            "awq" => kt_bail!(
                Unsupported,
                "--input-type awq (AWQ to the original's AMXINT4_1K layout) is not implemented; \
                 convert from bf16, fp16, fp32 or fp8"
            ),
            other => kt_bail!(
                Invalid,
                "--input-type {other:?}: use bf16, fp16, fp32 or fp8"
            ),
        })
    }

    fn dtype(self) -> FloatType {
        match self {
            InputType::Bf16 => FloatType::BF16,
            InputType::Fp16 => FloatType::F16,
            InputType::Fp32 => FloatType::F32,
            InputType::Fp8 => FloatType::F8E4M3,
        }
    }

    fn name(self) -> &'static str {
        match self {
            InputType::Bf16 => "bf16",
            InputType::Fp16 => "fp16",
            InputType::Fp32 => "fp32",
            InputType::Fp8 => "fp8",
        }
    }
}

/// What to convert, and how.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// The Hugging Face checkpoint folder (config.json and safetensors shards).
    pub input: PathBuf,
    /// The output folder (created if missing).
    pub output: PathBuf,
    /// AMXINT8 or AMXINT4.
    pub method: Method,
    /// Expected precision of the experts (checked), or None to take what the files hold.
    pub input_type: Option<InputType>,
    /// `threadpool_count` the files are for (the split of the intermediate dimension).
    pub parts: usize,
    /// Merged safetensors (true) or `_layer_L/_numa_N/*.kt` folders (false).
    pub merge: bool,
    /// Skip MoE layers with a smaller index (their output must already be there).
    pub resume_layer: usize,
}

/// Live progress of a conversion, readable from another thread; `cancel` asks it to stop at the
/// next matrix (nothing partial is left under a final name).
#[derive(Debug, Default)]
pub struct ConvertProgress {
    /// MoE layers to convert in this run.
    pub layers_total: AtomicUsize,
    /// Of which done.
    pub layers_done: AtomicUsize,
    /// The layer being converted.
    pub layer: AtomicUsize,
    /// Input expert bytes of this run.
    pub bytes_total: AtomicU64,
    /// Of which read and converted.
    pub bytes_done: AtomicU64,
    /// Set to stop early.
    pub cancel: AtomicBool,
}

/// The method a `--quant-method` argument names (`int8`/`amxint8`, `int4`/`amxint4`, any case).
pub fn quant_method(arg: &str) -> Result<Method> {
    match arg.to_ascii_lowercase().as_str() {
        "int8" | "amxint8" => Ok(Method::AmxInt8),
        "int4" | "amxint4" => Ok(Method::AmxInt4),
        other => Err(Error::Unsupported(format!(
            "--quant-method {other}: only int8 and int4 (the AMXINT8/AMXINT4 files) are written"
        ))),
    }
}

/// A conversion running on a thread of its own with a pool of `threads` workers: callers poll
/// it ([`ConversionJob::wait`] with a timeout), show its progress and may cancel it.
pub struct ConversionJob {
    progress: Arc<ConvertProgress>,
    job: Mutex<Option<std::thread::JoinHandle<Result<ConvertReport>>>>,
}

impl ConversionJob {
    /// Start converting as `opts` says on `threads` workers (0 = every physical core).
    pub fn start(opts: ConvertOptions, threads: usize) -> Result<ConversionJob> {
        let threads = if threads == 0 {
            crate::topology::Topology::global()
                .total_physical_cores()
                .max(1)
        } else {
            threads
        };
        let progress = Arc::new(ConvertProgress::default());
        let p = progress.clone();
        let job = std::thread::Builder::new()
            .name("kt-convert".into())
            .spawn(move || {
                let pool = Pool::new(crate::pool::PoolConfig::split(threads, 1, None)?)?;
                convert(&pool, &opts, &p)
            })
            .map_err(|e| Error::Runtime(format!("cannot start the converter: {e}")))?;
        Ok(ConversionJob {
            progress,
            job: Mutex::new(Some(job)),
        })
    }

    /// Progress so far.
    pub fn progress(&self) -> &ConvertProgress {
        &self.progress
    }

    /// Ask the conversion to stop at the next matrix (nothing partial stays under a final name).
    pub fn cancel(&self) {
        self.progress.cancel.store(true, Ordering::Relaxed);
    }

    /// Wait until `deadline` (None: until done). `Some(result)` the first time the job is seen
    /// ended; `None` while it runs, or once its result was taken by an earlier call.
    pub fn wait(&self, deadline: Option<std::time::Instant>) -> Option<Result<ConvertReport>> {
        loop {
            let mut job = self.job.lock().unwrap();
            if job.as_ref().is_none_or(|h| h.is_finished()) {
                return job.take().map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Runtime("the converter panicked".into())))
                });
            }
            drop(job);
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Whether the job has ended and its result was taken.
    pub fn is_done(&self) -> bool {
        self.job.lock().unwrap().is_none()
    }
}

/// What a conversion did.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    /// Every MoE layer of the checkpoint.
    pub layers: Vec<usize>,
    /// The layers converted by this run (the others were skipped by `resume_layer`).
    pub converted: Vec<usize>,
    /// Input expert bytes read.
    pub input_bytes: u64,
    /// Bytes written.
    pub output_bytes: u64,
    /// Wall time.
    pub seconds: f64,
    /// Upper bound of the converter's own buffers (`threads ×` one matrix task).
    pub buffer_bound_bytes: usize,
}

/// Name of the merged shard of the `i`-th (0-based) of `n` files.
pub fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
}

/// Files the original copies next to merged output.
const COPIED_FILES: [&str; 4] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// Whether a checkpoint tensor belongs to the routed experts (converted, not copied).
fn is_expert_tensor(name: &str) -> bool {
    name.contains(".mlp.experts.") || name.contains(".block_sparse_moe.experts.")
}

/// The original's name for a copied tensor: `language_model.` removed, then for names starting
/// with `model.`: `model.layers.` → `blk.` and every other `model.` dropped.
pub fn renamed_tensor(name: &str) -> String {
    let name = name.replace("language_model.", "");
    if name.starts_with("model.") {
        name.replace("model.layers.", "blk.").replace("model.", "")
    } else {
        name
    }
}

/// Layer indices that hold routed experts, ascending.
pub fn moe_layers(ckpt: &Checkpoint) -> Vec<usize> {
    let mut layers: Vec<usize> = ckpt
        .names()
        .into_iter()
        .filter(|n| is_expert_tensor(n))
        .filter_map(|n| {
            let rest = &n[n.find("layers.")? + "layers.".len()..];
            rest[..rest.find('.')?].parse().ok()
        })
        .collect();
    layers.sort_unstable();
    layers.dedup();
    layers
}

/// Convert `opts.input` to `opts.output` on `pool`'s threads; `progress` is updated as it goes.
pub fn convert(
    pool: &Pool,
    opts: &ConvertOptions,
    progress: &ConvertProgress,
) -> Result<ConvertReport> {
    let t0 = std::time::Instant::now();
    kt_ensure!(
        matches!(opts.method, Method::AmxInt8 | Method::AmxInt4),
        Invalid,
        "the converter writes AMXINT8 or AMXINT4 weights"
    );
    let int4 = opts.method == Method::AmxInt4;
    kt_ensure!(
        opts.parts >= 1,
        Invalid,
        "--threadpool-count must be at least 1"
    );
    if !opts.input.is_dir() {
        kt_bail!(
            NotFound,
            "input path {} is not a checkpoint folder",
            opts.input.display()
        );
    }
    let same = |a: &Path, b: &Path| {
        a.canonicalize()
            .ok()
            .zip(b.canonicalize().ok())
            .is_some_and(|(a, b)| a == b)
    };
    kt_ensure!(
        !same(&opts.input, &opts.output),
        Invalid,
        "the output folder must differ from the input folder"
    );
    let config = ModelConfig::read(&opts.input)?;
    let (h, i, e) = (config.hidden, config.intermediate, config.experts);
    check_shape(h, i, opts.parts, int4)?;
    if opts.input_type == Some(InputType::Fp8) {
        if let Some(b) = &config.fp8_block {
            kt_ensure!(
                b == &[128, 128],
                Unsupported,
                "FP8 weight_block_size {b:?}: only 128x128 blocks are supported"
            );
        }
    }
    let ckpt = Arc::new(Checkpoint::open(&opts.input)?);
    let layers = moe_layers(&ckpt);
    kt_ensure!(
        !layers.is_empty(),
        Format,
        "no MoE expert layers found in {} (looked for *.layers.N.mlp.experts.* and \
         *.layers.N.block_sparse_moe.experts.*)",
        opts.input.display()
    );
    std::fs::create_dir_all(&opts.output)
        .map_err(|e| crate::error::io_error_at(&opts.output, "create the output folder", e))?;
    remove_stale_partials(&opts.output)?;

    let files = layers.len() + 1;
    let todo: Vec<(usize, usize)> = layers
        .iter()
        .copied()
        .enumerate()
        .filter(|&(_, l)| l >= opts.resume_layer)
        .collect();
    // Skipped layers must already be converted.
    for (idx, &l) in layers.iter().enumerate() {
        if l >= opts.resume_layer {
            continue;
        }
        let there = if opts.merge {
            opts.output.join(shard_name(idx, files))
        } else {
            opts.output.join(format!("_layer_{l}"))
        };
        kt_ensure!(
            there.exists(),
            NotFound,
            "--resume-layer {} skips layer {l}, but its output {} is missing",
            opts.resume_layer,
            there.display()
        );
    }

    // Every layer's source, checked up front (experts present, shapes, input type).
    let sources: Vec<(usize, usize, HfLayerSource)> = todo
        .iter()
        .map(|&(idx, l)| {
            let src = HfLayerSource::new(ckpt.clone(), l, e, h, i)?;
            check_input_type(&src, l, opts.input_type)?;
            Ok((idx, l, src))
        })
        .collect::<Result<_>>()?;
    let input_bytes: u64 = sources.iter().map(|(_, _, s)| source_bytes(s)).sum();
    progress
        .layers_total
        .store(sources.len(), Ordering::Relaxed);
    progress.bytes_total.store(input_bytes, Ordering::Relaxed);

    let mut output_bytes = 0u64;
    let mut converted = Vec::new();
    for (idx, layer, src) in &sources {
        progress.layer.store(*layer, Ordering::Relaxed);
        let shape = LayerShape {
            layer: *layer,
            experts: e,
            hidden: h,
            intermediate: i,
            parts: opts.parts,
            method: opts.method,
        };
        let writer = if opts.merge {
            LayerWriter::merged(&opts.output.join(shard_name(*idx, files)), shape)?
        } else {
            LayerWriter::folders(&opts.output, shape)?
        };
        convert_layer(pool, src, &shape, &writer, progress)?;
        if progress.cancel.load(Ordering::Relaxed) {
            kt_bail!(Runtime, "conversion cancelled during layer {layer}");
        }
        writer.finish()?;
        for name in src.tensor_names() {
            ckpt.release(&name);
        }
        let per_expert: usize = PROJS
            .iter()
            .map(|(p, _)| {
                let (q, s) = shape.part_bytes(*p);
                q + s
            })
            .sum();
        output_bytes += (opts.parts * e * per_expert) as u64;
        converted.push(*layer);
        progress.layers_done.fetch_add(1, Ordering::Relaxed);
    }

    if opts.merge {
        output_bytes += write_rest(pool, &ckpt, opts, &layers, e, h, i)?;
    }
    let threads = pool.total_threads();
    let largest = [(i / opts.parts, h), (h, i / opts.parts)]
        .iter()
        .map(|&(n, k)| matrix_bytes(int4, n, k) * 2 + n * 4 + k * 4 + GROUP_ROWS * k)
        .max()
        .unwrap_or(0);
    Ok(ConvertReport {
        layers,
        converted,
        input_bytes,
        output_bytes,
        seconds: t0.elapsed().as_secs_f64(),
        buffer_bound_bytes: threads * largest,
    })
}

/// The shape rules of the original's AMX layouts, checked before any work.
fn check_shape(h: usize, i: usize, parts: usize, int4: bool) -> Result<()> {
    let step = k_step(int4);
    let method = if int4 { "int4" } else { "int8" };
    kt_ensure!(
        h.is_multiple_of(step) && h.is_multiple_of(GROUP_ROWS),
        Invalid,
        "hidden_size={h} must be a multiple of {step} for {method}"
    );
    kt_ensure!(
        i.is_multiple_of(parts),
        Invalid,
        "moe_intermediate_size={i} does not split into --threadpool-count {parts} equal parts"
    );
    let ip = i / parts;
    kt_ensure!(
        ip.is_multiple_of(step) && ip.is_multiple_of(GROUP_ROWS),
        Invalid,
        "moe_intermediate_size={i} / --threadpool-count {parts} = {ip} per part, which must be a \
         multiple of {step} for {method} (down's inputs are the part's slice); use a threadpool \
         count that leaves whole blocks of {step}"
    );
    Ok(())
}

/// The experts' stored precision must be the one asked for (if any) and one the converter reads.
fn check_input_type(src: &HfLayerSource, layer: usize, want: Option<InputType>) -> Result<()> {
    let m = src.matrix(0, Proj::Gate)?;
    if let Some(t) = want {
        kt_ensure!(
            m.dtype == t.dtype(),
            Dtype,
            "--input-type {} but layer {layer}'s experts are {}",
            t.name(),
            m.dtype.name()
        );
    }
    Ok(())
}

/// Input bytes of a layer's experts (values, plus FP8 block scales).
fn source_bytes(src: &HfLayerSource) -> u64 {
    (0..src.num_experts())
        .flat_map(|e| [Proj::Gate, Proj::Up, Proj::Down].map(|p| src.matrix(e, p)))
        .filter_map(|m| m.ok())
        .map(|m| (m.rows * m.cols * m.dtype.size()) as u64)
        .sum()
}

thread_local! {
    /// One matrix's quantized bytes, its file-layout copy and its scales, per thread.
    static BUFFERS: std::cell::RefCell<(Vec<u8>, Vec<u8>, Vec<f32>)> = Default::default();
}

/// Quantize every (part, expert, projection) of one layer into `writer`, one pool task each.
fn convert_layer(
    pool: &Pool,
    src: &HfLayerSource,
    shape: &LayerShape,
    writer: &LayerWriter,
    progress: &ConvertProgress,
) -> Result<()> {
    let int4 = shape.method == Method::AmxInt4;
    let (h, ip) = (shape.hidden, shape.intermediate / shape.parts);
    // Task order: expert, projection, part — so a matrix's parts finish close together and its
    // input pages can be dropped at once (resident input stays at a few matrices).
    let tasks = shape.parts * shape.experts * 3;
    let parts_done: Vec<AtomicUsize> = (0..shape.experts * 3)
        .map(|_| AtomicUsize::new(0))
        .collect();
    let first_error = FirstError::new();
    pool.parallel_for_all(tasks, &|task| {
        if progress.cancel.load(Ordering::Relaxed) || first_error.is_set() {
            return;
        }
        let (matrix, part) = (task / shape.parts, task % shape.parts);
        let (expert, proj) = (matrix / 3, PROJS[matrix % 3].0);
        let result = (|| -> Result<()> {
            let m = src.matrix(expert, proj)?;
            let view = match proj {
                Proj::Down => m.sub(0, h, part * ip, ip)?,
                _ => m.sub(part * ip, ip, 0, h)?,
            };
            let (n, k) = (view.rows, view.cols);
            let bytes = matrix_bytes(int4, n, k);
            // Buffers reused by each thread across tasks (no allocation, no page zeroing).
            BUFFERS.with_borrow_mut(|(mem, file, scales)| -> Result<()> {
                mem.resize(bytes, 0);
                scales.resize(n, 0.0);
                // SAFETY: the view points into the checkpoint's maps, alive for this call.
                unsafe { quantize_matrix(&view, int4, mem, scales, None)? };
                let out = if k <= FILE_K_BLOCK {
                    &mem[..] // the file layout is the memory layout
                } else {
                    file.resize(bytes, 0);
                    to_file_layout(int4, n, k, mem, file)?;
                    &file[..]
                };
                writer.put(expert, proj, part, out, scales)
            })?;
            progress
                .bytes_done
                .fetch_add((n * k * view.dtype.size()) as u64, Ordering::Relaxed);
            if parts_done[matrix].fetch_add(1, Ordering::AcqRel) + 1 == shape.parts {
                let bytes = m.rows * m.row_stride * m.dtype.size();
                src.checkpoint().release_bytes(m.ptr, bytes);
            }
            Ok(())
        })();
        first_error.record(result);
    })?;
    first_error.into_result()
}

/// The non-expert shard, the index and the copied config files (merged layout); returns the
/// bytes written.
fn write_rest(
    pool: &Pool,
    ckpt: &Checkpoint,
    opts: &ConvertOptions,
    layers: &[usize],
    experts: usize,
    hidden: usize,
    intermediate: usize,
) -> Result<u64> {
    let files = layers.len() + 1;
    let rest_file = shard_name(layers.len(), files);
    let mut entries = Vec::new();
    let mut sources = Vec::new();
    for name in ckpt.names() {
        if is_expert_tensor(name) {
            continue;
        }
        let (_, dtype) = ckpt.raw(name)?;
        let dtype: safetensors::Dtype =
            serde_json::from_value(serde_json::Value::String(dtype.to_string()))
                .map_err(|e| Error::Format(format!("tensor {name}: dtype {dtype}: {e}")))?;
        let new = renamed_tensor(name);
        kt_ensure!(
            !entries.iter().any(|t: &TensorEntry| t.name == new),
            Format,
            "two input tensors are both named {new} after renaming"
        );
        entries.push(TensorEntry {
            name: new,
            dtype,
            shape: ckpt.shape(name).unwrap_or(&[]).to_vec(),
        });
        sources.push(name.to_string());
    }
    let writer = SafetensorsWriter::create(&opts.output.join(&rest_file), &entries)?;
    let first_error = FirstError::new();
    pool.parallel_for_all(entries.len(), &|t| {
        first_error.record(
            ckpt.raw(&sources[t])
                .and_then(|(bytes, _)| writer.write(&entries[t].name, bytes)),
        );
    })?;
    first_error.into_result()?;
    writer.finish()?;
    let mut written: u64 = entries.iter().map(|t| t.bytes() as u64).sum();

    // The index: every layer's expert keys in the original's order, then the copied tensors.
    let mut map: Vec<(String, String)> = Vec::new();
    for (idx, &l) in layers.iter().enumerate() {
        let shape = LayerShape {
            layer: l,
            experts,
            hidden,
            intermediate,
            parts: opts.parts,
            method: opts.method,
        };
        let file = shard_name(idx, files);
        map.extend(
            merged_index_order(&shape)
                .into_iter()
                .map(|(k, _)| (k, file.clone())),
        );
    }
    map.extend(entries.iter().map(|t| (t.name.clone(), rest_file.clone())));
    let index = index_json(&map);
    write_file_atomically(
        &opts.output.join("model.safetensors.index.json"),
        index.as_bytes(),
    )?;
    written += index.len() as u64;
    for name in COPIED_FILES {
        let from = opts.input.join(name);
        if from.is_file() {
            let bytes = std::fs::read(&from)?;
            write_file_atomically(&opts.output.join(name), &bytes)?;
            written += bytes.len() as u64;
        }
    }
    Ok(written)
}

/// `json.dump(index, indent=2)` of Python, as the original writes it (no final newline).
fn index_json(map: &[(String, String)]) -> String {
    let q = |s: &str| {
        let mut out = String::from("\"");
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
        out
    };
    let entries: Vec<String> = map
        .iter()
        .map(|(k, v)| format!("    {}: {}", q(k), q(v)))
        .collect();
    format!(
        "{{\n  \"metadata\": {{\n    \"total_size\": 0\n  }},\n  \"weight_map\": {{\n{}\n  }}\n}}",
        entries.join(",\n")
    )
}

/// Write `bytes` to `path` through a temporary name and a rename.
fn write_file_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = partial_name(path);
    let write_err = |e| crate::error::io_error_at(&tmp, "write", e);
    std::fs::write(&tmp, bytes).map_err(write_err)?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_data())
        .map_err(write_err)?;
    std::fs::rename(&tmp, path).map_err(|e| crate::error::io_error_at(path, "write", e))?;
    Ok(())
}

/// Temporary files and folders left by an interrupted run (any process) are removed.
fn remove_stale_partials(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().to_string();
        if is_partial_name(&name) {
            let p = entry.path();
            if p.is_dir() {
                std::fs::remove_dir_all(&p)?;
            } else {
                std::fs::remove_file(&p)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
