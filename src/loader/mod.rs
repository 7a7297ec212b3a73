//! Loaders: a GGUF file or a Hugging Face directory becomes a [`Weights`]: the
//! architecture numbers plus every tensor under its Hugging Face name
//! (`model.layers.0.self_attn.q_proj.weight`, ...) in the requested dtype and device.

mod gguf;
mod gguf_header;
mod safetensors;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::error::{message, Error, Result};
use crate::memory::Arena;

/// What a loader produces. Both engines are built from it and share its tensors.
pub struct Weights {
    pub config: ModelConfig,
    pub tensors: HashMap<String, Tensor>,
    /// Linear-layer matrices kept in their GGUF quantized blocks (`quantized` loads only),
    /// under the same names; such a matrix is not also in `tensors`.
    pub qtensors: HashMap<String, Arc<Blocks>>,
    /// Where the weights came from.
    pub source: PathBuf,
    /// "gguf" or "safetensors".
    pub format: &'static str,
    /// The buffer float32 CPU tensors were loaded into ([`crate::memory`]), for stacking
    /// them without a copy; None for other dtypes and devices.
    pub arena: Option<Arc<Arena>>,
}

impl Weights {
    /// Shape of a tensor, float or quantized.
    fn dims_of(&self, name: &str) -> Result<Vec<usize>> {
        if let Some(t) = self.tensors.get(name) {
            return Ok(t.dims().to_vec());
        }
        match self.qtensors.get(name) {
            Some(q) => Ok(vec![q.rows, q.cols]),
            None => Err(Error::load(&self.source, format!("tensor {name} is missing"))),
        }
    }

    /// The float dtype and device of the weights (those of the embedding table).
    pub fn dtype(&self) -> DType {
        self.tensors.get(&FLOAT_ALWAYS.name()).map_or(DType::F32, |t| t.dtype())
    }

    pub fn device(&self) -> Device {
        self.tensors.get(&FLOAT_ALWAYS.name()).map_or(Device::Cpu, |t| t.device().clone())
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

/// A matrix as a GGUF file stores it: its blocks' bytes (or 16-bit floats), rows in the
/// Hugging Face order. Read straight from the file, with no other copy made, so that the
/// engine can take the bytes over (kept types) or repack them one matrix at a time.
pub struct Blocks {
    pub dtype: GgmlDType,
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<u8>,
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
const FLOAT_ALWAYS: Part = Part::FinalNorm;

/// Weights per transformer layer.
const TENSORS_PER_LAYER: usize = 9;

/// One weight of a Llama model; its names, shape and GGUF row order are stated once, in
/// [`Part::spec`], and the loaders, the engine and candle's upstream model all name
/// weights through it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// the lookup table; tied, it is also the lm_head
    Embed,
    FinalNorm,
    LmHead,
    InputNorm(usize),
    PostNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
}

impl Part {
    /// The weights of layer `i`, in load order.
    pub fn layer(i: usize) -> [Part; TENSORS_PER_LAYER] {
        [Part::InputNorm(i), Part::PostNorm(i), Part::Q(i), Part::K(i), Part::V(i), Part::O(i), Part::Gate(i), Part::Up(i), Part::Down(i)]
    }

    /// The Hugging Face name (`model.layers.0.self_attn.q_proj.weight`).
    pub fn name(self) -> String {
        self.names().0
    }

    /// (Hugging Face name, llama.cpp's name).
    fn names(self) -> (String, String) {
        let (layer, hf, gguf) = match self {
            Part::Embed => return ("model.embed_tokens.weight".into(), "token_embd.weight".into()),
            Part::FinalNorm => return ("model.norm.weight".into(), "output_norm.weight".into()),
            Part::LmHead => return ("lm_head.weight".into(), "output.weight".into()),
            Part::InputNorm(i) => (i, "input_layernorm", "attn_norm"),
            Part::PostNorm(i) => (i, "post_attention_layernorm", "ffn_norm"),
            Part::Q(i) => (i, "self_attn.q_proj", "attn_q"),
            Part::K(i) => (i, "self_attn.k_proj", "attn_k"),
            Part::V(i) => (i, "self_attn.v_proj", "attn_v"),
            Part::O(i) => (i, "self_attn.o_proj", "attn_output"),
            Part::Gate(i) => (i, "mlp.gate_proj", "ffn_gate"),
            Part::Up(i) => (i, "mlp.up_proj", "ffn_up"),
            Part::Down(i) => (i, "mlp.down_proj", "ffn_down"),
        };
        (format!("model.layers.{layer}.{hf}.weight"), format!("blk.{layer}.{gguf}.weight"))
    }

    /// Everything about this weight for a model of configuration `c`.
    pub fn spec(self, c: &ModelConfig) -> TensorSpec {
        let (h, q, kv, ff) = (c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size);
        let (shape, rope_heads, linear) = match self {
            Part::Embed => (vec![c.vocab_size, h], None, c.tie_word_embeddings),
            Part::LmHead => (vec![c.vocab_size, h], None, true),
            Part::FinalNorm | Part::InputNorm(_) | Part::PostNorm(_) => (vec![h], None, false),
            Part::Q(_) => (vec![q, h], Some(c.num_attention_heads), true),
            Part::K(_) => (vec![kv, h], Some(c.num_key_value_heads), true),
            Part::V(_) => (vec![kv, h], None, true),
            Part::O(_) => (vec![h, q], None, true),
            Part::Gate(_) | Part::Up(_) => (vec![ff, h], None, true),
            Part::Down(_) => (vec![h, ff], None, true),
        };
        let (name, gguf) = self.names();
        TensorSpec { name, gguf, shape, rope_heads, linear }
    }
}

/// Every weight a Llama model with this (validated) configuration has, in load order.
pub fn tensor_table(c: &ModelConfig) -> Vec<TensorSpec> {
    let mut parts = vec![Part::Embed, Part::FinalNorm];
    if !c.tie_word_embeddings {
        parts.push(Part::LmHead);
    }
    parts.extend((0..c.num_hidden_layers).flat_map(Part::layer));
    parts.into_iter().map(|p| p.spec(c)).collect()
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

/// The buffer a loader reads float32 CPU tensors into: room for every tensor of `table`
/// it loads as floats (`quantized` keeps linear layers in blocks). None for other dtypes
/// and devices.
fn arena_for(table: &[TensorSpec], dtype: DType, device: &Device, quantized: bool, source: &Path) -> Result<Option<Arc<Arena>>> {
    if dtype != DType::F32 || !device.is_cpu() {
        return Ok(None);
    }
    let floats = table.iter().filter(|s| !(quantized && s.linear)).map(|s| Arena::room(s.shape.iter().product())).sum();
    let arena = Arena::new(floats).map_err(|e| Error::load(source, message(e)))?;
    Ok(Some(Arc::new(arena)))
}

/// `t` in `arena` when there is one (a float32 CPU tensor), else as it is.
fn kept(t: Tensor, arena: &Option<Arc<Arena>>) -> candle_core::Result<Tensor> {
    match arena {
        Some(a) => a.place(t),
        None => Ok(t),
    }
}

/// Called as loading advances with (tensors done, tensors in all).
pub type Progress<'a> = &'a (dyn Fn(usize, usize) + Sync);

/// The metadata of a GGUF file that holds a Llama model (`tokenizer.*` and `general.*`
/// keys), read from its header alone: the tokenizer can be built before the weights load.
pub fn gguf_metadata(path: &Path) -> Result<HashMap<String, gguf_file::Value>> {
    guarded(path, || gguf::metadata(path))
}

/// Runs a reader on an existing path; a panic inside candle's readers (a malformed file can
/// trigger some) becomes [`Error::Load`].
fn guarded<T>(path: &Path, read: impl FnOnce() -> Result<T>) -> Result<T> {
    if !path.exists() {
        return Err(Error::NotFound { path: path.to_path_buf() });
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(read)) {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Err(Error::load(path, format!("malformed file ({msg})")))
        }
    }
}

/// Loads a GGUF file or a Hugging Face directory.
///
/// Panics inside candle's readers (a malformed file can trigger some) are turned into
/// [`Error::Load`], so no panic ever leaves this function.
pub fn load(path: &Path, dtype: DType, device: &Device) -> Result<Weights> {
    load_with_progress(path, dtype, device, false, &|_, _| {})
}

/// [`load`], reporting progress. With `quantized`, linear-layer matrices stay as the file
/// stores them (GGUF blocks, or 16-bit floats of a GGUF file or a Hugging Face directory)
/// instead of being converted to `dtype`.
pub fn load_with_progress(path: &Path, dtype: DType, device: &Device, quantized: bool, progress: Progress<'_>) -> Result<Weights> {
    let weights = guarded(path, || {
        if path.is_dir() {
            safetensors::load_dir(path, dtype, device, quantized, progress)
        } else {
            gguf::load_file(path, dtype, device, quantized, progress)
        }
    })?;
    weights.check_shapes()?;
    Ok(weights)
}
