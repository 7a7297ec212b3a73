//! Linear layers for the native engine.
//!
//! candle's CPU matmul runs a single-row product (a decode step) on one thread, which
//! leaves the other cores idle while the weights stream through one core's memory
//! bandwidth. For one row, this layer splits the weight's output rows into one block
//! per thread (contiguous views: nothing is copied) and runs the blocks in parallel; the
//! per-element reduction is the same, so results do not change. More rows go through
//! candle's multi-threaded matmul as they are.
//!
//! A quantized model keeps Q4_1 / Q8_0 matrices in their GGUF blocks: a decode step
//! reads a quarter to an eighth of the bytes through [`crate::qmatvec`]; products of more
//! rows (prefill) dequantize the matrix and use the float path.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Module, Result, Tensor};

use crate::qmatvec::{QKind, QMatrix};

/// Rows up to which a quantized layer runs one matrix-vector product per row.
const QUANTIZED_MAX_ROWS: usize = 8;

/// Rows up to which the split path is used: single-row decode steps only, so that every
/// multi-row product (prefill, chunks) takes the same path whatever its row count.
const SPLIT_MAX_ROWS: usize = 1;

pub enum Linear {
    Float(FloatLinear),
    Quantized(QMatrix),
}

impl Linear {
    pub fn new(weight: Tensor) -> Result<Self> {
        Ok(Self::Float(FloatLinear::new(weight)?))
    }

    /// Q4_1 and Q8_0 blocks are kept; other block types are dequantized to `dtype` on
    /// `device` and run as a float layer.
    pub fn quantized(weight: &QTensor, dtype: DType, device: &Device) -> Result<Self> {
        let (rows, cols) = weight.shape().dims2()?;
        let kind = match weight.dtype() {
            GgmlDType::Q4_1 => Some(QKind::Q4_1),
            GgmlDType::Q8_0 => Some(QKind::Q8_0),
            _ => None,
        };
        if let (Some(kind), true, true) = (kind, device.is_cpu(), dtype == DType::F32) {
            if let Some(m) = QMatrix::new(kind, rows, cols, &weight.data()?) {
                return Ok(Self::Quantized(m));
            }
        }
        Self::new(weight.dequantize(&Device::Cpu)?.to_dtype(dtype)?.to_device(device)?)
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Float(l) => l.forward(x),
            Self::Quantized(q) => quantized_forward(q, x),
        }
    }
}

fn quantized_forward(q: &QMatrix, x: &Tensor) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let cols = *dims.last().unwrap_or(&0);
    if cols != q.cols() {
        candle_core::bail!("quantized linear: input has {cols} features, the matrix {}", q.cols());
    }
    let rows = x.elem_count() / cols.max(1);
    let mut out_dims = dims.clone();
    *out_dims.last_mut().expect("rank >= 1") = q.rows();
    if rows > QUANTIZED_MAX_ROWS {
        let w = Tensor::from_vec(q.dequantize(), (q.rows(), q.cols()), x.device())?;
        return x.reshape((rows, cols))?.matmul(&w.t()?)?.reshape(out_dims);
    }
    let input = x.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; rows * q.rows()];
    for (xr, or) in input.chunks(cols).zip(out.chunks_mut(q.rows())) {
        q.matvec(xr, or);
    }
    Tensor::from_vec(out, out_dims, x.device())
}

pub struct FloatLinear {
    inner: candle_nn::Linear,
    blocks: Vec<Tensor>,
}

impl FloatLinear {
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
}

impl Module for FloatLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        let k = *dims.last().unwrap_or(&0);
        let rows = x.elem_count().checked_div(k).unwrap_or(0);
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
