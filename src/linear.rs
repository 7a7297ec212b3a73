//! Linear layers for the native engine.
//!
//! candle's CPU matmul runs a single-row product (a decode step) on one thread, which
//! leaves the other cores idle while the weights stream through one core's memory
//! bandwidth. For one row, this layer splits the weight's output rows into one block
//! per thread (contiguous views: nothing is copied) and runs the blocks in parallel; the
//! per-element reduction is the same, so results do not change. More rows go through
//! candle's multi-threaded matmul as they are.

use candle_core::{Module, Result, Tensor};

/// Rows up to which the split path is used: single-row decode steps only, so that every
/// multi-row product (prefill, chunks) takes the same path whatever its row count.
const SPLIT_MAX_ROWS: usize = 1;

pub struct Linear {
    inner: candle_nn::Linear,
    blocks: Vec<Tensor>,
}

impl Linear {
    pub fn new(weight: Tensor) -> Result<Self> {
        let threads = candle_core::utils::get_num_threads();
        let out = weight.dim(0)?;
        let parallel = weight.device().is_cpu() && !cfg!(target_os = "macos") && threads > 1 && out >= 64 * threads;
        let mut blocks = Vec::new();
        if parallel {
            let step = out.div_ceil(threads);
            let mut start = 0;
            while start < out {
                let len = step.min(out - start);
                blocks.push(weight.narrow(0, start, len)?);
                start += len;
            }
        }
        Ok(Self { inner: candle_nn::Linear::new(weight, None), blocks })
    }

    pub fn weight(&self) -> &Tensor {
        self.inner.weight()
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        let k = *dims.last().unwrap_or(&0);
        let rows = if k == 0 { 0 } else { x.elem_count() / k };
        if self.blocks.len() < 2 || rows > SPLIT_MAX_ROWS || !x.is_contiguous() {
            return self.inner.forward(x);
        }
        let flat = x.reshape((rows, k))?;
        let parts: Vec<Result<Tensor>> = {
            use rayon::prelude::*;
            self.blocks.par_iter().map(|w| flat.matmul(&w.t()?)).collect()
        };
        let parts = parts.into_iter().collect::<Result<Vec<_>>>()?;
        let y = Tensor::cat(&parts, 1)?;
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("rank >= 1") = y.dim(1)?;
        y.reshape(out_dims)
    }
}
