//! Loaders: a GGUF file or a Hugging Face directory becomes a [`Weights`]: the
//! architecture numbers plus every tensor under its Hugging Face name
//! (`model.layers.0.self_attn.q_proj.weight`, ...) in the requested dtype and device.

mod gguf;
mod safetensors;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// What a loader produces. Both engines are built from it and share its tensors.
pub struct Weights {
    pub config: ModelConfig,
    pub tensors: HashMap<String, Tensor>,
    /// Linear-layer matrices kept in their GGUF quantized blocks (`quantized` loads only),
    /// under the same names; such a matrix is not also in `tensors`, except the tied
    /// embedding table, which the lookup needs as floats.
    pub qtensors: HashMap<String, Arc<QTensor>>,
    /// GGUF metadata (tokenizer and general keys), empty for Hugging Face directories.
    pub metadata: HashMap<String, gguf_file::Value>,
    /// Where the weights came from.
    pub source: PathBuf,
    /// "gguf" or "safetensors".
    pub format: &'static str,
}

impl Weights {
    /// Shape of a tensor, float or quantized.
    fn dims_of(&self, name: &str) -> Result<Vec<usize>> {
        if let Some(t) = self.tensors.get(name) {
            return Ok(t.dims().to_vec());
        }
        match self.qtensors.get(name) {
            Some(q) => Ok(q.shape().dims().to_vec()),
            None => Err(Error::load(&self.source, format!("tensor {name} is missing"))),
        }
    }

    /// The float dtype and device of the weights (those of the embedding table).
    pub fn dtype(&self) -> DType {
        self.tensors.get("model.embed_tokens.weight").map_or(DType::F32, |t| t.dtype())
    }

    pub fn device(&self) -> Device {
        self.tensors.get("model.embed_tokens.weight").map_or(Device::Cpu, |t| t.device().clone())
    }

    pub fn is_quantized(&self) -> bool {
        !self.qtensors.is_empty()
    }

    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .ok_or_else(|| Error::load(&self.source, format!("tensor {name} is missing")))
    }

    /// Checks every tensor the Llama forward needs is present with the right shape, so
    /// that building either engine afterwards cannot fail on a missing weight.
    pub fn check_shapes(&self) -> Result<()> {
        let c = &self.config;
        let q = c.num_attention_heads * c.head_dim;
        let kv = c.num_key_value_heads * c.head_dim;
        let mut expected: Vec<(String, Vec<usize>)> = vec![
            ("model.embed_tokens.weight".into(), vec![c.vocab_size, c.hidden_size]),
            ("model.norm.weight".into(), vec![c.hidden_size]),
        ];
        if !c.tie_word_embeddings {
            expected.push(("lm_head.weight".into(), vec![c.vocab_size, c.hidden_size]));
        }
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            expected.extend([
                (format!("{p}.input_layernorm.weight"), vec![c.hidden_size]),
                (format!("{p}.post_attention_layernorm.weight"), vec![c.hidden_size]),
                (format!("{p}.self_attn.q_proj.weight"), vec![q, c.hidden_size]),
                (format!("{p}.self_attn.k_proj.weight"), vec![kv, c.hidden_size]),
                (format!("{p}.self_attn.v_proj.weight"), vec![kv, c.hidden_size]),
                (format!("{p}.self_attn.o_proj.weight"), vec![c.hidden_size, q]),
                (format!("{p}.mlp.gate_proj.weight"), vec![c.intermediate_size, c.hidden_size]),
                (format!("{p}.mlp.up_proj.weight"), vec![c.intermediate_size, c.hidden_size]),
                (format!("{p}.mlp.down_proj.weight"), vec![c.hidden_size, c.intermediate_size]),
            ]);
        }
        for (name, shape) in expected {
            let dims = self.dims_of(&name)?;
            if dims != shape {
                return Err(Error::load(&self.source, format!("tensor {name} has shape {dims:?}, expected {shape:?}")));
            }
        }
        Ok(())
    }
}

/// Called as loading advances with (units done, units in all): tensors for GGUF,
/// files for safetensors.
pub type Progress<'a> = &'a (dyn Fn(usize, usize) + Sync);

/// Loads a GGUF file or a Hugging Face directory.
///
/// Panics inside candle's readers (a malformed file can trigger some) are turned into
/// [`Error::Load`], so no panic ever leaves this function.
pub fn load(path: &Path, dtype: DType, device: &Device) -> Result<Weights> {
    load_with_progress(path, dtype, device, false, &|_, _| {})
}

/// [`load`], reporting progress. With `quantized`, a GGUF file's linear-layer matrices
/// stay in their quantized blocks (for candle's quantized matmul) instead of being
/// dequantized; Hugging Face directories have no such blocks and are refused.
pub fn load_with_progress(path: &Path, dtype: DType, device: &Device, quantized: bool, progress: Progress<'_>) -> Result<Weights> {
    if quantized && path.is_dir() {
        return Err(Error::Input(format!(
            "quantized=True keeps a GGUF file's quantized blocks, but {} is a Hugging Face directory of float weights",
            path.display()
        )));
    }
    if !path.exists() {
        return Err(Error::NotFound { path: path.to_path_buf() });
    }
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if path.is_dir() {
            safetensors::load_dir(path, dtype, device, progress)
        } else {
            gguf::load_file(path, dtype, device, quantized, progress)
        }
    }));
    let weights = match result {
        Ok(r) => r?,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            return Err(Error::load(path, format!("malformed file ({msg})")));
        }
    };
    weights.config.validate().map_err(|r| Error::load(path, r))?;
    weights.check_shapes()?;
    Ok(weights)
}
