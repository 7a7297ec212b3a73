//! Loaders: a GGUF file or a Hugging Face directory becomes a [`Weights`]: the
//! architecture numbers plus every tensor under its Hugging Face name
//! (`model.layers.0.self_attn.q_proj.weight`, ...) in the requested dtype and device.

mod gguf;
mod gguf_header;
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
        self.tensors.get(FLOAT_ALWAYS).map_or(DType::F32, |t| t.dtype())
    }

    pub fn device(&self) -> Device {
        self.tensors.get(FLOAT_ALWAYS).map_or(Device::Cpu, |t| t.device().clone())
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
        for spec in tensor_table(&self.config) {
            let dims = self.dims_of(&spec.name)?;
            spec.check_shape(&dims, &self.source)?;
        }
        Ok(())
    }
}

/// One weight of a Llama model, everything kvcandle knows about it stated once: its
/// Hugging Face name, llama.cpp's name, its shape, and how the GGUF stores it.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    /// The Hugging Face name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// llama.cpp's name (`blk.0.attn_q.weight`).
    pub gguf: String,
    /// Row-major shape, as Hugging Face stores it.
    pub shape: Vec<usize>,
    /// For q and k: the number of heads whose rows llama.cpp reorders (see `gguf::unpermute`).
    pub rope_heads: Option<usize>,
    /// A matrix of a linear layer (kept in its quantized blocks with `quantized=True`).
    pub linear: bool,
}

impl TensorSpec {
    fn check_shape(&self, dims: &[usize], source: &Path) -> Result<()> {
        if dims != self.shape.as_slice() {
            return Err(Error::load(source, format!("tensor {} has shape {dims:?}, expected {:?}", self.name, self.shape)));
        }
        Ok(())
    }
}

/// A tensor every loader keeps as floats (never in quantized blocks): the final norm's
/// scale. Its dtype and device are the model's.
const FLOAT_ALWAYS: &str = "model.norm.weight";

/// Weights per transformer layer.
const TENSORS_PER_LAYER: usize = 9;

/// Every weight a Llama model with this (validated) configuration has, in load order.
pub fn tensor_table(c: &ModelConfig) -> Vec<TensorSpec> {
    let (h, q, kv, ff) = (c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size);
    let spec = |name: String, gguf: String, shape: Vec<usize>, rope_heads: Option<usize>, linear: bool| TensorSpec {
        name,
        gguf,
        shape,
        rope_heads,
        linear,
    };
    let mut table = vec![
        // the lookup table; tied, it is also the lm_head (a linear layer)
        spec("model.embed_tokens.weight".into(), "token_embd.weight".into(), vec![c.vocab_size, h], None, c.tie_word_embeddings),
        spec("model.norm.weight".into(), "output_norm.weight".into(), vec![h], None, false),
    ];
    if !c.tie_word_embeddings {
        table.push(spec("lm_head.weight".into(), "output.weight".into(), vec![c.vocab_size, h], None, true));
    }
    for i in 0..c.num_hidden_layers {
        let layer = [
            ("input_layernorm", "attn_norm", vec![h], None, false),
            ("post_attention_layernorm", "ffn_norm", vec![h], None, false),
            ("self_attn.q_proj", "attn_q", vec![q, h], Some(c.num_attention_heads), true),
            ("self_attn.k_proj", "attn_k", vec![kv, h], Some(c.num_key_value_heads), true),
            ("self_attn.v_proj", "attn_v", vec![kv, h], None, true),
            ("self_attn.o_proj", "attn_output", vec![h, q], None, true),
            ("mlp.gate_proj", "ffn_gate", vec![ff, h], None, true),
            ("mlp.up_proj", "ffn_up", vec![ff, h], None, true),
            ("mlp.down_proj", "ffn_down", vec![h, ff], None, true),
        ];
        debug_assert_eq!(layer.len(), TENSORS_PER_LAYER);
        for (hf, gg, shape, rope_heads, linear) in layer {
            table.push(spec(format!("model.layers.{i}.{hf}.weight"), format!("blk.{i}.{gg}.weight"), shape, rope_heads, linear));
        }
    }
    table
}

/// Validates the configuration read from a file holding `present` tensors and returns
/// its tensor table. The layer count is checked against the tensors present before the
/// table is built, so a header number cannot make the loader allocate more than the file
/// holds.
fn expected_tensors(config: &ModelConfig, present: usize, source: &Path) -> Result<Vec<TensorSpec>> {
    config.validate().map_err(|r| Error::load(source, r))?;
    if config.num_hidden_layers > present / TENSORS_PER_LAYER {
        return Err(Error::load(
            source,
            format!(
                "the configuration has {} layers ({TENSORS_PER_LAYER} weights each) but the file holds only {present} tensors",
                config.num_hidden_layers
            ),
        ));
    }
    Ok(tensor_table(config))
}

/// Called as loading advances with (tensors done, tensors in all).
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
    weights.check_shapes()?;
    Ok(weights)
}
