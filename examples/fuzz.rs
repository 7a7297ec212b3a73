//! A structure-aware mutation fuzzer for kvcandle's two model loaders, on stable Rust and
//! without coverage feedback.
//!
//! At start-up it builds its own tiny, valid models: GGUF files written with candle's
//! `gguf_file::write` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2K-Q6K tensors,
//! tied and untied, GGUF v2 and v3, a head dim other than hidden / heads, Llama 3 RoPE
//! factors in `rope_freqs.weight`) and Hugging Face
//! directories (`config.json` + `model.safetensors` in F32/F16/BF16/F64, one sharded
//! with `model.safetensors.index.json`). Each one must load and run, or the fuzzer stops.
//! Then, case after case, it takes one of them, applies 1 to 4 random mutations and feeds
//! the result to `kvcandle::loader::load_with_progress` (with `quantized` false, then true:
//! a directory then keeps its 16-bit matrices, and nothing else; mostly in float32,
//! sometimes float16); a model that loads is built
//! with `Llama::new` and run on `[0, 1, 2]`, then `[3]`, on a fresh cache.
//!
//! The mutations know both formats. GGUF: bit flips, bytes and 1/2/4/8-byte
//! "interesting" integers (0, 2^31, 2^58, 2^64-1, the old value + 2^58, ...) weighted
//! toward the header, truncation, deleted, copied and swapped header bytes; and, from a
//! parse of the header, edits of single fields: a tensor's dimensions (made to wrap
//! their product back to the old size), type, offset, name and dimension count, whole
//! tensor-info and metadata entries duplicated or removed (with the counts fixed), a
//! metadata value replaced (block_count, context_length 2^24 + 1, head counts,
//! general.alignment, ... in another integer type, a float, a string, an array), a RoPE
//! factor set to 0, a negative, NaN, an infinity or a subnormal, length
//! prefixes, keys and names holding a newline. A header edit that changes its length
//! moves the tensor data back to an aligned start, so only the intended field is wrong.
//! Hugging Face: config.json as JSON (numbers set to 0, -1, 1e9, 2^64, floats, strings,
//! null; fields removed; rope_scaling variants), the safetensors header as JSON (dtype,
//! shape, data_offsets, names, `__metadata__`), the 8-byte header length, tensors
//! dropped or reshaped consistently, shards and their index, files removed or emptied,
//! bit flips and truncation.
//!
//! A crash is any of: a panic (even one the loader catches and turns into an error,
//! since it means a check is missing; `--allow-caught-panics` counts those as errors), an
//! abort or a kill (allocation failure, out of memory), an error message on more than one
//! line or carrying a backtrace (`RUST_BACKTRACE=1` is set, so candle captures them),
//! resident memory past 1 GiB, a case running longer than `--hang-seconds`, or a result
//! that breaks the API's contract (logits of the wrong shape or dtype, a cache changed by
//! a failed forward, progress past its total).
//!
//! Every input is written to `<out>/current.gguf` or `<out>/current/` before it is
//! loaded, its description to `<out>/current.txt`. The cases run in a child process (this
//! binary with `--worker`) watched by the parent, so even a crash that kills the process
//! is reported: the input is copied to `<out>/crash-<seed>-<case>.gguf` (or the directory
//! `<out>/crash-<seed>-<case>/`), the seed, case, mutations and reason are printed with
//! the command that replays the case, and the exit status is 1 (with `--keep-going` the
//! run goes on, reporting each kind of crash once, and still exits 1). Without a crash
//! the run prints a summary per target (cases, cases/s, loads that succeeded, the most
//! frequent error groups, peak resident memory) and exits 0.
//!
//! ```text
//! export CARGO_TARGET_DIR=/work/target-fuzz   # optional
//! cargo run --release --example fuzz -- [--seconds N] [--seed S] [--target gguf|safetensors|all] [--out DIR]
//! cargo run --release --example fuzz -- --seed S --target gguf --cases 5000    # deterministic
//! cargo run --release --example fuzz -- --seed S --target gguf --only-case 1234 # replay one case
//! ```
//!
//! `--seconds` is the time per target (default 60); `--out` defaults to
//! `$CARGO_TARGET_DIR/fuzz`, else `target/fuzz`. A case depends only on the seed, the
//! target and its number, so a fixed `--seed` with `--cases` is a deterministic run and
//! any case can be replayed alone. `--help` lists every option.

// The mutations share one signature (a table picks them), and some resize the file.
#![allow(clippy::ptr_arg)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io::Cursor;
use std::ops::Range;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use kvcandle::loader::{self, tensor_table, TensorSpec};
use kvcandle::{Error, Llama, ModelConfig};
use serde_json::{json, Map, Value as Json};

const USAGE: &str = "\
usage: fuzz [--seconds N] [--cases N] [--seed S] [--target gguf|safetensors|all] [--out DIR]
            [--only-case N] [--hang-seconds N] [--max-rss-mib N] [--in-process]
            [--allow-caught-panics] [--keep-going] [--groups N] [--verbose]

  --seconds N            time per target (default 60; with --cases alone, no time limit)
  --cases N              at most N cases per target (with a fixed --seed: a deterministic run)
  --seed S               the run's seed (default: from the clock); printed so a run can be repeated
  --target T             gguf, safetensors or all (default all)
  --out DIR              scratch and crash directory (default $CARGO_TARGET_DIR/fuzz, else target/fuzz)
  --only-case N          replay case N of this --seed and --target alone, printing every outcome
  --hang-seconds N       a case running longer than N seconds is a crash (default 30)
  --max-rss-mib N        resident memory past N MiB during a case is a crash (default 1024)
  --in-process           run the cases in this process, unwatched (an abort ends the run unreported)
  --allow-caught-panics  count a panic the loader catches and reports as an error, not a crash
  --keep-going           after a crash, go on (each kind of crash is reported once; the exit status is still 1)
  --groups N             how many error groups the summary lists (default 15)
  --verbose              print every case's mutations and outcomes";

// ------------------------------------------------------------------------------------
// Command line
// ------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Target {
    Gguf,
    Safetensors,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Gguf => "gguf",
            Target::Safetensors => "safetensors",
        }
    }
}

#[derive(Clone, Debug)]
struct Options {
    seconds: Option<f64>,
    cases: Option<u64>,
    seed: u64,
    targets: Vec<Target>,
    target_arg: String,
    out: PathBuf,
    only_case: Option<u64>,
    hang_seconds: u64,
    max_rss_mib: u64,
    in_process: bool,
    worker: bool,
    allow_caught_panics: bool,
    keep_going: bool,
    groups: usize,
    verbose: bool,
}

impl Options {
    /// The time limit per target, if any.
    fn time_limit(&self) -> Option<Duration> {
        match (self.seconds, self.cases) {
            (Some(s), _) => Some(Duration::from_secs_f64(s)),
            (None, Some(_)) => None,
            (None, None) => Some(Duration::from_secs(60)),
        }
    }
}

/// `Ok(None)` when help was asked for.
fn parse_args(args: &[String]) -> Result<Option<Options>, String> {
    let default_out = std::env::var_os("CARGO_TARGET_DIR")
        .map(|d| PathBuf::from(d).join("fuzz"))
        .unwrap_or_else(|| PathBuf::from("target/fuzz"));
    let mut o = Options {
        seconds: None,
        cases: None,
        seed: SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64),
        targets: vec![Target::Gguf, Target::Safetensors],
        target_arg: "all".into(),
        out: default_out,
        only_case: None,
        hang_seconds: 30,
        max_rss_mib: 1024,
        in_process: false,
        worker: false,
        allow_caught_panics: false,
        keep_going: false,
        groups: 15,
        verbose: false,
    };
    let mut seed_given = false;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().cloned().ok_or_else(|| format!("{name} needs a value"));
        let number = |name: &str, v: String| v.parse::<u64>().map_err(|_| format!("{name}: not a number: {v:?}"));
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--seconds" => {
                let v = value(arg)?;
                let s: f64 = v.parse().map_err(|_| format!("--seconds: not a number: {v:?}"))?;
                if !(s.is_finite() && s >= 0.0) {
                    return Err(format!("--seconds: {v} is not a duration"));
                }
                o.seconds = Some(s);
            }
            "--cases" => o.cases = Some(number(arg, value(arg)?)?),
            "--seed" => {
                o.seed = number(arg, value(arg)?)?;
                seed_given = true;
            }
            "--only-case" => o.only_case = Some(number(arg, value(arg)?)?),
            "--hang-seconds" => o.hang_seconds = number(arg, value(arg)?)?.max(1),
            "--max-rss-mib" => o.max_rss_mib = number(arg, value(arg)?)?,
            "--out" => o.out = PathBuf::from(value(arg)?),
            "--target" => {
                o.target_arg = value(arg)?;
                o.targets = match o.target_arg.as_str() {
                    "gguf" => vec![Target::Gguf],
                    "safetensors" => vec![Target::Safetensors],
                    "all" => vec![Target::Gguf, Target::Safetensors],
                    t => return Err(format!("--target: unknown target {t:?} (gguf, safetensors or all)")),
                };
            }
            "--in-process" => o.in_process = true,
            "--worker" => o.worker = true,
            "--allow-caught-panics" => o.allow_caught_panics = true,
            "--keep-going" => o.keep_going = true,
            "--groups" => o.groups = number(arg, value(arg)?)? as usize,
            "--verbose" => o.verbose = true,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if o.only_case.is_some() && (o.targets.len() != 1 || !seed_given) {
        return Err("--only-case needs the run's --seed and --target gguf or --target safetensors".into());
    }
    Ok(Some(o))
}

fn main() -> ExitCode {
    // Before any thread starts: with RUST_BACKTRACE set, candle captures a backtrace into
    // its errors, and no error message kvcandle shows may carry one.
    std::env::set_var("RUST_BACKTRACE", "1");
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match parse_args(&args) {
        Ok(Some(o)) => o,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("fuzz: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if opts.worker || opts.in_process || opts.only_case.is_some() {
        worker(&opts)
    } else {
        supervise(&opts, &args)
    }
}

// ------------------------------------------------------------------------------------
// Random numbers and interesting values
// ------------------------------------------------------------------------------------

/// splitmix64: small, fast, and the same everywhere, so a seed replays a run.
struct Rng(u64);

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The generator of case `n` of `target` in the run `seed`: a case depends on nothing else.
    fn for_case(seed: u64, target: Target, n: u64) -> Self {
        let t = match target {
            Target::Gguf => 1u64,
            Target::Safetensors => 2,
        };
        Self(mix(seed ^ mix(n ^ (t << 60))))
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in 0..n (0 when n is 0).
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }

    /// One of `items`, which must not be empty (for constant tables).
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// One of `items`, None when there are none (for what a mutation found in the input).
    fn choose<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        (!items.is_empty()).then(|| self.pick(items))
    }

    fn weighted<'a, T>(&mut self, items: &'a [(u32, T)]) -> &'a T {
        let total: u64 = items.iter().map(|(w, _)| u64::from(*w)).sum();
        let mut x = self.next_u64() % total;
        for (w, item) in items {
            if x < u64::from(*w) {
                return item;
            }
            x -= u64::from(*w);
        }
        &items[items.len() - 1].1
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Numbers that tend to break size arithmetic: small, block sizes, powers of two and their
/// neighbours, 2^24 (kvcandle's dimension cap), and values whose products wrap round 2^64.
const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    16,
    31,
    32,
    33,
    63,
    64,
    127,
    128,
    255,
    256,
    65_535,
    1 << 16,
    1 << 24,
    (1 << 24) + 1,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    1_000_000_000,
    1 << 58,
    (1 << 58) + 1,
    (1 << 58) + 32,
    1 << 60,
    1 << 62,
    (1 << 63) - 1,
    1 << 63,
    u64::MAX,
];

/// An interesting replacement for `orig`: one of [`INTERESTING`], or `orig` moved a little
/// or by a power of two that a product of dimensions can swallow.
fn interesting(rng: &mut Rng, orig: u64) -> u64 {
    if rng.chance(35) {
        match rng.below(9) {
            0 => orig.wrapping_add(1),
            1 => orig.wrapping_sub(1),
            2 => orig.wrapping_add(1 << 58),
            3 => orig.wrapping_add(1 << 60),
            4 => orig.wrapping_add(1 << 63),
            5 => orig.wrapping_mul(2),
            6 => orig / 2,
            7 => orig.swap_bytes(),
            _ => !orig,
        }
    } else {
        *rng.pick(INTERESTING)
    }
}

/// A number for a mutation's description: hexadecimal when large.
fn show(v: u64) -> String {
    if v >= 1 << 32 {
        format!("{v:#x}")
    } else {
        v.to_string()
    }
}

/// At most `n` characters of `s`.
fn clip(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

const INTERESTING_BYTES: &[u8] = &[0, 1, 2, 0x7f, 0x80, 0xff, b'\n', b'\r', b'"', b'\\', b' ', b'0', 0xc3];

/// 32-bit words that are special as f32 (NaN, infinities, the largest float) or as a pair
/// of f16 block scales (NaN, infinity).
const SPECIAL_WORDS: &[u32] = &[0x7fc0_0000, 0x7f80_0000, 0xff80_0000, 0x7f7f_ffff, 0xffff_ffff, 0x7e00_7e00, 0x7c00_7c00, 0];

fn read_le(b: &[u8], at: usize, width: usize) -> Option<u64> {
    let bytes = b.get(at..at.checked_add(width)?)?;
    Some(bytes.iter().rev().fold(0u64, |v, &x| (v << 8) | u64::from(x)))
}

fn write_le(b: &mut [u8], at: usize, width: usize, v: u64) -> bool {
    match at.checked_add(width).and_then(|end| b.get_mut(at..end)) {
        Some(bytes) => {
            bytes.copy_from_slice(&v.to_le_bytes()[..width]);
            true
        }
        None => false,
    }
}

fn align_up(n: usize, alignment: usize) -> usize {
    n.div_ceil(alignment.max(1)) * alignment.max(1)
}

// ------------------------------------------------------------------------------------
// Seeds: tiny valid models, built at start-up
// ------------------------------------------------------------------------------------

/// A Hugging Face directory: file name -> contents.
type HfDir = BTreeMap<String, Vec<u8>>;

#[derive(Clone)]
enum Input {
    Gguf(Vec<u8>),
    Hf(HfDir),
}

struct Seed {
    name: &'static str,
    /// How often this seed is picked, relative to the others of its target.
    weight: u32,
    input: Input,
}

struct ModelDims {
    vocab: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ff: usize,
    layers: usize,
    tied: bool,
}

impl ModelDims {
    fn config(&self) -> ModelConfig {
        ModelConfig {
            vocab_size: self.vocab,
            hidden_size: self.hidden,
            intermediate_size: self.ff,
            num_hidden_layers: self.layers,
            num_attention_heads: self.heads,
            num_key_value_heads: self.kv_heads,
            head_dim: self.head_dim,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 64,
            tie_word_embeddings: self.tied,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            rope_scaling: None,
            rope_freq_factors: None,
        }
    }
}

/// Small random weights (norms near 1), from a fixed generator: seeds are the same every run.
fn random_tensor(rng: &mut Rng, spec: &TensorSpec) -> candle_core::Result<Tensor> {
    let n: usize = spec.shape.iter().product();
    let norm = spec.shape.len() == 1;
    let values: Vec<f32> =
        (0..n).map(|_| if norm { 1.0 + 0.1 * (rng.unit() - 0.5) } else { 0.2 * (rng.unit() - 0.5) }).collect();
    Tensor::from_vec(values, spec.shape.as_slice(), &Device::Cpu)
}

/// A GGUF file of a model of `dims`, tensor `spec` stored as `kind(spec)`, with
/// llama.cpp's metadata, `extra` entries replacing or following it, written as `version`;
/// with `rope_factors`, Llama 3 RoPE scaling as llama.cpp writes it (`rope_freqs.weight`).
fn gguf_seed(
    dims: &ModelDims,
    kind: fn(&TensorSpec) -> GgmlDType,
    extra: Vec<(&str, Value)>,
    version: u32,
    rope_factors: Option<Vec<f32>>,
) -> candle_core::Result<Vec<u8>> {
    let mut rng = Rng::new(0x5eed_6775);
    let mut tensors = Vec::new();
    for spec in tensor_table(&dims.config()) {
        let q = QTensor::quantize(&random_tensor(&mut rng, &spec)?, kind(&spec))?;
        tensors.push((spec.gguf.clone(), q));
    }
    if let Some(factors) = rope_factors {
        let n = factors.len();
        tensors.push((ROPE_FREQS.to_string(), QTensor::quantize(&Tensor::from_vec(factors, n, &Device::Cpu)?, GgmlDType::F32)?));
    }
    let tokens: Vec<Value> = (0..dims.vocab)
        .map(|i| Value::String(["<unk>", "<s>", "</s>"].get(i).map_or_else(|| format!("t{i}"), |s| s.to_string())))
        .collect();
    let types: Vec<Value> = (0..dims.vocab).map(|i| Value::I32(if i < 3 { 3 } else { 1 })).collect();
    let u32_of = |n: usize| Value::U32(n as u32);
    let mut meta: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("general.name", Value::String("kvcandle fuzz seed".into())),
        ("llama.block_count", u32_of(dims.layers)),
        ("llama.context_length", u32_of(64)),
        ("llama.embedding_length", u32_of(dims.hidden)),
        ("llama.feed_forward_length", u32_of(dims.ff)),
        ("llama.attention.head_count", u32_of(dims.heads)),
        ("llama.attention.head_count_kv", u32_of(dims.kv_heads)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens", Value::Array(tokens)),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.merges", Value::Array(vec![Value::String("t 3".into()), Value::String("t 4".into())])),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
    ];
    for (key, value) in extra {
        match meta.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = value,
            None => meta.push((key, value)),
        }
    }
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, q)| (n.as_str(), q)).collect();
    let mut out = Cursor::new(Vec::new());
    gguf_file::write(&mut out, &meta_refs, &tensor_refs)?;
    let mut bytes = out.into_inner();
    bytes[4..8].copy_from_slice(&version.to_le_bytes());
    Ok(bytes)
}

/// A Hugging Face directory of a model of `dims`, tensor `i` stored as `dtype(i)`, with
/// `extra` config.json fields.
fn hf_seed(dims: &ModelDims, dtype: fn(usize) -> DType, extra: Json, scratch: &Path) -> candle_core::Result<HfDir> {
    let mut rng = Rng::new(0x5eed_5afe);
    let mut tensors = HashMap::new();
    for (i, spec) in tensor_table(&dims.config()).iter().enumerate() {
        tensors.insert(spec.name.clone(), random_tensor(&mut rng, spec)?.to_dtype(dtype(i))?);
    }
    let path = scratch.join("seed.safetensors");
    candle_core::safetensors::save(&tensors, &path)?;
    let weights = fs::read(&path)?;
    fs::remove_file(&path)?;
    let mut config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": dims.vocab,
        "hidden_size": dims.hidden,
        "intermediate_size": dims.ff,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": dims.tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    });
    if let (Some(c), Json::Object(extra)) = (config.as_object_mut(), extra) {
        c.extend(extra);
    }
    let mut dir = HfDir::new();
    dir.insert("config.json".into(), serde_json::to_vec_pretty(&config).unwrap_or_default());
    dir.insert("model.safetensors".into(), weights);
    Ok(dir)
}

fn build_seeds(scratch: &Path) -> candle_core::Result<(Vec<Seed>, Vec<Seed>)> {
    use GgmlDType as G;
    let gguf = Input::Gguf;
    let seeds_gguf = vec![
        Seed {
            name: "gguf-base",
            weight: 40,
            input: gguf(gguf_seed(
                &ModelDims { vocab: 48, hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, ff: 96, layers: 2, tied: false },
                |s| match s.gguf.rsplit('.').nth(1).unwrap_or("") {
                    "attn_q" | "attn_output" | "ffn_gate" | "ffn_down" | "output" => G::Q8_0,
                    "attn_k" => G::Q4_1,
                    "attn_v" => G::F16,
                    "ffn_up" => G::BF16,
                    _ => G::F32,
                },
                vec![],
                2,
                None,
            )?),
        },
        Seed {
            name: "gguf-tied-v3",
            weight: 25,
            input: gguf(gguf_seed(
                &ModelDims { vocab: 40, hidden: 64, heads: 4, kv_heads: 4, head_dim: 16, ff: 64, layers: 1, tied: true },
                |s| match s.gguf.rsplit('.').nth(1).unwrap_or("") {
                    "token_embd" | "attn_k" | "ffn_up" => G::Q8_0,
                    "attn_q" | "ffn_down" => G::Q4_1,
                    "attn_v" => G::Q4_0,
                    "attn_output" => G::Q5_0,
                    "ffn_gate" => G::Q5_1,
                    _ => G::F32,
                },
                vec![
                    ("general.alignment", Value::U32(32)),
                    ("llama.rope.dimension_count", Value::U32(16)),
                    ("llama.vocab_size", Value::U32(40)),
                    ("llama.rope.scaling.type", Value::String("none".into())),
                ],
                3,
                None,
            )?),
        },
        Seed {
            name: "gguf-head-dim",
            weight: 25,
            input: gguf(gguf_seed(
                &ModelDims { vocab: 32, hidden: 64, heads: 2, kv_heads: 1, head_dim: 64, ff: 64, layers: 1, tied: false },
                |s| match s.gguf.as_str() {
                    "token_embd.weight" => G::F16,
                    _ if s.linear => G::Q8_0,
                    _ => G::F32,
                },
                vec![
                    ("llama.attention.key_length", Value::U32(64)),
                    ("llama.block_count", Value::U64(1)),
                    ("llama.context_length", Value::I32(64)),
                    ("llama.attention.head_count_kv", Value::U16(1)),
                    ("llama.rope.freq_base", Value::F64(10_000.0)),
                ],
                3,
                None,
            )?),
        },
        Seed {
            name: "gguf-k-quants",
            weight: 10,
            input: gguf(gguf_seed(
                &ModelDims { vocab: 8, hidden: 256, heads: 2, kv_heads: 1, head_dim: 128, ff: 256, layers: 1, tied: false },
                |s| match s.gguf.rsplit('.').nth(1).unwrap_or("") {
                    "attn_q" => G::Q4K,
                    "attn_k" => G::Q6K,
                    "attn_v" => G::Q5K,
                    "attn_output" => G::Q3K,
                    "ffn_gate" => G::Q2K,
                    "ffn_up" => G::Q4K,
                    "ffn_down" => G::Q5_0,
                    "output" => G::Q4_0,
                    _ => G::F32,
                },
                vec![],
                2,
                None,
            )?),
        },
        Seed {
            name: "gguf-llama3-rope",
            weight: 15,
            input: gguf(gguf_seed(
                &ModelDims { vocab: 40, hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, ff: 96, layers: 1, tied: true },
                |s| if s.linear { G::Q8_0 } else { G::F32 },
                vec![("llama.rope.freq_base", Value::F32(500_000.0))],
                3,
                Some(vec![1.0, 1.0, 1.0, 1.5, 2.5, 4.0, 8.0, 8.0]),
            )?),
        },
    ];

    let base = ModelDims { vocab: 32, hidden: 32, heads: 4, kv_heads: 2, head_dim: 8, ff: 48, layers: 2, tied: false };
    let base_dir = hf_seed(&base, |_| DType::F32, json!({}), scratch)?;
    let mut sharded = base_dir.clone();
    shard(&mut Rng::new(0x5eed_0002), &mut sharded, 2);
    let mixed = hf_seed(
        &ModelDims { vocab: 40, hidden: 64, heads: 2, kv_heads: 1, head_dim: 16, ff: 64, layers: 1, tied: true },
        |i| [DType::F16, DType::BF16, DType::F64, DType::F32][i % 4],
        json!({
            "head_dim": 16,
            "eos_token_id": [2, 3],
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "torch_dtype": "bfloat16",
        }),
        scratch,
    )?;
    let seeds_hf = vec![
        Seed { name: "hf-base", weight: 45, input: Input::Hf(base_dir) },
        Seed { name: "hf-mixed-tied", weight: 35, input: Input::Hf(mixed) },
        Seed { name: "hf-sharded", weight: 20, input: Input::Hf(sharded) },
    ];
    Ok((seeds_gguf, seeds_hf))
}

/// Each seed must load and run (and the GGUF parser below must agree with candle's), or
/// the mutants would test nothing.
fn check_seeds(seeds: &[Seed], scratch: &Scratch) -> Result<(), String> {
    for seed in seeds {
        if let Input::Gguf(bytes) = &seed.input {
            let layout = parse_gguf(bytes);
            let content = gguf_file::Content::read(&mut Cursor::new(bytes))
                .map_err(|e| format!("seed {}: candle cannot read it: {e}", seed.name))?;
            if !layout.complete
                || layout.data_start() as u64 != content.tensor_data_offset
                || layout.tensors.len() != content.tensor_infos.len()
                || layout.kvs.len() != content.metadata.len()
            {
                return Err(format!(
                    "seed {}: the fuzzer's GGUF parser disagrees with candle (data at {} vs {}, {} vs {} tensors)",
                    seed.name,
                    layout.data_start(),
                    content.tensor_data_offset,
                    layout.tensors.len(),
                    content.tensor_infos.len()
                ));
            }
        }
        let path = scratch.write(&seed.input).map_err(|e| format!("seed {}: {e}", seed.name))?;
        for quantized in [false, true] {
            match exercise(&path, DType::F32, quantized) {
                Ok(Outcome::Ran) => {}
                Ok(Outcome::Failed { stage, error }) => {
                    return Err(format!("seed {} (quantized={quantized}) fails at {stage}: {error}", seed.name))
                }
                Err(contract) => return Err(format!("seed {} (quantized={quantized}): {contract}", seed.name)),
            }
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------
// GGUF: a tolerant parse of the header, recording where every field is
// ------------------------------------------------------------------------------------

const TENSOR_COUNT_AT: usize = 8;
const KV_COUNT_AT: usize = 16;
const HEADER_FIXED: usize = 24;
/// The parse gives up past this many entries (the seeds have a few dozen).
const MAX_ENTRIES: u64 = 100_000;

#[derive(Debug)]
struct KvEntry {
    start: usize,
    key: String,
    /// Where the value's type id is; the value follows it.
    type_at: usize,
    vtype: u32,
    end: usize,
}

#[derive(Debug)]
struct TensorEntry {
    start: usize,
    name: String,
    ndims_at: usize,
    dims: Vec<u64>,
    type_id: u32,
    end: usize,
}

impl TensorEntry {
    fn dim_at(&self, i: usize) -> usize {
        self.ndims_at + 4 + 8 * i
    }

    fn type_at(&self) -> usize {
        self.dim_at(self.dims.len())
    }

    fn offset_at(&self) -> usize {
        self.type_at() + 4
    }
}

#[derive(Debug, Default)]
struct GgufLayout {
    kvs: Vec<KvEntry>,
    tensors: Vec<TensorEntry>,
    /// End of the last entry read: of the whole header when `complete`.
    info_end: usize,
    /// Every metadata entry and tensor info was read.
    complete: bool,
    alignment: usize,
}

impl GgufLayout {
    /// Where the tensor data starts (meaningful when `complete`).
    fn data_start(&self) -> usize {
        align_up(self.info_end, self.alignment)
    }

    /// The bytes byte-level mutations favour: the header, or a guess at it.
    fn header_len(&self, file_len: usize) -> usize {
        let end = if self.complete { self.info_end } else { self.info_end.saturating_add(256) };
        end.min(file_len)
    }
}

struct Bytes<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Bytes<'a> {
    fn take(&mut self, n: u64) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(usize::try_from(n).ok()?)?;
        let s = self.b.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn string(&mut self) -> Option<String> {
        let n = self.u64()?;
        Some(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
}

/// Bytes of one value of a fixed-size GGUF type.
fn fixed_size(vtype: u32) -> Option<u64> {
    match vtype {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

fn skip_value(c: &mut Bytes, vtype: u32, depth: usize) -> Option<()> {
    if let Some(n) = fixed_size(vtype) {
        return c.take(n).map(|_| ());
    }
    match vtype {
        8 => {
            let n = c.u64()?;
            c.take(n).map(|_| ())
        }
        9 if depth < 3 => {
            let item = c.u32()?;
            let count = c.u64()?;
            match fixed_size(item) {
                Some(n) => c.take(count.checked_mul(n)?).map(|_| ()),
                // each item takes at least 8 bytes, so a bad count soon runs out of file
                None => (0..count).try_for_each(|_| skip_value(c, item, depth + 1)),
            }
        }
        _ => None,
    }
}

/// Reads as much of a GGUF header as makes sense; never fails.
fn parse_gguf(b: &[u8]) -> GgufLayout {
    let mut l = GgufLayout { alignment: 32, ..Default::default() };
    let mut c = Bytes { b, pos: 0 };
    l.complete = read_layout(&mut c, &mut l).is_some();
    l
}

fn read_layout(c: &mut Bytes, l: &mut GgufLayout) -> Option<()> {
    c.take(8)?; // magic, version
    let tensors = c.u64()?;
    let kvs = c.u64()?;
    l.info_end = c.pos;
    for _ in 0..kvs.min(MAX_ENTRIES) {
        let start = c.pos;
        let key = c.string()?;
        let type_at = c.pos;
        let vtype = c.u32()?;
        skip_value(c, vtype, 0)?;
        if key == "general.alignment" && vtype == 4 {
            let a = read_le(c.b, type_at + 4, 4)? as usize;
            if a.is_power_of_two() {
                l.alignment = a;
            }
        }
        l.kvs.push(KvEntry { start, key, type_at, vtype, end: c.pos });
        l.info_end = c.pos;
    }
    if kvs > MAX_ENTRIES {
        return None;
    }
    for _ in 0..tensors.min(MAX_ENTRIES) {
        let start = c.pos;
        let name = c.string()?;
        let ndims_at = c.pos;
        let n = c.u32()?;
        if n > 8 {
            return None;
        }
        let dims = (0..n).map(|_| c.u64()).collect::<Option<Vec<_>>>()?;
        let type_id = c.u32()?;
        c.u64()?; // offset
        l.tensors.push(TensorEntry { start, name, ndims_at, dims, type_id, end: c.pos });
        l.info_end = c.pos;
    }
    (tensors <= MAX_ENTRIES).then_some(())
}

/// `b` with `range` of its header replaced by `with`. When the whole header was parsed,
/// the padding before the tensor data is recomputed so that the data section starts at
/// its aligned place again: the edit changes only what it means to.
fn splice_header(b: &[u8], l: &GgufLayout, range: Range<usize>, with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len() + with.len() + l.alignment);
    out.extend_from_slice(&b[..range.start.min(b.len())]);
    out.extend_from_slice(with);
    let data = l.data_start();
    if l.complete && range.end <= l.info_end && data <= b.len() {
        out.extend_from_slice(&b[range.end..l.info_end]);
        out.resize(align_up(out.len(), l.alignment), 0);
        out.extend_from_slice(&b[data..]);
    } else {
        out.extend_from_slice(&b[range.end.min(b.len())..]);
    }
    out
}

/// Adds `delta` to the u64 count at `at` (the tensor or metadata count).
fn bump_count(b: &mut [u8], at: usize, delta: i64) {
    if let Some(v) = read_le(b, at, 8) {
        write_le(b, at, 8, v.wrapping_add(delta as u64));
    }
}

fn encode_str(s: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s);
}

fn value_type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

/// The GGUF encoding of a value (without its type id).
fn encode_payload(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => encode_str(s.as_bytes(), out),
        Value::Array(items) => {
            out.extend_from_slice(&items.first().map_or(4, value_type_id).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                encode_payload(item, out);
            }
        }
    }
}

/// Type id and payload of a value.
fn encode_typed(v: &Value) -> Vec<u8> {
    let mut out = value_type_id(v).to_le_bytes().to_vec();
    encode_payload(v, &mut out);
    out
}

// ------------------------------------------------------------------------------------
// GGUF mutations
// ------------------------------------------------------------------------------------

type GgufMutator = fn(&mut Rng, &mut Vec<u8>, &GgufLayout) -> Option<String>;

/// (weight, mutation). Each returns its description, or None when it does not apply to
/// this input (then another is drawn).
const GGUF_MUTATORS: &[(u32, GgufMutator)] = &[
    // bytes, mostly of the header
    (8, bit_flip),
    (5, set_byte),
    (8, set_int),
    (4, truncate),
    (3, delete_range),
    (3, duplicate_range),
    (2, swap_words),
    (2, data_words),
    // the tensor-info table
    (8, tensor_dim),
    (4, tensor_reshape),
    (3, tensor_n_dims),
    (3, tensor_n_dims_consistent),
    (5, tensor_type),
    (5, tensor_offset),
    (3, rope_factor),
    (4, tensor_name),
    (3, tensor_entry),
    // metadata
    (12, meta_value),
    (5, meta_raw),
    (3, meta_entry),
    (5, meta_add),
    (3, meta_key),
    (3, header_counts),
];

fn mutate_gguf(rng: &mut Rng, b: &mut Vec<u8>) -> String {
    let layout = parse_gguf(b);
    for _ in 0..16 {
        let mutate = rng.weighted(GGUF_MUTATORS);
        if let Some(description) = mutate(rng, b, &layout) {
            return description;
        }
    }
    let byte = rng.next_u64() as u8;
    b.push(byte);
    format!("append byte {byte:#04x}")
}

/// A byte position, 4 times in 5 inside the header.
fn position(rng: &mut Rng, b: &[u8], l: &GgufLayout) -> Option<usize> {
    if b.is_empty() {
        return None;
    }
    let header = l.header_len(b.len());
    Some(if header > 0 && rng.chance(80) { rng.below(header) } else { rng.below(b.len()) })
}

fn bit_flip(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let at = position(rng, b, l)?;
    let bit = rng.below(8);
    b[at] ^= 1 << bit;
    Some(format!("flip bit {bit} of byte {at}"))
}

fn set_byte(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let at = position(rng, b, l)?;
    let v = if rng.chance(50) { *rng.pick(INTERESTING_BYTES) } else { rng.next_u64() as u8 };
    b[at] = v;
    Some(format!("byte {at} = {v:#04x}"))
}

fn set_int(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let width = *rng.pick(&[1usize, 2, 4, 8]);
    let mut at = position(rng, b, l)?;
    match rng.below(3) {
        0 => at &= !7,
        1 => at &= !3,
        _ => {}
    }
    let orig = read_le(b, at, width)?;
    let v = interesting(rng, orig);
    write_le(b, at, width, v);
    Some(format!("{width}-byte int at {at}: {} -> {}", show(orig), show(read_le(b, at, width)?)))
}

fn truncate(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    if b.is_empty() {
        return None;
    }
    let n = if rng.chance(60) { rng.below(l.header_len(b.len()) + 1) } else { rng.below(b.len()) };
    b.truncate(n);
    Some(format!("truncate to {n} bytes"))
}

/// A range of 1 to 8 (or 64) bytes inside the header.
fn header_range(rng: &mut Rng, b: &[u8], l: &GgufLayout) -> Option<Range<usize>> {
    let header = l.header_len(b.len());
    if header < 2 {
        return None;
    }
    let start = rng.below(header);
    let max = if rng.chance(50) { 8 } else { 64 };
    let len = 1 + rng.below(max);
    Some(start..(start + len).min(header))
}

fn delete_range(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let r = header_range(rng, b, l)?;
    b.drain(r.clone());
    Some(format!("delete bytes {}..{}", r.start, r.end))
}

fn duplicate_range(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let r = header_range(rng, b, l)?;
    let at = if rng.chance(50) { r.end } else { rng.below(l.header_len(b.len()) + 1) };
    let chunk = b[r.clone()].to_vec();
    b.splice(at..at, chunk);
    Some(format!("copy bytes {}..{} to {at}", r.start, r.end))
}

fn swap_words(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let header = l.header_len(b.len());
    if header < 24 {
        return None;
    }
    let (x, y) = (rng.below(header - 7), rng.below(header - 7));
    if x.abs_diff(y) < 8 {
        return None;
    }
    for i in 0..8 {
        b.swap(x + i, y + i);
    }
    Some(format!("swap the 8 bytes at {x} and {y}"))
}

fn data_words(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let start = l.data_start();
    if !l.complete || start + 4 > b.len() {
        return None;
    }
    let at = (start + rng.below(b.len() - start - 3)) & !1;
    let v = *rng.pick(SPECIAL_WORDS);
    write_le(b, at, 4, u64::from(v)).then(|| format!("data word at {at} = {v:#010x}"))
}

fn pick_tensor<'a>(rng: &mut Rng, l: &'a GgufLayout) -> Option<&'a TensorEntry> {
    rng.choose(&l.tensors)
}

fn tensor_dim(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let t = pick_tensor(rng, l)?;
    if t.dims.is_empty() {
        return None;
    }
    let d = rng.below(t.dims.len());
    let orig = t.dims[d];
    let others = t.dims.iter().enumerate().filter(|&(i, _)| i != d).fold(1u64, |p, (_, &x)| p.wrapping_mul(x));
    let v = if rng.chance(40) {
        // make the product of the dimensions wrap round 2^64 back to the old element count
        if others > 1 && others.is_power_of_two() {
            orig.wrapping_add((u64::MAX / others) + 1)
        } else {
            orig.wrapping_add(1 << 63)
        }
    } else {
        interesting(rng, orig)
    };
    write_le(b, t.dim_at(d), 8, v).then(|| format!("tensor {} dim {d}: {orig} -> {}", t.name, show(v)))
}

fn tensor_reshape(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let t = pick_tensor(rng, l)?;
    if t.dims.len() < 2 {
        return None;
    }
    let mut dims = t.dims.clone();
    let (i, j) = (rng.below(dims.len()), rng.below(dims.len()));
    if i == j {
        return None;
    }
    if rng.chance(50) {
        dims.swap(i, j);
    } else if dims[j] % 2 == 0 {
        // the same element count, another shape
        dims[i] = dims[i].wrapping_mul(2);
        dims[j] /= 2;
    } else {
        return None;
    }
    for (k, &d) in dims.iter().enumerate() {
        write_le(b, t.dim_at(k), 8, d);
    }
    Some(format!("tensor {} dims {:?} -> {dims:?}", t.name, t.dims))
}

fn tensor_n_dims(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let t = pick_tensor(rng, l)?;
    let n = t.dims.len() as u64;
    let v = *rng.pick(&[0, 1, 2, 3, 4, 5, 8, 255, u64::from(u32::MAX), n + 1, n.saturating_sub(1)]);
    write_le(b, t.ndims_at, 4, v).then(|| format!("tensor {} n_dims field: {n} -> {v}", t.name))
}

/// Adds a dimension of 1 or merges two: the element count and the layout stay valid.
fn tensor_n_dims_consistent(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let t = pick_tensor(rng, l)?;
    let mut dims = t.dims.clone();
    if dims.len() < 2 || rng.chance(50) {
        dims.insert(rng.below(dims.len() + 1), 1);
    } else {
        let i = rng.below(dims.len() - 1);
        let merged = dims[i].wrapping_mul(dims[i + 1]);
        dims.splice(i..i + 2, [merged]);
    }
    let mut enc = (dims.len() as u32).to_le_bytes().to_vec();
    for d in &dims {
        enc.extend_from_slice(&d.to_le_bytes());
    }
    *b = splice_header(b, l, t.ndims_at..t.type_at(), &enc);
    Some(format!("tensor {} dims {:?} -> {dims:?}", t.name, t.dims))
}

fn tensor_type(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let t = pick_tensor(rng, l)?;
    let v: u32 = match rng.below(4) {
        // F16 <-> BF16: same size, so the table stays consistent
        0 if t.type_id == 1 || t.type_id == 30 => 31 - t.type_id,
        0 | 1 => *rng.pick(&[0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 30]),
        2 => *rng.pick(&[4, 5, 16, 19, 20, 24, 28, 29, 31, 39, 0x8000_0000, u32::MAX]),
        _ => t.type_id ^ (1 << rng.below(32)),
    };
    write_le(b, t.type_at(), 4, u64::from(v)).then(|| format!("tensor {} type {} -> {v}", t.name, t.type_id))
}

fn tensor_offset(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let t = pick_tensor(rng, l)?;
    let at = t.offset_at();
    let orig = read_le(b, at, 8)?;
    let v = match rng.below(4) {
        0 => orig ^ (1 << rng.below(64)),
        1 => {
            let a = l.alignment as u64;
            if rng.chance(50) {
                orig.wrapping_add(a)
            } else {
                orig.wrapping_sub(a)
            }
        }
        2 => {
            // swap with another tensor's offset: consistent when both have the same size
            let other = rng.pick(&l.tensors);
            let theirs = read_le(b, other.offset_at(), 8)?;
            write_le(b, other.offset_at(), 8, orig);
            write_le(b, at, 8, theirs);
            return Some(format!("swap the offsets of tensors {} and {}", t.name, other.name));
        }
        _ => interesting(rng, orig),
    };
    write_le(b, at, 8, v).then(|| format!("tensor {} offset {} -> {}", t.name, show(orig), show(v)))
}

/// llama.cpp's name of the Llama 3 RoPE factors tensor.
const ROPE_FREQS: &str = "rope_freqs.weight";

/// One of the Llama 3 RoPE factors (a float32 tensor) set to a special float: 0, a
/// negative, NaN, an infinity, the smallest subnormal or the largest float.
fn rope_factor(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let t = l.tensors.iter().find(|t| t.name == ROPE_FREQS && t.type_id == 0)?;
    if !l.complete {
        return None;
    }
    let offset = read_le(b, t.offset_at(), 8)? as usize;
    let n = t.dims.first().copied()? as usize;
    let at = l.data_start().checked_add(offset)?.checked_add(4 * rng.below(n.max(1)))?;
    let v = *rng.pick(&[0f32, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::from_bits(1), f32::MAX, -0.0]);
    write_le(b, at, 4, u64::from(v.to_bits())).then(|| format!("{ROPE_FREQS} value at byte {at} = {v}"))
}

/// A key or name with a twist: another entry's (a duplicate), one character changed, a
/// newline, empty, not UTF-8, or one of `wanted`.
fn twisted_name(rng: &mut Rng, name: &str, others: &[&str], wanted: &[&str]) -> Vec<u8> {
    let mut s = name.as_bytes().to_vec();
    match rng.below(7) {
        0 => return rng.pick(others).as_bytes().to_vec(),
        1 if !s.is_empty() => {
            let i = rng.below(s.len());
            s[i] = *rng.pick(b"abz.019_\n\0");
        }
        2 => s.push(b'\n'),
        3 => s.insert(rng.below(s.len() + 1), b'\n'),
        4 => s.clear(),
        5 => s.splice(0..0, [0xff, 0xfe]).for_each(drop),
        _ => return rng.pick(wanted).as_bytes().to_vec(),
    }
    s
}

fn tensor_name(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let t = pick_tensor(rng, l)?;
    let others: Vec<&str> = l.tensors.iter().map(|t| t.name.as_str()).collect();
    let wanted = ["output.weight", "token_embd.weight", "blk.1.attn_q.weight", "blk.2.ffn_up.weight", "blk.0.attn_k.weight"];
    let name = twisted_name(rng, &t.name, &others, &wanted);
    let mut enc = Vec::new();
    encode_str(&name, &mut enc);
    *b = splice_header(b, l, t.start..t.ndims_at, &enc);
    Some(format!("tensor {} renamed {:?}", t.name, String::from_utf8_lossy(&name)))
}

fn tensor_entry(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let t = pick_tensor(rng, l)?;
    let fix = rng.chance(85);
    let what = if rng.chance(50) {
        let entry = b[t.start..t.end].to_vec();
        let at = if rng.chance(50) { t.end } else { l.info_end };
        *b = splice_header(b, l, at..at, &entry);
        if fix {
            bump_count(b, TENSOR_COUNT_AT, 1);
        }
        "duplicated"
    } else {
        *b = splice_header(b, l, t.start..t.end, &[]);
        if fix {
            bump_count(b, TENSOR_COUNT_AT, -1);
        }
        "removed"
    };
    Some(format!("tensor info {} {what}{}", t.name, if fix { "" } else { " (count unchanged)" }))
}

const INT_KEYS: &[&str] = &[
    "llama.block_count",
    "llama.context_length",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.key_length",
    "llama.rope.dimension_count",
    "llama.vocab_size",
    "general.alignment",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
];
const FLOAT_KEYS: &[&str] = &["llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base"];
const STRING_KEYS: &[&str] = &["general.architecture", "llama.rope.scaling.type", "tokenizer.ggml.model"];

fn int_value(vtype: u32, v: u64) -> Value {
    match vtype {
        0 => Value::U8(v as u8),
        1 => Value::I8(v as i8),
        2 => Value::U16(v as u16),
        3 => Value::I16(v as i16),
        5 => Value::I32(v as i32),
        10 => Value::U64(v),
        11 => Value::I64(v as i64),
        _ => Value::U32(v as u32),
    }
}

fn gen_int(rng: &mut Rng, orig: u64, orig_type: Option<u32>) -> Value {
    if rng.chance(10) {
        return rng.pick(&[Value::I8(-1), Value::I32(-1), Value::I64(-1), Value::I64(i64::MIN), Value::I16(-2)]).clone();
    }
    let v = interesting(rng, orig);
    let vtype = match orig_type {
        Some(t) if fixed_size(t).is_some() && t != 6 && t != 7 && t != 12 && rng.chance(60) => t,
        _ => *rng.pick(&[0, 1, 2, 3, 4, 5, 10, 11]),
    };
    int_value(vtype, v)
}

fn gen_float(rng: &mut Rng) -> Value {
    let f = *rng.pick(&[
        0.0,
        -0.0,
        1.0,
        -1.0,
        1e-5,
        1e-45,
        1e-300,
        1e30,
        1e300,
        f64::MAX,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        10_000.0,
        500_000.0,
    ]);
    if rng.chance(50) {
        Value::F32(f as f32)
    } else {
        Value::F64(f)
    }
}

fn gen_string(rng: &mut Rng) -> Value {
    let s = *rng.pick(&["llama", "", "LLAMA", "llama\n", "llama\0", "mistral", "none", "linear", "yarn", "gpt2", "\u{fffd}", "\n"]);
    Value::String(if rng.chance(5) { "a".repeat(5000) } else { s.to_string() })
}

/// A value of an unexpected kind: bool, string, float, arrays (one nested too deep).
fn gen_confused(rng: &mut Rng) -> Value {
    let nested = Value::Array(vec![Value::Array(vec![Value::Array(vec![Value::U8(1)])])]);
    rng.pick(&[
        Value::Bool(true),
        Value::String("64".into()),
        Value::F32(64.0),
        Value::F64(2.0),
        Value::Array(vec![]),
        Value::Array(vec![Value::U32(64)]),
        Value::Array(vec![Value::String("x".into()); 3]),
        nested,
        Value::U64(u64::MAX),
    ])
    .clone()
}

/// A new value for metadata `key` whose integer value and type were `orig`.
fn gen_value_for(rng: &mut Rng, key: &str, orig: u64, orig_type: Option<u32>) -> Value {
    if rng.chance(12) {
        return gen_confused(rng);
    }
    if key == "general.alignment" && rng.chance(60) {
        return Value::U32(*rng.pick(&[0, 1, 2, 3, 8, 16, 32, 48, 64, 4096, 1 << 31, u32::MAX]));
    }
    if INT_KEYS.contains(&key) {
        gen_int(rng, orig, orig_type)
    } else if FLOAT_KEYS.contains(&key) {
        gen_float(rng)
    } else if STRING_KEYS.contains(&key) {
        gen_string(rng)
    } else {
        match orig_type {
            Some(6 | 12) => gen_float(rng),
            Some(8) => gen_string(rng),
            Some(t) if fixed_size(t).is_some() => gen_int(rng, orig, orig_type),
            _ => gen_confused(rng),
        }
    }
}

/// A metadata entry, 7 times in 10 one of the keys the loader reads.
fn pick_kv<'a>(rng: &mut Rng, l: &'a GgufLayout) -> Option<&'a KvEntry> {
    let known: Vec<&KvEntry> = l
        .kvs
        .iter()
        .filter(|kv| INT_KEYS.contains(&kv.key.as_str()) || FLOAT_KEYS.contains(&kv.key.as_str()) || STRING_KEYS.contains(&kv.key.as_str()))
        .collect();
    if !known.is_empty() && rng.chance(70) {
        Some(*rng.pick(&known))
    } else {
        rng.choose(&l.kvs)
    }
}

fn meta_value(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let kv = pick_kv(rng, l)?;
    let orig = fixed_size(kv.vtype).and_then(|n| read_le(b, kv.type_at + 4, n as usize)).unwrap_or(0);
    let v = gen_value_for(rng, &kv.key, orig, Some(kv.vtype));
    *b = splice_header(b, l, kv.type_at..kv.end, &encode_typed(&v));
    Some(format!("metadata {} = {}", kv.key, clip(&format!("{v:?}"), 60)))
}

fn meta_raw(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let kv = pick_kv(rng, l)?;
    let (at, width, what) = match rng.below(4) {
        0 => (kv.type_at, 4, "type id"),
        1 => (kv.start, 8, "key length"),
        _ if kv.vtype == 8 => (kv.type_at + 4, 8, "string length"),
        2 if kv.vtype == 9 => (kv.type_at + 4, 4, "array item type"),
        _ if kv.vtype == 9 => (kv.type_at + 8, 8, "array length"),
        _ => (kv.type_at, 4, "type id"),
    };
    let orig = read_le(b, at, width)?;
    let v = if width == 4 { *rng.pick(&[0, 4, 6, 7, 8, 9, 10, 12, 13, 255, u64::from(u32::MAX), orig ^ 1]) } else { interesting(rng, orig) };
    write_le(b, at, width, v).then(|| format!("metadata {} {what}: {} -> {}", kv.key, show(orig), show(v)))
}

fn meta_entry(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let kv = pick_kv(rng, l)?;
    let fix = rng.chance(85);
    let what = if rng.chance(50) {
        let entry = b[kv.start..kv.end].to_vec();
        let at = if rng.chance(50) { kv.end } else { l.kvs.last().map_or(kv.end, |k| k.end) };
        *b = splice_header(b, l, at..at, &entry);
        if fix {
            bump_count(b, KV_COUNT_AT, 1);
        }
        "duplicated"
    } else {
        *b = splice_header(b, l, kv.start..kv.end, &[]);
        if fix {
            bump_count(b, KV_COUNT_AT, -1);
        }
        "removed"
    };
    Some(format!("metadata {} {what}{}", kv.key, if fix { "" } else { " (count unchanged)" }))
}

fn meta_add(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    if b.len() < HEADER_FIXED {
        return None;
    }
    let key = match rng.below(5) {
        0 => "general.alignment",
        1 => *rng.pick(FLOAT_KEYS),
        2 => *rng.pick(STRING_KEYS),
        3 => *rng.pick(&["key\nwith a newline", "llama.expert_count", "", "llama.rope.scaling.factor"]),
        _ => *rng.pick(INT_KEYS),
    };
    let v = gen_value_for(rng, key, 32, None);
    let i = rng.below(l.kvs.len() + 1);
    let at = l.kvs.get(i).map_or_else(|| l.kvs.last().map_or(HEADER_FIXED, |k| k.end), |k| k.start);
    let mut entry = Vec::new();
    encode_str(key.as_bytes(), &mut entry);
    entry.extend_from_slice(&encode_typed(&v));
    *b = splice_header(b, l, at..at, &entry);
    bump_count(b, KV_COUNT_AT, 1);
    Some(format!("metadata {key:?} added = {}", clip(&format!("{v:?}"), 60)))
}

fn meta_key(rng: &mut Rng, b: &mut Vec<u8>, l: &GgufLayout) -> Option<String> {
    let kv = pick_kv(rng, l)?;
    let others: Vec<&str> = l.kvs.iter().map(|k| k.key.as_str()).collect();
    let key = twisted_name(rng, &kv.key, &others, &["general.alignment", "llama.block_count", "general.architecture"]);
    let mut enc = Vec::new();
    encode_str(&key, &mut enc);
    *b = splice_header(b, l, kv.start..kv.type_at, &enc);
    Some(format!("metadata {} renamed {:?}", kv.key, String::from_utf8_lossy(&key)))
}

fn header_counts(rng: &mut Rng, b: &mut Vec<u8>, _l: &GgufLayout) -> Option<String> {
    let (at, width, what) = *rng.pick(&[(TENSOR_COUNT_AT, 8, "tensor count"), (KV_COUNT_AT, 8, "metadata count"), (4, 4, "version")]);
    let orig = read_le(b, at, width)?;
    let v = if width == 4 { *rng.pick(&[0, 1, 2, 3, 4, 2 << 24, 3 << 24, u64::from(u32::MAX)]) } else { interesting(rng, orig) };
    write_le(b, at, width, v).then(|| format!("{what} {} -> {}", show(orig), show(v)))
}

// ------------------------------------------------------------------------------------
// Safetensors files
// ------------------------------------------------------------------------------------

/// A safetensors file: its JSON header and its data.
struct St {
    header: Map<String, Json>,
    data: Vec<u8>,
}

fn st_parse(bytes: &[u8]) -> Option<St> {
    let n = usize::try_from(read_le(bytes, 0, 8)?).ok()?;
    let header = bytes.get(8..8usize.checked_add(n)?)?;
    match serde_json::from_slice(header).ok()? {
        Json::Object(header) => Some(St { header, data: bytes[8 + n..].to_vec() }),
        _ => None,
    }
}

fn st_build(st: &St) -> Vec<u8> {
    let mut header = serde_json::to_vec(&st.header).unwrap_or_default();
    header.resize(align_up(header.len(), 8), b' ');
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&st.data);
    out
}

fn st_names(st: &St) -> Vec<String> {
    st.header.keys().filter(|k| *k != "__metadata__").cloned().collect()
}

/// A tensor of a parsed file: (name, dtype, shape, bytes).
type StTensor = (String, Json, Json, Vec<u8>);

/// The tensors of a well-formed file, in data order.
fn st_tensors(st: &St) -> Option<Vec<StTensor>> {
    let mut out = Vec::new();
    for name in st_names(st) {
        let info = st.header.get(&name)?;
        let offsets = info.get("data_offsets")?.as_array()?;
        let (s, e) = (usize::try_from(offsets.first()?.as_u64()?).ok()?, usize::try_from(offsets.get(1)?.as_u64()?).ok()?);
        out.push((s, (name, info.get("dtype")?.clone(), info.get("shape")?.clone(), st.data.get(s..e)?.to_vec())));
    }
    out.sort_by_key(|(s, _)| *s);
    Some(out.into_iter().map(|(_, t)| t).collect())
}

/// A well-formed file of `tensors`, in that order.
fn st_assemble(tensors: &[StTensor]) -> St {
    let mut st = St { header: Map::new(), data: Vec::new() };
    for (name, dtype, shape, bytes) in tensors {
        let start = st.data.len();
        st.data.extend_from_slice(bytes);
        st.header
            .insert(name.clone(), json!({"dtype": dtype, "shape": shape, "data_offsets": [start, st.data.len()]}));
    }
    st
}

/// Splits model.safetensors into `n` shards listed in model.safetensors.index.json.
fn shard(rng: &mut Rng, dir: &mut HfDir, n: usize) -> Option<String> {
    let tensors = st_tensors(&st_parse(dir.get("model.safetensors")?)?)?;
    let files: Vec<String> = (1..=n).map(|i| format!("model-{i:05}-of-{n:05}.safetensors")).collect();
    let mut parts: Vec<Vec<StTensor>> = vec![Vec::new(); n];
    let mut weight_map = Map::new();
    for (i, t) in tensors.into_iter().enumerate() {
        // every shard gets one tensor before the rest are spread at random
        let k = if i < n { i } else { rng.below(n) };
        weight_map.insert(t.0.clone(), json!(files[k]));
        parts[k].push(t);
    }
    dir.remove("model.safetensors");
    for (file, part) in files.iter().zip(&parts) {
        dir.insert(file.clone(), st_build(&st_assemble(part)));
    }
    let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    dir.insert(INDEX.into(), serde_json::to_vec_pretty(&index).unwrap_or_default());
    Some(format!("split into {n} shards with an index"))
}

const INDEX: &str = "model.safetensors.index.json";

// ------------------------------------------------------------------------------------
// Hugging Face directory mutations
// ------------------------------------------------------------------------------------

type HfMutator = fn(&mut Rng, &mut HfDir) -> Option<String>;

const HF_MUTATORS: &[(u32, HfMutator)] = &[
    // config.json
    (14, config_field),
    (4, config_remove),
    (5, config_rope_scaling),
    (3, config_raw),
    (1, config_whole),
    // safetensors header and data
    (5, st_header_len),
    (6, st_dtype),
    (6, st_shape),
    (5, st_offsets),
    (4, st_reshape),
    (3, st_drop_tensor),
    (3, st_rename),
    (2, st_add_tensor),
    (2, st_metadata),
    (6, st_raw),
    (3, st_truncate),
    (2, st_data),
    // files, shards and the index
    (2, files),
    (3, split),
    (4, index),
];

fn mutate_hf(rng: &mut Rng, dir: &mut HfDir) -> String {
    for _ in 0..16 {
        let mutate = rng.weighted(HF_MUTATORS);
        if let Some(description) = mutate(rng, dir) {
            return description;
        }
    }
    dir.insert("config.json".into(), b"{".to_vec());
    "config.json = \"{\"".into()
}

fn config_of(dir: &HfDir) -> Option<Map<String, Json>> {
    match serde_json::from_slice(dir.get("config.json")?).ok()? {
        Json::Object(m) => Some(m),
        _ => None,
    }
}

fn set_config(dir: &mut HfDir, config: Map<String, Json>) {
    dir.insert("config.json".into(), serde_json::to_vec_pretty(&Json::Object(config)).unwrap_or_default());
}

const CONFIG_FIELDS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "model_type",
    "rope_scaling",
    "torch_dtype",
];

/// A JSON replacement for `orig`: numbers of every size and kind, and other types.
fn json_interesting(rng: &mut Rng, orig: &Json) -> Json {
    let o = orig.as_u64();
    match rng.below(26) {
        0 => json!(0),
        1 => json!(1),
        2 => json!(2),
        3 => json!(3),
        4 => json!(-1),
        5 => json!(i64::MIN),
        6 => json!(1_000_000_000),
        7 => json!(1e9),
        8 => json!(1u64 << 31),
        9 => json!(1u64 << 32),
        10 => json!(1u64 << 58),
        11 => json!(1u64 << 63),
        12 => json!(u64::MAX),
        13 => json!(1.8446744073709552e19),
        14 => json!(1e30),
        15 => json!(1.5),
        16 => json!(-0.5),
        17 => json!("64"),
        18 => Json::Null,
        19 => json!(true),
        20 => json!([]),
        21 => json!({}),
        22 => json!(*rng.pick(&[1u64 << 24, (1 << 24) + 1, 16_777_215])),
        23 => json!(1e-300),
        _ => match o {
            Some(o) => json!(*rng.pick(&[o.wrapping_add(1), o.wrapping_sub(1), o.wrapping_mul(2), o / 2, o.wrapping_add(1 << 58)])),
            None => json!(-0.0),
        },
    }
}

fn config_field(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    let mut config = config_of(dir)?;
    let key = *rng.pick(CONFIG_FIELDS);
    let orig = config.get(key).cloned().unwrap_or(Json::Null);
    let v = match key {
        "model_type" if rng.chance(70) => json!(*rng.pick(&["llama", "mistral", "", "LLAMA", "llama\n"])),
        "tie_word_embeddings" if rng.chance(70) => json!(!orig.as_bool().unwrap_or(false)),
        "eos_token_id" if rng.chance(50) => {
            rng.pick(&[json!([2, 3]), json!([]), json!([-1]), json!([u64::MAX]), json!([[2]]), json!([2, "3"])]).clone()
        }
        "rms_norm_eps" | "rope_theta" if rng.chance(50) => json!(*rng.pick(&[0.0, -1e-5, 1e308, 1e-300, 5e-324, -1.0])),
        "rope_scaling" => gen_rope_scaling(rng),
        _ => json_interesting(rng, &orig),
    };
    let text = v.to_string();
    config.insert(key.into(), v);
    set_config(dir, config);
    Some(format!("config {key} = {}", clip(&text, 60)))
}

fn config_remove(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    let mut config = config_of(dir)?;
    let keys: Vec<String> = config.keys().cloned().collect();
    let key = rng.choose(&keys)?.clone();
    config.remove(&key);
    set_config(dir, config);
    Some(format!("config {key} removed"))
}

fn gen_rope_scaling(rng: &mut Rng) -> Json {
    if rng.chance(10) {
        return rng.pick(&[json!("llama3"), json!(5), json!([]), Json::Null]).clone();
    }
    let mut m = Map::new();
    let kind = *rng.pick(&["llama3", "llama3", "llama3", "default", "linear", "dynamic", "yarn", ""]);
    m.insert(if rng.chance(25) { "type" } else { "rope_type" }.into(), json!(kind));
    let fields: [(&str, &[f64]); 4] = [
        ("factor", &[8.0, 1.0, 0.0, -1.0, 1e30, 1e-30, 1e308, 32.0]),
        ("low_freq_factor", &[1.0, 0.0, -1.0, 4.0, 1e30]),
        ("high_freq_factor", &[4.0, 1.0, 0.5, 1e30, 0.0]),
        ("original_max_position_embeddings", &[8192.0, 0.0, 1.0, 4_294_967_296.0, -1.0, 1.5]),
    ];
    for (field, values) in fields {
        if rng.chance(85) {
            let v = *rng.pick(values);
            // integers where serde wants one
            let v = if v.fract() == 0.0 && v.abs() < 1e15 && rng.chance(70) { json!(v as i64) } else { json!(v) };
            m.insert(field.into(), v);
        }
    }
    Json::Object(m)
}

fn config_rope_scaling(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    let mut config = config_of(dir)?;
    let v = gen_rope_scaling(rng);
    let text = v.to_string();
    config.insert("rope_scaling".into(), v);
    set_config(dir, config);
    Some(format!("config rope_scaling = {}", clip(&text, 120)))
}

/// A byte-level edit of `bytes`: bit flip, byte, truncation or insertion, with positions
/// below `focus` 4 times in 5.
fn raw_edit(rng: &mut Rng, bytes: &mut Vec<u8>, focus: usize) -> Option<String> {
    if bytes.is_empty() {
        return None;
    }
    let at = if focus > 0 && rng.chance(80) { rng.below(focus.min(bytes.len())) } else { rng.below(bytes.len()) };
    Some(match rng.below(5) {
        0 | 1 => {
            let bit = rng.below(8);
            bytes[at] ^= 1 << bit;
            format!("flip bit {bit} of byte {at}")
        }
        2 => {
            let v = if rng.chance(50) { *rng.pick(INTERESTING_BYTES) } else { rng.next_u64() as u8 };
            bytes[at] = v;
            format!("byte {at} = {v:#04x}")
        }
        3 => {
            bytes.truncate(at);
            format!("truncate to {at} bytes")
        }
        _ => {
            let v = *rng.pick(INTERESTING_BYTES);
            bytes.insert(at, v);
            format!("insert byte {v:#04x} at {at}")
        }
    })
}

fn config_raw(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    let bytes = dir.get_mut("config.json")?;
    let len = bytes.len();
    raw_edit(rng, bytes, len).map(|d| format!("config.json: {d}"))
}

fn config_whole(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    let (text, what) = match rng.below(6) {
        0 => (b"[]".to_vec(), "[]"),
        1 => (b"null".to_vec(), "null"),
        2 => (b"\"llama\"".to_vec(), "a string"),
        3 => (b"{}".to_vec(), "{}"),
        4 => (vec![0xff, 0xfe, b'{', b'}'], "not UTF-8"),
        _ => ([&b"{\"a\":"[..], &"[".repeat(100_000).into_bytes()].concat(), "nested 100000 deep"),
    };
    dir.insert("config.json".into(), text);
    Some(format!("config.json = {what}"))
}

fn pick_st_file(rng: &mut Rng, dir: &HfDir) -> Option<String> {
    let files: Vec<&String> = dir.keys().filter(|k| k.ends_with(".safetensors")).collect();
    rng.choose(&files).map(|f| f.to_string())
}

/// Applies `f` to the header and data of one of the directory's safetensors files.
fn with_st(rng: &mut Rng, dir: &mut HfDir, f: impl FnOnce(&mut Rng, &mut St) -> Option<String>) -> Option<String> {
    let file = pick_st_file(rng, dir)?;
    let mut st = st_parse(dir.get(&file)?)?;
    let description = f(rng, &mut st)?;
    dir.insert(file.clone(), st_build(&st));
    Some(format!("{file}: {description}"))
}

/// The header entry of a random tensor.
fn pick_info<'a>(rng: &mut Rng, st: &'a mut St) -> Option<(String, &'a mut Map<String, Json>)> {
    let name = rng.choose(&st_names(st))?.clone();
    let info = st.header.get_mut(&name)?.as_object_mut()?;
    Some((name, info))
}

fn st_header_len(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    let file = pick_st_file(rng, dir)?;
    let bytes = dir.get_mut(&file)?;
    let orig = read_le(bytes, 0, 8)?;
    let len = bytes.len() as u64;
    let v = match rng.below(3) {
        0 => *rng.pick(&[orig + 1, orig.wrapping_sub(1), orig + 8, orig.wrapping_sub(8), len - 8, len, len + 1, 100_000_001]),
        _ => interesting(rng, orig),
    };
    write_le(bytes, 0, 8, v);
    Some(format!("{file}: header length {} -> {}", show(orig), show(v)))
}

fn st_dtype(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    with_st(rng, dir, |rng, st| {
        let (name, info) = pick_info(rng, st)?;
        let dtypes = [
            "F32", "F16", "BF16", "F64", "I32", "U32", "I64", "U64", "U8", "I8", "I16", "U16", "BOOL", "F8_E4M3", "F8_E5M2", "F4",
            "XX", "",
        ];
        let v = if rng.chance(90) { json!(*rng.pick(&dtypes)) } else { rng.pick(&[json!(5), Json::Null]).clone() };
        let text = v.to_string();
        info.insert("dtype".into(), v);
        Some(format!("tensor {name} dtype = {text}"))
    })
}

fn st_shape(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    with_st(rng, dir, |rng, st| {
        let (name, info) = pick_info(rng, st)?;
        let mut shape = info.get("shape")?.as_array()?.clone();
        match rng.below(6) {
            0 if !shape.is_empty() => {
                shape.remove(rng.below(shape.len()));
            }
            1 => shape.insert(0, json!(1)),
            2 => shape.clear(),
            3 => {
                let v = rng.pick(&[json!(64), json!("64"), Json::Null]).clone();
                info.insert("shape".into(), v.clone());
                return Some(format!("tensor {name} shape = {v}"));
            }
            _ if !shape.is_empty() => {
                let i = rng.below(shape.len());
                shape[i] = json_interesting(rng, &shape[i]);
            }
            _ => shape.push(json!(0)),
        }
        let text = Json::Array(shape.clone()).to_string();
        info.insert("shape".into(), Json::Array(shape));
        Some(format!("tensor {name} shape = {text}"))
    })
}

fn st_offsets(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    with_st(rng, dir, |rng, st| {
        let (name, info) = pick_info(rng, st)?;
        let mut offsets = info.get("data_offsets")?.as_array()?.clone();
        match rng.below(5) {
            0 => offsets.reverse(),
            1 => offsets = rng.pick(&[vec![], vec![json!(0)], vec![json!(0), json!(4), json!(8)], vec![json!(-1), json!(4)]]).clone(),
            _ if offsets.len() == 2 => {
                let i = rng.below(2);
                offsets[i] = match offsets[i].as_u64() {
                    Some(o) => json!(if rng.chance(50) {
                        *rng.pick(&[o.wrapping_add(1), o.wrapping_sub(1), o + 4, o.wrapping_sub(4)])
                    } else {
                        interesting(rng, o)
                    }),
                    None => json!(0),
                };
            }
            _ => return None,
        }
        let text = Json::Array(offsets.clone()).to_string();
        info.insert("data_offsets".into(), Json::Array(offsets));
        Some(format!("tensor {name} data_offsets = {text}"))
    })
}

/// Another shape with the same element count: the file stays valid.
fn st_reshape(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    with_st(rng, dir, |rng, st| {
        let (name, info) = pick_info(rng, st)?;
        let dims: Vec<u64> = info.get("shape")?.as_array()?.iter().map(Json::as_u64).collect::<Option<_>>()?;
        let new: Vec<u64> = match (dims.as_slice(), rng.below(4)) {
            ([a, b], 0) => vec![*b, *a],
            ([a, b], 1) => vec![a * b],
            ([a, b], 2) if b % 2 == 0 => vec![a * 2, b / 2],
            ([a], 0) if a % 2 == 0 => vec![a / 2, 2],
            _ => [&[1][..], &dims].concat(),
        };
        info.insert("shape".into(), json!(new));
        Some(format!("tensor {name} shape {dims:?} -> {new:?}"))
    })
}

/// Removes a tensor and its bytes: a valid file without it.
fn st_drop_tensor(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    with_st(rng, dir, |rng, st| {
        let mut tensors = st_tensors(st)?;
        if tensors.is_empty() {
            return None;
        }
        let (name, ..) = tensors.remove(rng.below(tensors.len()));
        *st = st_assemble(&tensors);
        Some(format!("tensor {name} dropped"))
    })
}

fn st_rename(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    with_st(rng, dir, |rng, st| {
        let names = st_names(st);
        if names.len() < 2 {
            return None;
        }
        let (a, b) = (rng.pick(&names).clone(), rng.pick(&names).clone());
        if rng.chance(40) && a != b {
            // two tensors trade names (and so places in the model)
            let (ia, ib) = (st.header.remove(&a)?, st.header.remove(&b)?);
            st.header.insert(a.clone(), ib);
            st.header.insert(b.clone(), ia);
            return Some(format!("tensors {a} and {b} trade names"));
        }
        let others: Vec<&str> = names.iter().map(String::as_str).collect();
        let wanted = ["lm_head.weight", "model.layers.9.mlp.up_proj.weight", "model.norm.weight", "__metadata__"];
        let new = String::from_utf8_lossy(&twisted_name(rng, &a, &others, &wanted)).into_owned();
        let info = st.header.remove(&a)?;
        st.header.insert(new.clone(), info);
        Some(format!("tensor {a} renamed {new:?}"))
    })
}

fn st_add_tensor(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    with_st(rng, dir, |rng, st| {
        let name = *rng.pick(&["extra.weight", "lm_head.weight", "model.layers.7.self_attn.q_proj.weight", "model.embed_tokens.weight", "a\nb"]);
        let end = st.data.len();
        let shape = rng.pick(&[json!([0]), json!([0, 1u64 << 62]), json!([1u64 << 63, 0])]).clone();
        let text = shape.to_string();
        st.header.insert(name.into(), json!({"dtype": "F32", "shape": shape, "data_offsets": [end, end]}));
        Some(format!("empty tensor {name:?} of shape {text} added"))
    })
}

fn st_metadata(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    with_st(rng, dir, |rng, st| {
        let v = rng
            .pick(&[json!({"format": "pt"}), json!({"format": 5}), json!([]), json!("x"), json!({"a": {"b": 1}}), Json::Null])
            .clone();
        let text = v.to_string();
        st.header.insert("__metadata__".into(), v);
        Some(format!("__metadata__ = {text}"))
    })
}

fn st_raw(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    let file = pick_st_file(rng, dir)?;
    let bytes = dir.get_mut(&file)?;
    let header = read_le(bytes, 0, 8).and_then(|n| usize::try_from(n).ok()).map_or(bytes.len(), |n| n.saturating_add(8));
    raw_edit(rng, bytes, header).map(|d| format!("{file}: {d}"))
}

fn st_truncate(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    let file = pick_st_file(rng, dir)?;
    let bytes = dir.get_mut(&file)?;
    let n = rng.below(bytes.len());
    bytes.truncate(n);
    Some(format!("{file}: truncate to {n} bytes"))
}

fn st_data(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    with_st(rng, dir, |rng, st| {
        if st.data.len() < 4 {
            return None;
        }
        let at = rng.below(st.data.len() / 4) * 4;
        let v = *rng.pick(SPECIAL_WORDS);
        write_le(&mut st.data, at, 4, u64::from(v));
        Some(format!("data word at {at} = {v:#010x}"))
    })
}

fn files(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    Some(match rng.below(5) {
        0 => {
            dir.remove("config.json");
            "config.json removed".into()
        }
        1 => {
            let file = pick_st_file(rng, dir)?;
            dir.remove(&file);
            format!("{file} removed")
        }
        2 => {
            let file = pick_st_file(rng, dir)?;
            dir.insert(file.clone(), Vec::new());
            format!("{file} emptied")
        }
        3 => {
            dir.insert("config.json".into(), Vec::new());
            "config.json emptied".into()
        }
        _ => {
            let weights = dir.remove("model.safetensors")?;
            dir.insert("config.json".into(), weights);
            "model.safetensors moved to config.json".into()
        }
    })
}

fn split(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    let n = 1 + rng.below(3);
    shard(rng, dir, n)
}

fn index(rng: &mut Rng, dir: &mut HfDir) -> Option<String> {
    let mut json: Json = serde_json::from_slice(dir.get(INDEX)?).ok()?;
    let description = match rng.below(6) {
        0 | 1 => {
            let map = json.get_mut("weight_map")?.as_object_mut()?;
            let names: Vec<String> = map.keys().cloned().collect();
            let name = rng.choose(&names)?.clone();
            let v = rng
                .pick(&[
                    json!("../current.gguf"),
                    json!("/etc/hostname"),
                    json!("sub/x.safetensors"),
                    json!(".hidden.safetensors"),
                    json!("missing.safetensors"),
                    json!("config.json"),
                    json!(INDEX),
                    json!(""),
                    json!(".."),
                    json!("a\\b.safetensors"),
                    json!(5),
                    Json::Null,
                ])
                .clone();
            let text = v.to_string();
            map.insert(name.clone(), v);
            format!("index: weight_map[{name}] = {text}")
        }
        2 => {
            let v = rng.pick(&[json!([]), Json::Null, json!("model.safetensors"), json!({})]).clone();
            let text = v.to_string();
            json.as_object_mut()?.insert("weight_map".into(), v);
            format!("index: weight_map = {text}")
        }
        3 => {
            // one tensor stored in two shards
            let shards: Vec<String> = dir.keys().filter(|k| k.ends_with(".safetensors")).cloned().collect();
            let (from, to) = (rng.choose(&shards)?.clone(), rng.choose(&shards)?.clone());
            if from == to {
                return None;
            }
            let tensor = rng.choose(&st_tensors(&st_parse(dir.get(&from)?)?)?)?.clone();
            let mut target = st_tensors(&st_parse(dir.get(&to)?)?)?;
            let name = tensor.0.clone();
            target.push(tensor);
            dir.insert(to.clone(), st_build(&st_assemble(&target)));
            return Some(format!("index: tensor {name} of {from} copied into {to}"));
        }
        _ => {
            let bytes = dir.get_mut(INDEX)?;
            let len = bytes.len();
            return raw_edit(rng, bytes, len).map(|d| format!("index: {d}"));
        }
    };
    dir.insert(INDEX.into(), serde_json::to_vec_pretty(&json).unwrap_or_default());
    Some(description)
}

// ------------------------------------------------------------------------------------
// Running one case
// ------------------------------------------------------------------------------------

/// The scratch files: the current input and its description.
struct Scratch {
    out: PathBuf,
    gguf: PathBuf,
    dir: PathBuf,
    status: PathBuf,
}

impl Scratch {
    fn new(out: &Path) -> Self {
        Self { out: out.to_path_buf(), gguf: out.join("current.gguf"), dir: out.join("current"), status: out.join("current.txt") }
    }

    /// Writes `input` where the loader will read it; returns that path.
    fn write(&self, input: &Input) -> std::io::Result<PathBuf> {
        match input {
            Input::Gguf(bytes) => {
                fs::write(&self.gguf, bytes)?;
                Ok(self.gguf.clone())
            }
            Input::Hf(files) => {
                match fs::remove_dir_all(&self.dir) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
                fs::create_dir_all(&self.dir)?;
                for (name, bytes) in files {
                    fs::write(self.dir.join(name), bytes)?;
                }
                Ok(self.dir.clone())
            }
        }
    }
}

/// What a case is, as written to `current.txt` before it runs (and read back by the
/// supervising parent if the worker dies).
struct CaseInfo {
    target: Target,
    n: u64,
    seed: u64,
    input: PathBuf,
    mutations: Vec<String>,
}

impl CaseInfo {
    fn save(&self, path: &Path) -> std::io::Result<()> {
        let text = format!(
            "target={}\ncase={}\nseed={}\ninput={}\nmutations={}\n",
            self.target.name(),
            self.n,
            self.seed,
            self.input.display(),
            self.mutations.join(" | ").replace('\n', "\\n")
        );
        fs::write(path, text)
    }

    fn load(path: &Path) -> Option<Self> {
        let text = fs::read_to_string(path).ok()?;
        let field = |key: &str| text.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix('=')).map(str::to_string);
        let target = match field("target")?.as_str() {
            "gguf" => Target::Gguf,
            "safetensors" => Target::Safetensors,
            _ => return None,
        };
        Some(Self {
            target,
            n: field("case")?.parse().ok()?,
            seed: field("seed")?.parse().ok()?,
            input: PathBuf::from(field("input")?),
            mutations: field("mutations")?.split(" | ").map(str::to_string).collect(),
        })
    }

    fn reproduce(&self) -> String {
        format!("cargo run --release --example fuzz -- --seed {} --target {} --only-case {}", self.seed, self.target.name(), self.n)
    }

    /// Copies the input to `crash-<seed>-<case>.gguf` (or the directory `crash-<seed>-<case>/`).
    fn keep(&self, out: &Path) -> std::io::Result<PathBuf> {
        let name = format!("crash-{}-{}", self.seed, self.n);
        if self.input.is_dir() {
            let dest = out.join(name);
            fs::create_dir_all(&dest)?;
            for entry in fs::read_dir(&self.input)? {
                let entry = entry?;
                fs::copy(entry.path(), dest.join(entry.file_name()))?;
            }
            Ok(dest)
        } else {
            let dest = out.join(format!("{name}.gguf"));
            fs::copy(&self.input, &dest)?;
            Ok(dest)
        }
    }
}

/// Builds case `n` of `target`: a seed and 1 to 4 mutations of it, and the float dtype to
/// load it in.
fn make_case(seed: u64, target: Target, n: u64, seeds: &[Seed]) -> (Input, Vec<String>, DType) {
    let mut rng = Rng::for_case(seed, target, n);
    let weights: Vec<(u32, usize)> = seeds.iter().enumerate().map(|(i, s)| (s.weight, i)).collect();
    let base = &seeds[*rng.weighted(&weights)];
    let mut input = base.input.clone();
    // as a Python user names it; one this build cannot compute on the CPU (bfloat16, and
    // float16 on macOS) is refused there, so float32 stands in
    let name = *rng.weighted(&[(8, "float32"), (1, "float16"), (1, "bfloat16")]);
    let dtype = kvcandle::device::parse_dtype(name, &Device::Cpu).unwrap_or(DType::F32);
    let mut mutations = vec![format!("seed {}", base.name), format!("dtype {dtype:?}")];
    let count = *rng.weighted(&[(45, 1), (30, 2), (15, 3), (10, 4)]);
    for _ in 0..count {
        mutations.push(match &mut input {
            Input::Gguf(bytes) => mutate_gguf(&mut rng, bytes),
            Input::Hf(dir) => mutate_hf(&mut rng, dir),
        });
    }
    (input, mutations, dtype)
}

enum Outcome {
    Ran,
    Failed { stage: &'static str, error: Error },
}

/// Loads `path` and, when that works, builds the model and runs it on [0, 1, 2] then [3].
/// `Err` is a broken contract (a crash), not a failure to load.
fn exercise(path: &Path, dtype: DType, quantized: bool) -> Result<Outcome, String> {
    let progress_ok = AtomicBool::new(true);
    let progress = |done: usize, total: usize| {
        if done == 0 || done > total {
            progress_ok.store(false, Ordering::Relaxed);
        }
    };
    let weights = match loader::load_with_progress(path, dtype, &Device::Cpu, quantized, &progress) {
        Ok(w) => w,
        Err(error) => return Ok(Outcome::Failed { stage: "load", error }),
    };
    if !progress_ok.load(Ordering::Relaxed) {
        return Err("the progress callback was called with done = 0 or done > total".into());
    }
    if let Some(b) = weights.qtensors.values().find(|b| path.is_dir() && !matches!(b.dtype, GgmlDType::F16 | GgmlDType::BF16)) {
        return Err(format!("quantized=true kept a {:?} matrix of a Hugging Face directory (only 16-bit floats are kept)", b.dtype));
    }
    let model = match Llama::new(&weights) {
        Ok(m) => m,
        Err(error) => return Ok(Outcome::Failed { stage: "new", error }),
    };
    let vocab = model.config().vocab_size;
    let mut cache = model.new_cache();
    for (ids, all_logits, shape) in [(&[0i64, 1, 2][..], true, vec![3, vocab]), (&[3][..], false, vec![vocab])] {
        let before = cache.len();
        match model.forward(ids, &mut cache, all_logits) {
            Ok(logits) if logits.dims() != shape.as_slice() || logits.dtype() != DType::F32 => {
                return Err(format!(
                    "forward({ids:?}, all_logits={all_logits}) returned {:?} logits of shape {:?}, expected F32 {shape:?}",
                    logits.dtype(),
                    logits.dims()
                ))
            }
            Ok(_) if cache.len() != before + ids.len() => {
                return Err(format!("forward({ids:?}) left the cache at length {}, expected {}", cache.len(), before + ids.len()))
            }
            Ok(_) => {}
            Err(_) if cache.len() != before => {
                return Err(format!("a failed forward({ids:?}) changed the cache length from {before} to {}", cache.len()))
            }
            Err(error) => return Ok(Outcome::Failed { stage: "forward", error }),
        }
    }
    Ok(Outcome::Ran)
}

/// Why an error message is not acceptable, if it is not.
fn bad_message(msg: &str) -> Option<&'static str> {
    if msg.contains('\n') {
        Some("spans more than one line")
    } else if msg.to_lowercase().contains("backtrace") {
        Some("carries a backtrace")
    } else {
        None
    }
}

fn error_kind(e: &Error) -> &'static str {
    match e {
        Error::NotFound { .. } => "NotFound",
        Error::Load { .. } => "Load",
        Error::Device(_) => "Device",
        Error::DType(_) => "DType",
        Error::Position { .. } => "Position",
        Error::TokenId { .. } => "TokenId",
        Error::Input(_) => "Input",
        Error::Cache(_) => "Cache",
        Error::CacheFile { .. } => "CacheFile",
        Error::Engine(_) => "Engine",
        Error::Sequence { inner, .. } => error_kind(inner),
    }
}

/// The group an error is counted in: stage, kind and the start of its message, without
/// the scratch path, names of tensors and keys (`blk.0.attn_q.weight`) or numbers.
fn group_key(stage: &str, e: &Error, scratch: &str) -> String {
    let mut msg = match e {
        Error::Load { reason, .. } => reason.clone(),
        other => other.to_string(),
    };
    msg = msg.replace(scratch, "…");
    // candle repeats the file's path inside its own message
    while let Some(start) = msg.find("path: \"") {
        let end = msg[start + 7..].find('"').map_or(msg.len(), |e| (start + 9 + e).min(msg.len()));
        msg.replace_range(start..end, "");
    }
    for (long, short) in [("not a valid GGUF file: ", "GGUF: "), ("not a readable safetensors file: ", "safetensors: ")] {
        msg = msg.replace(long, short);
    }
    let mut key = String::new();
    let mut word = String::new();
    let flush = |word: &mut String, key: &mut String| {
        if word.contains('.') && word.chars().any(|c| c.is_ascii_alphabetic()) {
            key.push_str("<name>");
        } else {
            let mut in_number = false;
            for c in word.chars() {
                if !(c.is_ascii_digit() && in_number) {
                    key.push(if c.is_ascii_digit() { '#' } else { c });
                }
                in_number = c.is_ascii_digit();
            }
        }
        word.clear();
    };
    for c in msg.chars() {
        if c.is_ascii_alphanumeric() || c == '_' || c == '.' {
            word.push(c);
        } else {
            flush(&mut word, &mut key);
            key.push(c);
        }
    }
    flush(&mut word, &mut key);
    format!("{stage}/{}: {}", error_kind(e), clip(&key, 48))
}

// ------------------------------------------------------------------------------------
// Panics, memory
// ------------------------------------------------------------------------------------

/// Panics seen since the last [`take_panics`], as "location: message".
static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// A one-line report per panic (location and message), recorded so that a panic the
/// loader catches is noticed too.
fn install_panic_hook() {
    panic::set_hook(Box::new(|info| {
        let payload = info.payload();
        let msg = payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied());
        let location = info.location().map_or_else(|| "unknown location".into(), |l| format!("{}:{}:{}", l.file(), l.line(), l.column()));
        let line = format!("{location}: {}", msg.unwrap_or("(non-string payload)"));
        eprintln!("[fuzz] panic at {line}");
        PANICS.lock().unwrap_or_else(|e| e.into_inner()).push(line);
    }));
}

fn take_panics() -> Vec<String> {
    std::mem::take(&mut *PANICS.lock().unwrap_or_else(|e| e.into_inner()))
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(non-string payload)".into())
}

/// A field of /proc/self/status in KiB (VmRSS, VmHWM); None where there is no /proc.
fn proc_status_kib(field: &str) -> Option<u64> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?;
    line[field.len() + 1..].trim().trim_end_matches("kB").trim().parse().ok()
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

// ------------------------------------------------------------------------------------
// The worker: runs the cases
// ------------------------------------------------------------------------------------

struct Group {
    count: u64,
    example: String,
    first_case: u64,
}

#[derive(Default)]
struct Stats {
    cases: u64,
    loads: u64,
    loaded: u64,
    ran: u64,
    groups: HashMap<String, Group>,
    slowest: (Duration, u64),
    longest_message: (usize, u64),
    caught_panics: u64,
    /// Error messages holding control characters (other than newlines, which are crashes).
    control_chars: u64,
    control_chars_case: Option<u64>,
    /// Crashes seen with --keep-going, and their kinds (each reported once).
    crashes: u64,
    crash_kinds: HashSet<String>,
    elapsed: Duration,
}

impl Stats {
    fn count_error(&mut self, key: String, message: &str, case: u64) {
        let group = self.groups.entry(key).or_insert_with(|| Group { count: 0, example: clip(message, 200), first_case: case });
        group.count += 1;
    }

    fn print(&self, target: Target, groups_shown: usize) {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        println!(
            "== {}: {} cases in {:.1} s ({:.1} cases/s); {} loads: {} loaded, {} ran forward",
            target.name(),
            self.cases,
            secs,
            self.cases as f64 / secs,
            self.loads,
            self.loaded,
            self.ran
        );
        println!(
            "   slowest case #{} ({:.1} ms); longest error message {} chars (case #{}); {} caught panics counted as errors",
            self.slowest.1,
            self.slowest.0.as_secs_f64() * 1e3,
            self.longest_message.0,
            self.longest_message.1,
            self.caught_panics,
        );
        if self.crashes > 0 {
            println!(
                "   {} crashing cases of {} kinds ({} reported)",
                self.crashes,
                self.crash_kinds.len(),
                self.crash_kinds.len().min(MAX_CRASH_REPORTS)
            );
        }
        if let Some(case) = self.control_chars_case {
            println!("   warning: {} error messages hold control characters (the first in case #{case})", self.control_chars);
        }
        let mut groups: Vec<(&String, &Group)> = self.groups.iter().collect();
        groups.sort_by(|a, b| b.1.count.cmp(&a.1.count).then(a.0.cmp(b.0)));
        println!("   {} error groups; the most frequent:", groups.len());
        for (key, g) in groups.iter().take(groups_shown) {
            println!("   {:>7}  {key}", g.count);
            println!("            e.g. case #{}: {}", g.first_case, g.example);
        }
    }
}

/// A crash found by the worker.
struct Crash {
    info: CaseInfo,
    reason: String,
    /// What makes two crashes the same, for `--keep-going`: the reason without numbers
    /// and names, unless set more precisely.
    kind: Option<String>,
}

impl Crash {
    fn new(info: CaseInfo, reason: String) -> Self {
        Self { info, reason, kind: None }
    }

    fn kind(&self, scratch: &str) -> String {
        self.kind.clone().unwrap_or_else(|| clip(&self.reason.replace(scratch, "…").replace(|c: char| c.is_ascii_digit(), "#"), 90))
    }
}

/// With --keep-going, the kinds of crash reported per target; the rest are only counted.
const MAX_CRASH_REPORTS: usize = 10;

fn worker(opts: &Options) -> ExitCode {
    install_panic_hook();
    if let Err(e) = fs::create_dir_all(&opts.out) {
        eprintln!("fuzz: cannot create {}: {e}", opts.out.display());
        return ExitCode::from(2);
    }
    let scratch = Scratch::new(&opts.out);
    let _ = fs::write(&scratch.status, "setup\n");
    let targets: Vec<&str> = opts.targets.iter().map(|t| t.name()).collect();
    let limit = match (opts.time_limit(), opts.cases) {
        (_, _) if opts.only_case.is_some() => "one case".to_string(),
        (Some(t), Some(n)) => format!("{} s or {n} cases per target", t.as_secs_f64()),
        (Some(t), None) => format!("{} s per target", t.as_secs_f64()),
        (None, Some(n)) => format!("{n} cases per target"),
        (None, None) => unreachable!("time_limit() is Some without --cases"),
    };
    println!("kvcandle fuzz: targets {}; seed {}; {limit}; scratch and crashes in {}", targets.join(", "), opts.seed, opts.out.display());
    let mut again = format!("cargo run --release --example fuzz -- --seed {} --target {}", opts.seed, opts.target_arg);
    if let Some(s) = opts.seconds {
        again += &format!(" --seconds {s}");
    }
    if let Some(n) = opts.cases {
        again += &format!(" --cases {n}");
    }
    if let Some(n) = opts.only_case {
        again += &format!(" --only-case {n}");
    }
    println!("reproduce with: {again}");

    let (gguf_seeds, hf_seeds) = match build_seeds(&opts.out) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fuzz: cannot build the seed models: {e}");
            return ExitCode::from(2);
        }
    };
    for (target, seeds) in [(Target::Gguf, &gguf_seeds), (Target::Safetensors, &hf_seeds)] {
        if !opts.targets.contains(&target) {
            continue;
        }
        if let Err(e) = check_seeds(seeds, &scratch) {
            eprintln!("fuzz: a seed model does not load and run, so mutants of it would test nothing: {e}");
            return ExitCode::from(2);
        }
        let sizes: Vec<String> = seeds
            .iter()
            .map(|s| {
                let bytes: usize = match &s.input {
                    Input::Gguf(b) => b.len(),
                    Input::Hf(d) => d.values().map(Vec::len).sum(),
                };
                format!("{} ({:.1} KB)", s.name, bytes as f64 / 1e3)
            })
            .collect();
        println!("seeds for {}: {} (each loads and runs)", target.name(), sizes.join(", "));
    }
    let _ = take_panics();

    let mut crashes = 0;
    for &target in &opts.targets {
        let seeds = if target == Target::Gguf { &gguf_seeds } else { &hf_seeds };
        match run_target(opts, &scratch, target, seeds) {
            Ok(stats) => {
                stats.print(target, opts.groups);
                if let Some(hwm) = proc_status_kib("VmHWM") {
                    println!("   peak resident memory so far (VmHWM): {}", mib(hwm));
                }
                crashes += stats.crashes;
            }
            Err(crash) => {
                report_crash(&crash.info, &crash.reason, &opts.out);
                return ExitCode::from(1);
            }
        }
    }
    if crashes > 0 {
        println!("{crashes} crashing cases (the first of each kind reported above)");
        return ExitCode::from(1);
    }
    if opts.only_case.is_none() {
        println!("no crash");
    }
    ExitCode::SUCCESS
}

fn report_crash(info: &CaseInfo, reason: &str, out: &Path) {
    eprintln!("\nCRASH in target {}, case {} of seed {}: {reason}", info.target.name(), info.n, info.seed);
    eprintln!("  mutations: {}", info.mutations.join(" | "));
    match info.keep(out) {
        Ok(path) => eprintln!("  input saved to {}", path.display()),
        Err(e) => eprintln!("  cannot save the input {}: {e}", info.input.display()),
    }
    eprintln!("  replay: {}", info.reproduce());
}

fn run_target(opts: &Options, scratch: &Scratch, target: Target, seeds: &[Seed]) -> Result<Stats, Crash> {
    let mut stats = Stats::default();
    let start = Instant::now();
    let limit = opts.time_limit();
    let mut n = opts.only_case.unwrap_or(0);
    loop {
        if let Some(only) = opts.only_case {
            if n > only {
                break;
            }
        } else if opts.cases.is_some_and(|max| n >= max) || limit.is_some_and(|t| start.elapsed() >= t) {
            break;
        }
        match run_case(opts, scratch, target, seeds, n, &mut stats) {
            Ok(()) => {}
            Err(crash) if opts.keep_going => {
                stats.crashes += 1;
                let known = stats.crash_kinds.len();
                if stats.crash_kinds.insert(crash.kind(&scratch.out.display().to_string())) && known < MAX_CRASH_REPORTS {
                    report_crash(&crash.info, &crash.reason, &opts.out);
                }
            }
            Err(crash) => return Err(crash),
        }
        n += 1;
    }
    stats.elapsed = start.elapsed();
    Ok(stats)
}

/// Builds, writes and runs case `n`, counting its outcomes in `stats`.
fn run_case(opts: &Options, scratch: &Scratch, target: Target, seeds: &[Seed], n: u64, stats: &mut Stats) -> Result<(), Crash> {
    let verbose = opts.verbose || opts.only_case.is_some();
    let case_start = Instant::now();
    let made = panic::catch_unwind(|| make_case(opts.seed, target, n, seeds));
    let info = |mutations: Vec<String>| CaseInfo {
        target,
        n,
        seed: opts.seed,
        input: if target == Target::Gguf { scratch.gguf.clone() } else { scratch.dir.clone() },
        mutations,
    };
    let (input, mutations, dtype) = match made {
        Ok(m) => m,
        Err(payload) => {
            let _ = take_panics();
            let reason = format!("BUG IN THE FUZZER (building the case): {}", panic_message(&*payload));
            return Err(Crash::new(info(vec![]), reason));
        }
    };
    let info = info(mutations);
    let written = info.save(&scratch.status).and_then(|_| scratch.write(&input));
    if let Err(e) = written {
        return Err(Crash::new(info, format!("cannot write the input: {e}")));
    }
    if verbose {
        println!("case {n}: {}", info.mutations.join(" | "));
    }
    let modes: &[bool] = &[false, true];
    let mut outcomes = Vec::new();
    for &quantized in modes {
        let result = panic::catch_unwind(AssertUnwindSafe(|| exercise(&info.input, dtype, quantized)));
        let panics = take_panics();
        let outcome = match result {
            Err(payload) => return Err(Crash::new(info, format!("panic (quantized={quantized}): {}", panic_message(&*payload)))),
            Ok(Err(contract)) => return Err(Crash::new(info, format!("broken contract (quantized={quantized}): {contract}"))),
            Ok(Ok(outcome)) => outcome,
        };
        if let Some(first) = panics.first() {
            if !opts.allow_caught_panics {
                let reason = format!("panic inside kvcandle, caught and reported as an error (quantized={quantized}): {first}");
                return Err(Crash::new(info, reason));
            }
            stats.caught_panics += 1;
        }
        outcomes.push((quantized, outcome));
    }
    stats.cases += 1;
    let scratch_text = scratch.out.display().to_string();
    for (quantized, outcome) in outcomes {
        stats.loads += 1;
        match outcome {
            Outcome::Ran => {
                stats.loaded += 1;
                stats.ran += 1;
                if verbose {
                    println!("  quantized={quantized}: loaded and ran");
                }
            }
            Outcome::Failed { stage, error } => {
                if stage != "load" {
                    stats.loaded += 1;
                }
                let message = error.to_string();
                if verbose {
                    println!("  quantized={quantized}: {stage} failed: {message}");
                }
                if let Some(why) = bad_message(&message) {
                    let reason = format!("the error message {why} (quantized={quantized}, {stage}): {message:?}");
                    let kind = Some(format!("message {why}: {}", group_key(stage, &error, &scratch_text)));
                    return Err(Crash { info, reason, kind });
                }
                if message.chars().any(char::is_control) {
                    stats.control_chars += 1;
                    stats.control_chars_case.get_or_insert(n);
                }
                if message.len() > stats.longest_message.0 {
                    stats.longest_message = (message.len(), n);
                }
                stats.count_error(group_key(stage, &error, &scratch_text), &message.replace(&scratch_text, "…"), n);
            }
        }
    }
    let took = case_start.elapsed();
    if took > stats.slowest.0 {
        stats.slowest = (took, n);
    }
    let max_rss = opts.max_rss_mib * 1024;
    let (rss, hwm) = (proc_status_kib("VmRSS"), proc_status_kib("VmHWM"));
    if let Some(kib) = rss.filter(|&k| k > max_rss).or(hwm.filter(|&k| k > max_rss)) {
        let reason = format!("resident memory reached {} during or after the case (limit {} MiB)", mib(kib), opts.max_rss_mib);
        return Err(Crash::new(info, reason));
    }
    Ok(())
}

// ------------------------------------------------------------------------------------
// The supervisor: runs the worker and reports deaths and hangs
// ------------------------------------------------------------------------------------

#[cfg(unix)]
fn signal_of(status: &ExitStatus) -> Option<i32> {
    std::os::unix::process::ExitStatusExt::signal(status)
}

#[cfg(not(unix))]
fn signal_of(_: &ExitStatus) -> Option<i32> {
    None
}

fn supervise(opts: &Options, args: &[String]) -> ExitCode {
    if let Err(e) = fs::create_dir_all(&opts.out) {
        eprintln!("fuzz: cannot create {}: {e}", opts.out.display());
        return ExitCode::from(2);
    }
    let scratch = Scratch::new(&opts.out);
    let _ = fs::remove_file(&scratch.status);
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("fuzz: cannot find this program to run the worker: {e}");
            return ExitCode::from(2);
        }
    };
    // the worker gets the seed explicitly: one drawn from the clock must be the same
    let seed = opts.seed.to_string();
    let mut child = match Command::new(exe).args(args).args(["--worker", "--seed", &seed]).spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fuzz: cannot start the worker: {e}");
            return ExitCode::from(2);
        }
    };
    let hang = Duration::from_secs(opts.hang_seconds);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) => {}
            Err(e) => {
                eprintln!("fuzz: cannot wait for the worker: {e}");
                return ExitCode::from(2);
            }
        }
        let age = fs::metadata(&scratch.status).and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
        if age.is_some_and(|a| a > hang) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let why = match status {
        Some(s) if s.success() => return ExitCode::SUCCESS,
        // the worker reported its crash (1) or its setup problem (2) itself
        Some(s) if matches!(s.code(), Some(1 | 2)) => return ExitCode::from(s.code().unwrap_or(1) as u8),
        Some(s) => match signal_of(&s) {
            Some(6) => "the worker aborted (signal 6: SIGABRT, e.g. an allocation failure)".to_string(),
            Some(9) => "the worker was killed (signal 9: SIGKILL, e.g. the out-of-memory killer)".to_string(),
            Some(sig) => format!("the worker died of signal {sig}"),
            None => format!("the worker exited with {s}"),
        },
        None => format!("hang: no new case for {} s; the worker was killed", opts.hang_seconds),
    };
    match CaseInfo::load(&scratch.status) {
        Some(info) => report_crash(&info, &why, &opts.out),
        None => eprintln!("\nCRASH outside any case (during setup): {why}"),
    }
    ExitCode::from(1)
}
