//! candle-transformers' own `models::llama::{Llama, Cache}`, wrapped exactly as they
//! ship: the caller passes `index_pos`, only the last position's logits come back, and
//! nothing is checked that candle does not check. Kept to show that the native engine
//! computes what candle's Llama computes, and to reproduce candle's behaviour.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama::{Cache, Config, Llama};

use crate::error::{Error, Result};
use crate::loader::{Part, Weights};
use crate::model::{next_model_id, token_ids};

pub struct UpstreamLlama {
    id: u64,
    /// Bytes of the float weights: candle's cache tables are refused beyond this.
    weight_bytes: usize,
    model: Llama,
    config: Config,
    dtype: DType,
    device: Device,
}

pub struct UpstreamCache {
    model_id: u64,
    inner: Cache,
}

impl UpstreamLlama {
    /// Why a quantized model has no upstream engine.
    pub const QUANTIZED: &'static str = "candle's upstream Llama runs float weights; load the model without quantized=True";

    pub fn new(w: &Weights) -> Result<Self> {
        if w.is_quantized() {
            return Err(Error::Input(Self::QUANTIZED.into()));
        }
        let config = w.config.to_upstream().map_err(|r| Error::load(&w.source, r))?;
        let embeddings = w.get(&Part::Embed.name())?;
        let (dtype, device) = (embeddings.dtype(), embeddings.device().clone());
        let vb = VarBuilder::from_tensors(w.tensors.clone(), dtype, &device);
        // Llama::load unwraps per-layer results; the loader checked every shape already,
        // and a panic is still caught here rather than reaching the caller.
        let model = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Llama::load(vb, &config)))
            .map_err(|_| Error::load(&w.source, "candle's Llama::load panicked"))??;
        let weight_bytes = w.tensors.values().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum();
        Ok(Self { id: next_model_id(), weight_bytes, model, config, dtype, device })
    }

    pub fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    /// The context length: candle's RoPE tables end there.
    pub fn max_length(&self) -> usize {
        self.config.max_position_embeddings
    }

    /// `Cache::new(use_kv_cache, dtype, config, device)`. candle's cache precomputes RoPE
    /// tables (float32 cos and sin) for every position up to the context length; a file
    /// whose context length would make them larger than its weights is refused rather
    /// than allowed to allocate gigabytes on a header number.
    pub fn new_cache(&self, use_kv_cache: bool) -> Result<UpstreamCache> {
        let c = &self.config;
        let table_bytes = c.max_position_embeddings.saturating_mul(c.hidden_size / c.num_attention_heads).saturating_mul(4);
        if table_bytes > self.weight_bytes {
            return Err(Error::Input(format!(
                "candle's Cache precomputes RoPE tables for all {} positions of the context length ({table_bytes} bytes), more than the model's weights ({} bytes); kvcandle does not allocate that for its reference engine",
                c.max_position_embeddings, self.weight_bytes
            )));
        }
        Ok(UpstreamCache { model_id: self.id, inner: Cache::new(use_kv_cache, self.dtype, &self.config, &self.device)? })
    }

    /// `Llama::forward(ids, index_pos, cache)`: last-position logits, float32 (vocab,).
    /// Only what cannot be expressed in candle's types is checked here: the ids must fit
    /// in u32 and be in the vocabulary (candle would index out of bounds), and the cache
    /// must be this model's. `index_pos` is passed through unchecked, as candle does.
    pub fn forward(&self, ids: &[i64], index_pos: usize, cache: &mut UpstreamCache) -> Result<Tensor> {
        if cache.model_id != self.id {
            return Err(Error::Cache("this upstream cache was made by another model".into()));
        }
        let tokens = token_ids(ids, self.config.vocab_size)?;
        let x = Tensor::new(tokens.as_slice(), &self.device)?.unsqueeze(0)?;
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.model.forward(&x, index_pos, &mut cache.inner)))
            .map_err(|_| Error::Engine(candle_core::Error::Msg("candle's Llama::forward panicked".into())))??;
        Ok(out.squeeze(0)?)
    }
}

impl UpstreamCache {
    /// `Cache::clone()`: candle's caches share tensors but never write in place.
    pub fn clone_cache(&self) -> Self {
        Self { model_id: self.model_id, inner: self.inner.clone() }
    }

    pub fn use_kv_cache(&self) -> bool {
        self.inner.use_kv_cache
    }
}
