//! A cache saved to disk and loaded back: one safetensors file holding, for the positions
//! the cache holds (not its capacity), each layer's keys and values as the cache stores
//! them (`layers.{i}.keys`, `layers.{i}.values`, shape (1, kv_heads, len, head_dim); an
//! 8-bit cache's as its blocks' bytes, u8 (1, kv_heads, len, row bytes)) and the
//! token ids (`tokens`, u32); the metadata names the format, its version and the cache's
//! dtype, beside what the caller adds (the model's fingerprint).
//!
//! The metadata also holds a checksum of every tensor's bytes, so a file damaged where
//! the keys and values are (which would still parse) is refused rather than loaded as
//! different numbers.
//!
//! A save writes a temporary file in the same directory, flushes it to disk and renames
//! it over the target, so an interrupted save leaves the earlier file as it was. A load
//! reads the file once (memory: the file's size, then the cache), checks every size in
//! the header against the file (the safetensors crate does) and every shape, dtype and id
//! against the model before anything is built.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use super::cache::KvCache;
use crate::error::{Error, Result};
use crate::model::Llama;

/// The metadata value `format` of every cache file.
pub const FORMAT: &str = "kvcandle.kvcache";
/// The layout version this build writes and reads.
pub const VERSION: &str = "1";

fn key_name(layer: usize) -> String {
    format!("layers.{layer}.keys")
}

fn value_name(layer: usize) -> String {
    format!("layers.{layer}.values")
}

const TOKENS: &str = "tokens";

/// Writes `cache` to `path` atomically; `metadata` is stored beside the format's own keys
/// (which win on a clash).
pub fn save(cache: &KvCache, path: &Path, metadata: &HashMap<String, String>) -> Result<()> {
    let layout = cache.layout();
    let mut meta = metadata.clone();
    meta.insert("format".into(), FORMAT.into());
    meta.insert("version".into(), VERSION.into());
    meta.insert("dtype".into(), file_dtype(layout.dtype).into());
    let token_bytes: Vec<u8> = cache.tokens().iter().flat_map(|t| t.to_le_bytes()).collect();
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    if !cache.is_empty() {
        for layer in 0..layout.num_layers {
            tensors.push((key_name(layer), cache.layer_stored(layer, false)?.to_device(&candle_core::Device::Cpu)?));
            tensors.push((value_name(layer), cache.layer_stored(layer, true)?.to_device(&candle_core::Device::Cpu)?));
        }
    }
    let mut views: Vec<(String, TensorView<'_>)> = Vec::with_capacity(tensors.len() + 1);
    let fail = |e: safetensors::SafeTensorError| Error::CacheFile { path: path.to_path_buf(), reason: e.to_string() };
    views.push((TOKENS.into(), TensorView::new(Dtype::U32, vec![cache.len()], &token_bytes).map_err(fail)?));
    let raw: Vec<(String, Vec<u8>, Vec<usize>, Dtype)> = tensors
        .iter()
        .map(|(name, t)| -> Result<_> { Ok((name.clone(), raw_bytes(t)?, t.dims().to_vec(), st_dtype(t.dtype()))) })
        .collect::<Result<_>>()?;
    for (name, bytes, shape, dtype) in &raw {
        views.push((name.clone(), TensorView::new(*dtype, shape.clone(), bytes).map_err(fail)?));
    }
    meta.insert("checksum".into(), checksum(views.iter().map(|(n, v)| (n.as_str(), v.data()))));
    let bytes = safetensors::tensor::serialize(views, Some(meta)).map_err(fail)?;
    write_atomically(path, &bytes)
}

/// The little-endian bytes of a contiguous CPU tensor.
fn raw_bytes(t: &Tensor) -> Result<Vec<u8>> {
    use candle_core::DType;
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => flat.to_vec1::<f32>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => flat.to_vec1::<half::f16>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => flat.to_vec1::<half::bf16>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::U8 => flat.to_vec1::<u8>()?,
        other => return Err(Error::Cache(format!("a cache of dtype {} cannot be saved", other.as_str()))),
    })
}

fn st_dtype(d: candle_core::DType) -> Dtype {
    match d {
        candle_core::DType::F16 => Dtype::F16,
        candle_core::DType::BF16 => Dtype::BF16,
        candle_core::DType::U8 => Dtype::U8,
        _ => Dtype::F32,
    }
}

/// The cache file's names of the storage dtypes (metadata `dtype`).
const FILE_DTYPES: [(candle_core::DType, &str); 4] =
    [(candle_core::DType::F32, "f32"), (candle_core::DType::F16, "f16"), (candle_core::DType::BF16, "bf16"), (super::cache::Q8_0, "q8_0")];

fn file_dtype(d: candle_core::DType) -> &'static str {
    FILE_DTYPES.iter().find(|(t, _)| *t == d).map_or("unknown", |(_, name)| name)
}

/// Writes `bytes` to a temporary file beside `path`, flushes it to disk and renames it
/// over `path` (then flushes the directory, where the platform allows).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let fail = |e: std::io::Error| Error::CacheFile { path: path.to_path_buf(), reason: e.to_string() };
    let name = path.file_name().ok_or_else(|| fail(std::io::Error::other("the path names no file")))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let name = name.to_string_lossy();
    let tmp = dir.join(format!(".{name}.{}-{nanos}{TEMPORARY}", std::process::id()));
    let written = (|| -> std::io::Result<()> {
        let mut f = File::options().write(true).create_new(true).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(fail(e));
    }
    // the rename itself reaches the disk when the directory does (not possible everywhere)
    if let Ok(d) = File::open(&dir) {
        let _ = d.sync_all();
    }
    remove_stale_temporaries(&dir, |target| target == name);
    Ok(())
}

/// How the temporary files of [`write_atomically`] end: `.NAME.PID-NANOS.tmp` (hidden,
/// beside the file NAME they become, with the writing process's id).
const TEMPORARY: &str = ".tmp";

/// Removes from `dir` the temporary files of [`write_atomically`] whose target name
/// `wanted` accepts and whose writing process no longer runs: what a save killed between
/// writing and renaming left (a file as large as the cache; nothing else ever removes
/// it). A temporary of a running process (this one included: another thread may be
/// writing it) is left alone, as is one whose process cannot be told (not Unix). Returns
/// how many were removed; a file that cannot be removed is left as it is.
pub fn remove_stale_temporaries(dir: &Path, wanted: impl Fn(&str) -> bool) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for entry in entries.flatten() {
        let file = entry.file_name();
        let Some((target, pid)) = file.to_str().and_then(temporary_of) else { continue };
        if wanted(target) && pid != std::process::id() && !process_runs(pid) && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// The target name and the writing process of a temporary file's name, if it is one.
fn temporary_of(file: &str) -> Option<(&str, u32)> {
    let (target, stamp) = file.strip_prefix('.')?.strip_suffix(TEMPORARY)?.rsplit_once('.')?;
    let (pid, nanos) = stamp.split_once('-')?;
    nanos.parse::<u128>().ok()?;
    Some((target, pid.parse().ok()?))
}

/// Whether process `pid` runs (or cannot be told not to: any answer but "no such
/// process" counts as running).
fn process_runs(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(pid) = i32::try_from(pid) else { return true };
        // SAFETY: signal 0 sends nothing; it only checks that the process exists
        if unsafe { libc::kill(pid, 0) } == 0 {
            return true;
        }
        std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Reads a cache file for `model`; returns the cache and the file's metadata. Every
/// `(key, value)` of `expected` must equal the file's metadata (the model's fingerprint),
/// else a [`Error::Cache`] naming each difference; anything malformed is an
/// [`Error::CacheFile`].
pub fn load(path: &Path, model: &Llama, expected: &HashMap<String, String>) -> Result<(KvCache, HashMap<String, String>)> {
    let bad = |reason: String| Error::CacheFile { path: path.to_path_buf(), reason };
    let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| bad(format!("not a safetensors file ({e})")))?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(format!("not a safetensors file ({e})")))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let get = |k: &str| meta.get(k).map(String::as_str);
    if get("format") != Some(FORMAT) {
        return Err(bad(format!("not a kvcandle cache file (metadata format is {:?}, expected {FORMAT:?})", get("format").unwrap_or("missing"))));
    }
    if get("version") != Some(VERSION) {
        return Err(bad(format!("cache file version {:?}; this kvcandle reads version {VERSION}", get("version").unwrap_or("missing"))));
    }
    let differences: Vec<String> = expected
        .iter()
        .collect::<BTreeMap<_, _>>()
        .into_iter()
        .filter(|(k, v)| get(k) != Some(v.as_str()))
        .map(|(k, v)| format!("{k}: the file has {}, this model {}", show(get(k).unwrap_or("nothing")), show(v)))
        .collect();
    if !differences.is_empty() {
        return Err(Error::Cache(format!("{} was saved from another model: {}", path.display(), differences.join("; "))));
    }

    let Some(&(dtype, _)) = FILE_DTYPES.iter().find(|(_, name)| get("dtype") == Some(*name)) else {
        let names: Vec<&str> = FILE_DTYPES.iter().map(|(_, name)| *name).collect();
        return Err(bad(format!("the cache's dtype {:?} is not one of {}", get("dtype").unwrap_or("missing"), names.join(", "))));
    };
    let mut cache = model.new_cache_with(dtype).map_err(|e| bad(e.to_string()))?;
    let layout = cache.layout().clone();
    let tokens = file.tensor(TOKENS).map_err(|_| bad("no tokens tensor".into()))?;
    if tokens.dtype() != Dtype::U32 || tokens.shape().len() != 1 {
        return Err(bad(format!("tokens is {:?} {:?}, expected a 1-D U32 tensor", tokens.dtype(), tokens.shape())));
    }
    let ids: Vec<u32> = tokens.data().chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let n = ids.len();
    let vocab = model.config().vocab_size;
    if let Some((index, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        return Err(bad(format!("token id {id} at index {index} is outside the model's vocabulary of {vocab}")));
    }
    if n > layout.max_len {
        return Err(bad(format!("{n} positions, more than the model's context length {}", layout.max_len)));
    }
    let layers = if n == 0 { 0 } else { layout.num_layers };
    let mut names: Vec<String> = (0..layers).flat_map(|l| [key_name(l), value_name(l)]).collect();
    names.push(TOKENS.into());
    let mut found: Vec<String> = file.names().into_iter().map(String::from).collect();
    names.sort();
    found.sort();
    if names != found {
        let extra: Vec<&String> = found.iter().filter(|f| !names.contains(f)).collect();
        let missing: Vec<&String> = names.iter().filter(|f| !found.contains(f)).collect();
        return Err(bad(format!("tensors do not match a {n}-position cache of {} layers: missing {missing:?}, unexpected {extra:?}", layout.num_layers)));
    }
    // every name, dtype and size is as expected: now whether the bytes are the saved ones
    let stored = file.tensors();
    if get("checksum") != Some(checksum(stored.iter().map(|(n, v)| (n.as_str(), v.data()))).as_str()) {
        return Err(bad("the checksum does not match the data: the file is damaged".into()));
    }
    let shape = [1, layout.kv_heads, n, layout.row_len()];
    let want = st_dtype(layout.dtype);
    let mut loaded = Vec::with_capacity(2 * layers);
    for name in (0..layers).flat_map(|l| [key_name(l), value_name(l)]) {
        let view = file.tensor(&name).map_err(|e| bad(format!("{name}: {e}")))?;
        if view.dtype() != want || view.shape() != shape {
            return Err(bad(format!("{name} is {:?} {:?}, expected {want:?} {shape:?}", view.dtype(), view.shape())));
        }
        loaded.push(Tensor::from_raw_buffer(view.data(), layout.dtype, &shape, &layout.device)?);
    }
    if n > 0 {
        cache.reserve(n)?;
        for (layer, kv) in loaded.chunks_exact(2).enumerate() {
            cache.write(layer, &kv[0], &kv[1])?;
        }
        cache.commit(&ids);
    }
    Ok((cache, meta))
}

/// A 64-bit checksum of named byte strings, independent of their order: each string is
/// hashed (four lanes of 8-byte words, multiply and rotate, then mixed with its length
/// and name) and the hashes are added. It detects damage, not tampering.
fn checksum<'a>(parts: impl Iterator<Item = (&'a str, &'a [u8])>) -> String {
    fn hash(bytes: &[u8], seed: u64) -> u64 {
        const K: [u64; 4] = [0x9E37_79B9_7F4A_7C15, 0xC2B2_AE3D_27D4_EB4F, 0x1656_67B1_9E37_79F9, 0x85EB_CA77_C2B2_AE63];
        let mut lanes = [seed, seed ^ K[0], seed ^ K[1], seed ^ K[2]];
        let words = bytes.chunks_exact(32);
        let tail = words.remainder();
        for block in words {
            for (l, w) in lanes.iter_mut().zip(block.chunks_exact(8)) {
                let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
                *l = (*l ^ w).wrapping_mul(K[3]).rotate_left(29);
            }
        }
        let mut h = bytes.len() as u64;
        for (i, l) in lanes.iter().enumerate() {
            h = (h ^ l.wrapping_mul(K[i])).rotate_left(31).wrapping_mul(K[(i + 1) % 4]);
        }
        for &b in tail {
            h = (h ^ b as u64).wrapping_mul(K[0]).rotate_left(23);
        }
        h ^= h >> 33;
        h = h.wrapping_mul(K[1]);
        h ^ (h >> 29)
    }
    let sum = parts.fold(0u64, |acc, (name, data)| acc.wrapping_add(hash(data, hash(name.as_bytes(), 0))));
    format!("{sum:016x}")
}

/// A metadata value quoted for a message, shortened when long.
fn show(v: &str) -> String {
    let s: String = v.chars().take(120).collect();
    format!("{:?}{}", crate::error::one_line(&s), if v.chars().count() > 120 { "..." } else { "" })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::loader::{tensor_table, Weights};
    use candle_core::Device;

    fn tiny() -> Llama {
        let config = ModelConfig {
            vocab_size: 50,
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 4,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 32,
            tie_word_embeddings: true,
            bos_token_id: None,
            eos_token_ids: vec![],
            rope_scaling: None,
            rope_freq_factors: None,
        };
        let tensors = tensor_table(&config)
            .into_iter()
            .map(|s| (s.name, Tensor::randn(0f32, 0.5, s.shape, &Device::Cpu).expect("random tensor")))
            .collect();
        let w = Weights {
            config,
            tensors,
            qtensors: HashMap::new(),
            source: PathBuf::from("tiny"),
            format: "safetensors",
            arena: None,
        };
        Llama::new(&w).expect("tiny model")
    }

    fn rng(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn round_trip_and_mutated_files_fail_cleanly() {
        let model = tiny();
        let mut cache = model.new_cache();
        model.forward(&[3, 1, 4, 1, 5, 9], &mut cache, false).expect("forward");
        let dir = std::env::temp_dir().join(format!("kvcandle-cache-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let good = dir.join("good");
        let expected: HashMap<String, String> = [("model.weights".to_string(), "abc".to_string())].into();
        save(&cache, &good, &expected).expect("save");
        let (back, meta) = load(&good, &model, &expected).expect("load");
        assert_eq!(back.tokens(), cache.tokens());
        assert_eq!(meta.get("format").map(String::as_str), Some(FORMAT));
        for layer in 0..2 {
            for values in [false, true] {
                let (a, b) = (cache.layer_tensor(layer, values).expect("a"), back.layer_tensor(layer, values).expect("b"));
                let (a, b) = (a.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("a"), b.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("b"));
                assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
            }
        }

        // every mutant loads or is refused with a cache error; none panics
        let bytes = std::fs::read(&good).expect("read");
        let header = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
        let bad = dir.join("bad");
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut refused = 0;
        for case in 0..3000 {
            let mut b = bytes.clone();
            match case % 4 {
                0 => b.truncate((rng(&mut state) as usize) % b.len()),
                1 => {
                    // a bit flip inside the header (sizes, offsets, names, metadata)
                    let at = 8 + (rng(&mut state) as usize) % header;
                    b[at] ^= 1 << (rng(&mut state) % 8);
                }
                2 => {
                    let v = [0u64, 1, header as u64 - 1, header as u64 + 1, u64::MAX, rng(&mut state)][case / 4 % 6];
                    b[..8].copy_from_slice(&v.to_le_bytes());
                }
                _ => {
                    let at = (rng(&mut state) as usize) % b.len();
                    b[at] = rng(&mut state) as u8;
                }
            }
            std::fs::write(&bad, &b).expect("write");
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load(&bad, &model, &expected))) {
                Ok(Ok((c, _))) => assert!(c.len() <= 32 && c.tokens().iter().all(|&t| t < 50)),
                Ok(Err(Error::CacheFile { .. } | Error::Cache(_))) => refused += 1,
                Ok(Err(e)) => panic!("case {case}: an untyped error {e}"),
                Err(_) => panic!("case {case}: load panicked"),
            }
        }
        // with the checksum, every mutant that still parses but changed a byte is refused
        assert!(refused > 2900, "only {refused} of 3000 mutants refused");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn temporary_names_are_read_back_and_nothing_else() {
        assert_eq!(temporary_of(".c.kvcache.42-1700000000000000000.tmp"), Some(("c.kvcache", 42)));
        assert_eq!(temporary_of(".a.b.c.7-0.tmp"), Some(("a.b.c", 7)));
        for name in ["c.kvcache.42-1.tmp", ".c.kvcache.42-1", ".c.kvcache.x-1.tmp", ".c.kvcache.42-x.tmp", ".c.kvcache.42.tmp", ".tmp", ".42-1.tmp"] {
            assert_eq!(temporary_of(name), None, "{name}");
        }
        // this process runs; a process that ended does not
        assert!(process_runs(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().expect("`true` runs");
        let pid = child.id();
        child.wait().expect("`true` ends");
        #[cfg(unix)]
        assert!(!process_runs(pid));
    }
}
