//! Architecture numbers of a Llama-family model, whatever file they came from.

use candle_transformers::models::llama::{Config as UpstreamConfig, Llama3RopeConfig, Llama3RopeType, LlamaEosToks};

/// Everything the engine needs to know about the architecture.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rms_norm_eps: f64,
    /// Context length: the cache never grows past this many positions.
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Llama 3 style frequency scaling, as in candle-transformers' config (from a
    /// Hugging Face `config.json`).
    pub rope_scaling: Option<Llama3RopeConfig>,
    /// The same scaling as llama.cpp stores it in a GGUF file: a divisor per frequency
    /// (`rope_freqs.weight`, head_dim / 2 of them).
    pub rope_freq_factors: Option<Vec<f32>>,
}

/// No dimension of a real Llama model comes near this (the largest use 128k-256k
/// vocabularies, 16k hidden sizes, 126 layers); positions are capped at 2^24 too.
const MAX_DIMENSION: usize = 1 << 24;
/// Weights per matrix: 2^36 float32 weights are 256 GB.
const MAX_ELEMENTS: usize = 1 << 36;

impl ModelConfig {
    /// Checks the numbers are coherent; returns a human-readable reason when not.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("{name} must be positive, got 0"));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim must be even for RoPE, got {}", self.head_dim));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(format!("rope_theta must be a positive number, got {}", self.rope_theta));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(format!("rms_norm_eps must be a non-negative number, got {}", self.rms_norm_eps));
        }
        for (name, v) in positive {
            if v > MAX_DIMENSION {
                return Err(format!("{name} {v} is implausibly large (at most {MAX_DIMENSION})"));
            }
        }
        // the sizes of the weight matrices, computed without overflow
        let products = [
            ("num_attention_heads * head_dim", self.num_attention_heads, self.head_dim),
            ("vocab_size * hidden_size", self.vocab_size, self.hidden_size),
            ("intermediate_size * hidden_size", self.intermediate_size, self.hidden_size),
            ("num_attention_heads * head_dim * hidden_size", self.num_attention_heads * self.head_dim, self.hidden_size),
        ];
        for (name, a, b) in products {
            if a.checked_mul(b).is_none_or(|n| n > MAX_ELEMENTS) {
                return Err(format!("{name} = {a} * {b} is implausibly large (at most {MAX_ELEMENTS} weights per matrix)"));
            }
        }
        if let Some(s) = self.rope_scaling.as_ref().filter(|s| matches!(s.rope_type, Llama3RopeType::Llama3)) {
            let (low, high) = (s.low_freq_factor, s.high_freq_factor);
            if !(s.factor.is_finite() && s.factor > 0.0) {
                return Err(format!("rope_scaling.factor must be a positive number, got {}", s.factor));
            }
            if !(low.is_finite() && high.is_finite() && low > 0.0 && high > low) {
                return Err(format!(
                    "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got low_freq_factor {low}, high_freq_factor {high}"
                ));
            }
            if s.original_max_position_embeddings == 0 {
                return Err("rope_scaling.original_max_position_embeddings must be positive, got 0".into());
            }
        }
        if let Some(f) = &self.rope_freq_factors {
            if f.len() != self.head_dim / 2 {
                return Err(format!("rope_freqs.weight has {} factors, head_dim {} needs {}", f.len(), self.head_dim, self.head_dim / 2));
            }
            if let Some((i, x)) = f.iter().enumerate().find(|(_, x)| !(x.is_finite() && **x > 0.0)) {
                return Err(format!("rope_freqs.weight[{i}] must be a positive number, got {x}"));
            }
        }
        Ok(())
    }

    /// Number of query heads sharing one key/value head.
    pub fn n_rep(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// candle-transformers' config for its own `Llama`. That model derives the head dim as
    /// hidden_size / num_attention_heads, so other head dims cannot be expressed.
    pub fn to_upstream(&self) -> std::result::Result<UpstreamConfig, String> {
        if self.rope_freq_factors.is_some() {
            return Err("candle's Llama takes Llama 3 RoPE scaling from a config.json, not a GGUF file's rope_freqs.weight".into());
        }
        if self.hidden_size != self.head_dim * self.num_attention_heads {
            return Err(format!(
                "candle's Llama assumes head_dim = hidden_size / num_attention_heads, but this model has head_dim {} with hidden_size {} and {} heads",
                self.head_dim, self.hidden_size, self.num_attention_heads
            ));
        }
        let eos_token_id = match self.eos_token_ids.as_slice() {
            [] => None,
            [one] => Some(LlamaEosToks::Single(*one)),
            many => Some(LlamaEosToks::Multiple(many.to_vec())),
        };
        Ok(UpstreamConfig {
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            vocab_size: self.vocab_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads,
            use_flash_attn: false,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            bos_token_id: self.bos_token_id,
            eos_token_id,
            rope_scaling: self.rope_scaling.clone(),
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
        })
    }
}
