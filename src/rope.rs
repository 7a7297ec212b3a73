//! Rotary position embedding. The angles of the positions a call needs are computed
//! for that call, in float64 (frequencies, angles, sines and cosines), then rounded once
//! to float32: transformers computes them in float32, where an angle at position 2,000
//! is already off by about 1e-4 radians. A few thousand sines per chunk, and no table
//! sized by the context length, so a header claiming 2^24 positions costs nothing until
//! they are used.

use candle_core::{DType, Device, Result, Tensor};
use candle_transformers::models::llama::{Llama3RopeConfig, Llama3RopeType};

use crate::config::ModelConfig;

/// One position's rounded cos and sin ([`Rope::angles`]).
pub struct Angles {
    cos: Vec<f32>,
    sin: Vec<f32>,
}

pub struct Rope {
    inv_freq: Vec<f64>,
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
        let (mut cos, mut sin) = (Vec::with_capacity(seq * half), Vec::with_capacity(seq * half));
        for p in offset..offset + seq {
            let (c, s) = self.cos_sin(p);
            cos.extend(c);
            sin.extend(s);
        }
        let cos = Tensor::from_vec(cos, (seq, half), &self.device)?;
        let sin = Tensor::from_vec(sin, (seq, half), &self.device)?;
        Ok((cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?))
    }

    /// cos and sin of position `pos`'s angles, computed in float64 and rounded once.
    fn cos_sin(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        let p = pos as f64;
        self.inv_freq.iter().map(|f| { let a = p * f; (a.cos() as f32, a.sin() as f32) }).unzip()
    }

    /// The rounded cos and sin of position `pos`, for [`Rope::rotate`]: a step of many
    /// layers computes them once per position, not once per layer (a position's 32
    /// float64 sines and cosines in each of the default model's 30 layers were about 1 %
    /// of a quantized decode step).
    pub fn angles(&self, pos: usize) -> Angles {
        let (cos, sin) = self.cos_sin(pos);
        Angles { cos, sin }
    }

    /// Rotates the heads of one position in place (its queries and its keys), by that
    /// position's [`Rope::angles`], as [`Rope::apply`] does with `tables(pos, 1)` (the
    /// same rounded sines and cosines).
    pub fn rotate(&self, q: &mut [f32], k: &mut [f32], angles: &Angles) {
        let half = self.inv_freq.len();
        let (cos, sin) = (&angles.cos[..half], &angles.sin[..half]);
        for head in q.chunks_exact_mut(2 * half).chain(k.chunks_exact_mut(2 * half)) {
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

fn inverse_frequencies(cfg: &ModelConfig) -> Vec<f64> {
    let d = cfg.head_dim;
    let base: Vec<f64> =
        (0..d).step_by(2).map(|i| 1.0 / (cfg.rope_theta as f64).powf(i as f64 / d as f64)).collect();
    match (&cfg.rope_freq_factors, &cfg.rope_scaling) {
        (Some(factors), _) => base.iter().zip(factors).map(|(f, k)| f / *k as f64).collect(),
        (None, Some(s)) if matches!(s.rope_type, Llama3RopeType::Llama3) => base.into_iter().map(|f| llama3_scale(f, s)).collect(),
        _ => base,
    }
}

/// Llama 3.1 frequency scaling: long wavelengths are slowed down by `factor`, short
/// ones kept, and the band between interpolated smoothly.
fn llama3_scale(freq: f64, s: &Llama3RopeConfig) -> f64 {
    let original = s.original_max_position_embeddings as f64;
    let (factor, low, high) = (s.factor as f64, s.low_freq_factor as f64, s.high_freq_factor as f64);
    let wavelen = 2.0 * std::f64::consts::PI / freq;
    let (low_wavelen, high_wavelen) = (original / low, original / high);
    if wavelen < high_wavelen {
        freq
    } else if wavelen > low_wavelen {
        freq / factor
    } else {
        let smooth = (original / wavelen - low) / (high - low);
        (1.0 - smooth) * freq / factor + smooth * freq
    }
}
