//! candle-transformers' own `models::llama::{Llama, Cache}`, wrapped exactly as they
//! ship: the caller passes `index_pos`, only the last position's logits come back, and
//! nothing is checked that candle does not check. Kept to show that the native engine
//! computes what candle's Llama computes, and to reproduce candle's behaviour.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama::{Cache, Config, Llama};

use crate::error::{Error, Result};
use crate::loader::Weights;
use crate::model::{next_model_id, token_ids};

pub struct UpstreamLlama {
    id: u64,
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
    pub fn new(w: &Weights) -> Result<Self> {
        if w.is_quantized() {
            return Err(Error::Input(
                "candle's upstream Llama runs float weights; load the model without quantized=True".into(),
            ));
        }
        let config = w.config.to_upstream().map_err(|r| Error::load(&w.source, r))?;
        let embeddings = w.get("model.embed_tokens.weight")?;
        let (dtype, device) = (embeddings.dtype(), embeddings.device().clone());
        let vb = VarBuilder::from_tensors(w.tensors.clone(), dtype, &device);
        // Llama::load unwraps per-layer results; the loader checked every shape already,
        // and a panic is still caught here rather than reaching the caller.
        let model = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Llama::load(vb, &config)))
            .map_err(|_| Error::load(&w.source, "candle's Llama::load panicked"))??;
        Ok(Self { id: next_model_id(), model, config, dtype, device })
    }

    pub fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    /// `Cache::new(use_kv_cache, dtype, config, device)`.
    pub fn new_cache(&self, use_kv_cache: bool) -> Result<UpstreamCache> {
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
