//! A cache saved to disk and loaded back: one safetensors file holding, for the positions
//! the cache holds (not its capacity), each layer's keys and values in the cache's dtype
//! (`layers.{i}.keys`, `layers.{i}.values`, shape (1, kv_heads, len, head_dim)) and the
//! token ids (`tokens`, u32); the metadata names the format, its version and the cache's
//! dtype, beside what the caller adds (the model's fingerprint).
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

use crate::cache::KvCache;
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
    meta.insert("dtype".into(), layout.dtype.as_str().into());
    let token_bytes: Vec<u8> = cache.tokens().iter().flat_map(|t| t.to_le_bytes()).collect();
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    if !cache.is_empty() {
        for layer in 0..layout.num_layers {
            tensors.push((key_name(layer), cache.layer_tensor(layer, false)?.to_device(&candle_core::Device::Cpu)?));
            tensors.push((value_name(layer), cache.layer_tensor(layer, true)?.to_device(&candle_core::Device::Cpu)?));
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
        other => return Err(Error::Cache(format!("a cache of dtype {} cannot be saved", other.as_str()))),
    })
}

fn st_dtype(d: candle_core::DType) -> Dtype {
    match d {
        candle_core::DType::F16 => Dtype::F16,
        candle_core::DType::BF16 => Dtype::BF16,
        _ => Dtype::F32,
    }
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
    let tmp = dir.join(format!(".{}.{}-{nanos}.tmp", name.to_string_lossy(), std::process::id()));
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
    Ok(())
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

    let mut cache = model.new_cache();
    let layout = cache.layout().clone();
    if get("dtype") != Some(layout.dtype.as_str()) {
        return Err(bad(format!("the cache's dtype is {:?}, the model's {}", get("dtype").unwrap_or("missing"), layout.dtype.as_str())));
    }
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
    let shape = [1, layout.kv_heads, n, layout.head_dim];
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

/// A metadata value quoted for a message, shortened when long.
fn show(v: &str) -> String {
    let s: String = v.chars().take(120).collect();
    format!("{:?}{}", crate::error::one_line(&s), if v.chars().count() > 120 { "..." } else { "" })
}
