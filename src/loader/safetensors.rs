//! Hugging Face directories: `config.json` plus `model.safetensors`, or shards listed
//! in `model.safetensors.index.json`.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::safetensors::{Load, MmapedSafetensors};
use candle_core::{DType, Device};
use candle_transformers::models::llama::{LlamaConfig, LlamaEosToks};

use safetensors::Dtype;

use super::{arena_for, expected_tensors, kept, Blocks, Progress, Weights};
use crate::config::ModelConfig;
use crate::error::{message, Error, Result};

pub(super) fn load_dir(dir: &Path, dtype: DType, device: &Device, quantized: bool, progress: Progress<'_>) -> Result<Weights> {
    let config = read_config(dir)?;
    let files = weight_files(dir)?;
    // Each shard's header is validated by the safetensors crate (offsets inside the
    // file, no overlap) when it is mapped; no tensor data is read until every name,
    // dtype and shape has been checked.
    let mut shards = Vec::with_capacity(files.len());
    let mut owner: HashMap<String, usize> = HashMap::new();
    for (index, file) in files.iter().enumerate() {
        // SAFETY: the mapping is read-only and lives while the tensors are copied out
        // of it; as with any mmap, the file must not be truncated meanwhile.
        let shard = unsafe { MmapedSafetensors::new(file) }
            .map_err(|e| Error::load(file, format!("not a readable safetensors file: {}", message(e))))?;
        for (name, _) in shard.tensors() {
            if let Some(first) = owner.insert(name.clone(), index) {
                return Err(Error::load(
                    dir,
                    format!("tensor {name} appears in both {} and {}", files[first].display(), file.display()),
                ));
            }
        }
        shards.push(shard);
    }
    let table = expected_tensors(&config, owner.len(), dir)?;
    let mut views = Vec::with_capacity(table.len());
    for spec in &table {
        let index = *owner.get(&spec.name).ok_or_else(|| Error::load(dir, format!("tensor {} is missing", spec.name)))?;
        let file = &files[index];
        let view = shards[index].get(&spec.name).map_err(|e| Error::load(file, message(e)))?;
        if view.shape() != spec.shape.as_slice() {
            return Err(Error::load(file, format!("tensor {} has shape {:?}, expected {:?}", spec.name, view.shape(), spec.shape)));
        }
        let stored = format!("{:?}", view.dtype());
        if !FLOAT_DTYPES.contains(&stored.as_str()) {
            return Err(Error::load(file, format!("tensor {} holds {stored} values; weights must be floats ({})", spec.name, FLOAT_DTYPES.join(", "))));
        }
        views.push((spec, file, view));
    }
    let arena = arena_for(&table, dtype, device, quantized, dir)?;
    let mut tensors = HashMap::with_capacity(table.len());
    let mut qtensors = HashMap::new();
    let total = views.len();
    for (done, (spec, file, view)) in views.into_iter().enumerate() {
        // with `quantized`, 16-bit matrices stay as stored (widened as they are multiplied)
        let half = match view.dtype() {
            Dtype::F16 => Some(GgmlDType::F16),
            Dtype::BF16 => Some(GgmlDType::BF16),
            _ => None,
        };
        if let (true, true, Some(half), [rows, cols]) = (quantized, spec.linear, half, view.shape()) {
            let blocks = Blocks { dtype: half, rows: *rows, cols: *cols, data: view.data().to_vec() };
            qtensors.insert(spec.name.clone(), Arc::new(blocks));
        } else {
            let t = view
                .load(&Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .and_then(|t| t.to_device(device))
                .and_then(|t| kept(t, &arena))
                .map_err(|e| Error::load(file, format!("tensor {}: {}", spec.name, message(e))))?;
            tensors.insert(spec.name.clone(), t);
        }
        progress(done + 1, total);
    }
    Ok(Weights { config, tensors, qtensors, source: dir.to_path_buf(), format: "safetensors", arena })
}

/// The safetensors dtypes weights may be stored in (as the safetensors crate names them).
const FLOAT_DTYPES: [&str; 4] = ["F16", "BF16", "F32", "F64"];

fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(Error::load(dir, "no model.safetensors and no model.safetensors.index.json"));
    }
    let text = std::fs::read_to_string(&index).map_err(|e| Error::load(&index, e))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::load(&index, format!("invalid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::load(&index, "no \"weight_map\" object"))?;
    let mut files = BTreeSet::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| Error::load(&index, format!("weight_map entry {name} is not a file name")))?;
        if file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(Error::load(&index, format!("weight_map entry {name} points outside the directory: {file:?}")));
        }
        files.insert(dir.join(file));
    }
    for f in &files {
        if !f.is_file() {
            return Err(Error::load(dir, format!("shard {} listed in the index is missing", f.display())));
        }
    }
    Ok(files.into_iter().collect())
}

/// Refuses what a Llama `config.json` can ask for that kvcandle's forward does not do, so
/// that such a model never loads and computes other numbers: biases on the attention's or
/// the MLP's products, and an activation other than SiLU (transformers' Llama honours
/// each of them).
fn refuse_unsupported(json: &serde_json::Value) -> std::result::Result<(), String> {
    for field in ["attention_bias", "mlp_bias"] {
        match json.get(field) {
            None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => {}
            Some(v) => return Err(format!("{field} {v} is not supported: kvcandle's Llama has no biases")),
        }
    }
    match json.get("hidden_act") {
        None | Some(serde_json::Value::Null) => Ok(()),
        Some(serde_json::Value::String(a)) if a == "silu" || a == "swish" => Ok(()),
        Some(v) => Err(format!("hidden_act {v} is not supported: kvcandle's Llama runs \"silu\"")),
    }
}

/// `json` with the numbers transformers' `LlamaConfig` takes when a `config.json` leaves
/// them out (candle's `LlamaConfig` requires them): `rms_norm_eps` 1e-6 and
/// `max_position_embeddings` 2,048.
fn with_transformers_defaults(mut json: serde_json::Value) -> serde_json::Value {
    if let Some(top) = json.as_object_mut() {
        for (field, default) in [("rms_norm_eps", serde_json::Value::from(1e-6)), ("max_position_embeddings", serde_json::Value::from(2048))] {
            if top.get(field).is_none_or(|v| v.is_null()) {
                top.insert(field.into(), default);
            }
        }
    }
    json
}

/// `json` with its rotary embedding's settings where candle's `LlamaConfig` reads them:
/// `rope_theta` at the top and a `rope_scaling` only for Llama 3's scaling (its
/// `rope_type` key, which older files call `type`). transformers 5 writes them as
/// `rope_parameters` (`rope_theta` and `rope_type` with the scaling's numbers beside
/// them), which is read the same way; a scaling of type `default` is no scaling. Any
/// other type (linear, dynamic, yarn, ...) is refused, naming where it was found, and so
/// are two places that disagree.
fn with_rope_as_candle_reads_it(mut json: serde_json::Value) -> std::result::Result<serde_json::Value, String> {
    use serde_json::Value;
    let Some(top) = json.as_object_mut() else { return Ok(json) };
    // (field, its scaling) of each place that has one
    let mut scalings: Vec<(&str, Value)> = Vec::new();
    if let Some(params) = top.remove("rope_parameters").filter(|v| !v.is_null()) {
        let Value::Object(params) = params else { return Err(format!("rope_parameters should be an object, got {params}")) };
        if let Some(theta) = params.get("rope_theta").filter(|v| !v.is_null()) {
            match top.get("rope_theta").filter(|v| !v.is_null()) {
                Some(t) if t.as_f64() != theta.as_f64() => return Err(format!("rope_theta {t} and rope_parameters' rope_theta {theta} differ")),
                _ => {
                    top.insert("rope_theta".into(), theta.clone());
                }
            }
        }
        let mut scaling = params;
        scaling.remove("rope_theta");
        scalings.push(("rope_parameters", Value::Object(scaling)));
    }
    if let Some(scaling) = top.remove("rope_scaling").filter(|v| !v.is_null()) {
        scalings.push(("rope_scaling", scaling));
    }
    let mut kept: Option<(&str, Value)> = None;
    for (field, scaling) in scalings {
        let kind = scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(|v| v.as_str());
        let scaling = match kind {
            // no scaling (transformers' "default" ignores any factor), nor is a place that
            // names no type and no factor (`rope_parameters` holding the theta alone)
            Some("default") => continue,
            None if scaling.as_object().is_some_and(|o| !o.contains_key("factor")) => continue,
            Some("llama3") => {
                let mut s = scaling.as_object().cloned().unwrap_or_default();
                s.remove("type");
                s.insert("rope_type".into(), Value::from("llama3"));
                Value::Object(s)
            }
            _ => return Err(format!("unsupported {field} {scaling}: kvcandle runs Llama 3's scaling (rope_type \"llama3\") or none")),
        };
        match &kept {
            Some((other, s)) if *s != scaling => return Err(format!("{other} {s} and {field} {scaling} differ")),
            _ => kept = Some((field, scaling)),
        }
    }
    if let Some((_, scaling)) = kept {
        top.insert("rope_scaling".into(), scaling);
    }
    Ok(json)
}

fn read_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::load(&path, e))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::load(&path, format!("invalid JSON: {e}")))?;
    if let Some(kind) = json.get("model_type").and_then(|v| v.as_str()) {
        if kind != "llama" {
            return Err(Error::load(&path, format!("unsupported model_type {kind:?}; kvcandle runs \"llama\"")));
        }
    }
    refuse_unsupported(&json).map_err(|e| Error::load(&path, e))?;
    let json = with_rope_as_candle_reads_it(with_transformers_defaults(json)).map_err(|e| Error::load(&path, e))?;
    let cfg: LlamaConfig =
        serde_json::from_value(json.clone()).map_err(|e| Error::load(&path, e))?;
    let head_dim = match json.get("head_dim").filter(|v| !v.is_null()) {
        Some(v) => v.as_u64().ok_or_else(|| Error::load(&path, format!("head_dim should be an integer, got {v}")))? as usize,
        None if cfg.num_attention_heads > 0 => cfg.hidden_size / cfg.num_attention_heads,
        None => 0,
    };
    let eos_token_ids = match &cfg.eos_token_id {
        None => vec![],
        Some(LlamaEosToks::Single(t)) => vec![*t],
        Some(LlamaEosToks::Multiple(ts)) => ts.clone(),
    };
    Ok(ModelConfig {
        vocab_size: cfg.vocab_size,
        hidden_size: cfg.hidden_size,
        intermediate_size: cfg.intermediate_size,
        num_hidden_layers: cfg.num_hidden_layers,
        num_attention_heads: cfg.num_attention_heads,
        num_key_value_heads: cfg.num_key_value_heads(),
        head_dim,
        rope_theta: cfg.rope_theta,
        rms_norm_eps: cfg.rms_norm_eps,
        max_position_embeddings: cfg.max_position_embeddings,
        tie_word_embeddings: cfg.tie_word_embeddings.unwrap_or(false),
        bos_token_id: cfg.bos_token_id,
        eos_token_ids,
        rope_scaling: cfg.rope_scaling,
        rope_freq_factors: None,
    })
}
