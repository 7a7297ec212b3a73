//! Loaders: a GGUF file or a Hugging Face directory becomes a [`Weights`]: the
//! architecture numbers plus every tensor under its Hugging Face name
//! (`model.layers.0.self_attn.q_proj.weight`, ...) in the requested dtype and device.

mod gguf;
mod safetensors;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// What a loader produces. Both engines are built from it and share its tensors.
pub struct Weights {
    pub config: ModelConfig,
    pub tensors: HashMap<String, Tensor>,
    /// GGUF metadata (tokenizer and general keys), empty for Hugging Face directories.
    pub metadata: HashMap<String, gguf_file::Value>,
    /// Where the weights came from.
    pub source: PathBuf,
    /// "gguf" or "safetensors".
    pub format: &'static str,
}

impl Weights {
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
            let t = self.get(&name)?;
            if t.dims() != shape.as_slice() {
                return Err(Error::load(
                    &self.source,
                    format!("tensor {name} has shape {:?}, expected {:?}", t.dims(), shape),
                ));
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
    load_with_progress(path, dtype, device, &|_, _| {})
}

/// [`load`], reporting progress.
pub fn load_with_progress(path: &Path, dtype: DType, device: &Device, progress: Progress<'_>) -> Result<Weights> {
    if !path.exists() {
        return Err(Error::NotFound { path: path.to_path_buf() });
    }
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if path.is_dir() {
            safetensors::load_dir(path, dtype, device, progress)
        } else {
            gguf::load_file(path, dtype, device, progress)
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
