//! Rotary position embedding. The angles of the positions a call needs are computed
//! for that call (in float32, as transformers does, then cast to the model dtype): a few
//! thousand sines per chunk, and no table sized by the context length, so a header
//! claiming 2^24 positions costs nothing until they are used.

use candle_core::{DType, Device, Result, Tensor};
use candle_transformers::models::llama::{Llama3RopeConfig, Llama3RopeType};

use crate::config::ModelConfig;

pub struct Rope {
    inv_freq: Vec<f32>,
    dtype: DType,
    device: Device,
}

impl Rope {
    pub fn new(cfg: &ModelConfig, dtype: DType, device: &Device) -> Result<Self> {
        Ok(Self { inv_freq: inverse_frequencies(cfg), dtype, device: device.clone() })
    }

    /// cos and sin of positions `offset..offset + seq`, each (seq, head_dim / 2).
    pub fn tables(&self, offset: usize, seq: usize) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut angles = Vec::with_capacity(seq * half);
        for p in offset..offset + seq {
            let p = p as f32;
            angles.extend(self.inv_freq.iter().map(|f| p * f));
        }
        let angles = Tensor::from_vec(angles, (seq, half), &self.device)?;
        Ok((angles.cos()?.to_dtype(self.dtype)?, angles.sin()?.to_dtype(self.dtype)?))
    }

    /// Rotates `heads` heads of one position `pos` in place, as [`Rope::apply`] does with
    /// `tables(pos, 1)` (the same float32 angles).
    pub fn rotate(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        let p = pos as f32;
        let (cos, sin): (Vec<f32>, Vec<f32>) = self.inv_freq.iter().map(|f| { let a = p * f; (a.cos(), a.sin()) }).unzip();
        for head in x.chunks_exact_mut(2 * half) {
            let (x1, x2) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (x1[i], x2[i]);
                x1[i] = a * cos[i] - b * sin[i];
                x2[i] = b * cos[i] + a * sin[i];
            }
        }
    }

    /// Applies the rotation given by `tables` to `x` of shape (batch, heads, seq,
    /// head_dim), in the Hugging Face "rotate half" layout.
    pub fn apply(x: &Tensor, (cos, sin): &(Tensor, Tensor)) -> Result<Tensor> {
        candle_nn::rotary_emb::rope(x, cos, sin)
    }
}

fn inverse_frequencies(cfg: &ModelConfig) -> Vec<f32> {
    let d = cfg.head_dim;
    let base: Vec<f32> =
        (0..d).step_by(2).map(|i| 1.0 / cfg.rope_theta.powf(i as f32 / d as f32)).collect();
    match (&cfg.rope_freq_factors, &cfg.rope_scaling) {
        (Some(factors), _) => base.iter().zip(factors).map(|(f, k)| f / k).collect(),
        (None, Some(s)) if matches!(s.rope_type, Llama3RopeType::Llama3) => base.into_iter().map(|f| llama3_scale(f, s)).collect(),
        _ => base,
    }
}

/// Llama 3.1 frequency scaling: long wavelengths are slowed down by `factor`, short
/// ones kept, and the band between interpolated smoothly.
fn llama3_scale(freq: f32, s: &Llama3RopeConfig) -> f32 {
    let original = s.original_max_position_embeddings as f32;
    let wavelen = 2.0 * std::f32::consts::PI / freq;
    let (low_wavelen, high_wavelen) = (original / s.low_freq_factor, original / s.high_freq_factor);
    if wavelen < high_wavelen {
        freq
    } else if wavelen > low_wavelen {
        freq / s.factor
    } else {
        let smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * freq / s.factor + smooth * freq
    }
}
