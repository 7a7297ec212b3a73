//! Linear layers for the native engine: a float matrix (a candle tensor), a matrix kept in
//! GGUF quantized blocks ([`crate::kernels::qmatvec`]), or a stack of either.
//!
//! Three ways in: [`Linear::product_into`] for products of many rows (a prefill pass of
//! kvcandle's own engine: tiles of the weights, each read once for all rows, multiplied
//! by gemm's kernels on the team, into buffers); [`Module::forward`], the same on tensors
//! (candle's product where the weights are not float32 or blocks in CPU memory); and
//! [`Linear::view`] for one input vector (a decode step), which borrows the weights in
//! place so that the threads of a step compute ranges of rows ([`View::mul_rows`]) with
//! kvcandle's own kernels ([`crate::kernels::matvec`], [`crate::kernels::qmatvec`]).
//!
//! Matrices that read the same input are stacked at load ([`Linear::stack`]): q, k and v
//! become one matrix and gate and up another, so a decode step reads its input once per
//! stack and hands out one job instead of three.

use std::sync::{Arc, RwLockReadGuard};

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Module, Result, Storage, Tensor};

use crate::kernels::blocks::Format;
use crate::loader::Blocks;
use crate::memory::Arena;
use crate::kernels::matvec;
use crate::kernels::qmatvec::{QInput, QKind, QMatrix};
use crate::kernels::team::{Shards, Team};

pub enum Linear {
    Float(candle_nn::Linear),
    Quantized(QMatrix),
    /// Matrices of different kinds that read the same input, rows in order.
    Stack(Vec<Linear>),
}

impl Linear {
    pub fn new(weight: Tensor) -> Self {
        Self::Float(candle_nn::Linear::new(weight, None))
    }

    /// GGUF blocks are kept (Q8_0 repacked with a float32 scale for its integer kernel, the
    /// other block types and 16-bit floats byte for byte, the buffer
    /// taken over when no one else holds it); float32 and anything off the CPU or for a
    /// non-float32 model are dequantized to `dtype` on `device`.
    pub fn quantized(weight: Arc<Blocks>, dtype: DType, device: &Device) -> Result<Self> {
        let (rows, cols, ggml) = (weight.rows, weight.cols, weight.dtype);
        let kind = match ggml {
            GgmlDType::Q8_0 => Some(QKind::Q8_0),
            GgmlDType::F16 => Some(QKind::F16),
            GgmlDType::BF16 => Some(QKind::BF16),
            t => Format::from_ggml(t).map(QKind::Blocks),
        };
        let data = Arc::try_unwrap(weight).map_or_else(|w| w.data.clone(), |w| w.data);
        let data = match (kind, device.is_cpu(), dtype == DType::F32) {
            (Some(kind), true, true) => match QMatrix::new(kind, rows, cols, data) {
                Ok(m) => return Ok(Self::Quantized(m)),
                Err(data) => data,
            },
            _ => data,
        };
        let q = qtensor_from_ggml(ggml, &data, vec![rows, cols], &Device::Cpu)?;
        Ok(Self::new(q.dequantize(&Device::Cpu)?.to_dtype(dtype)?.to_device(device)?))
    }

    /// One layer whose output rows are those of `parts` in order: one matrix when they
    /// are all float (a view when they lie side by side in `arena`, else a copy, the
    /// parts' memory released) or all of one block type, else a [`Linear::Stack`].
    pub fn stack(parts: Vec<Linear>, arena: Option<&Arena>) -> Result<Self> {
        if parts.iter().all(|p| matches!(p, Linear::Float(_))) {
            let weights: Vec<&Tensor> = parts.iter().filter_map(|p| if let Linear::Float(l) = p { Some(l.weight()) } else { None }).collect();
            let joined = match arena {
                Some(a) => a.join(&weights)?,
                None => None,
            };
            return Ok(Self::new(match joined {
                Some(view) => view,
                None => Tensor::cat(&weights, 0)?,
            }));
        }
        let qs: Vec<&QMatrix> = parts.iter().filter_map(|p| if let Linear::Quantized(q) = p { Some(q) } else { None }).collect();
        if qs.len() == parts.len() {
            if let Some(m) = QMatrix::stack(&qs) {
                return Ok(Self::Quantized(m));
            }
        }
        Ok(Self::Stack(parts))
    }

    /// Appends output row `i` of the matrix (a row of W) as float32 to `out`.
    pub fn row(&self, i: usize, out: &mut Vec<f32>) -> Result<()> {
        match self {
            Linear::Float(l) => out.extend(l.weight().get(i)?.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            Linear::Quantized(q) => {
                if i >= q.rows() {
                    candle_core::bail!("row {i} of a {}-row matrix", q.rows());
                }
                q.dequantize_rows(i, 1, out)
            }
            Linear::Stack(parts) => {
                let mut first = 0;
                for p in parts {
                    if i < first + p.out_features() {
                        return p.row(i - first, out);
                    }
                    first += p.out_features();
                }
                candle_core::bail!("row {i} of a {first}-row matrix")
            }
        }
        Ok(())
    }

    /// Bytes of the weights as held (float, or blocks).
    pub fn nbytes(&self) -> usize {
        match self {
            Linear::Float(l) => l.weight().elem_count() * l.weight().dtype().size_in_bytes(),
            Linear::Quantized(q) => q.nbytes(),
            Linear::Stack(parts) => parts.iter().map(Linear::nbytes).sum(),
        }
    }

    pub fn out_features(&self) -> usize {
        match self {
            Linear::Float(l) => l.weight().dim(0).unwrap_or(0),
            Linear::Quantized(q) => q.rows(),
            Linear::Stack(parts) => parts.iter().map(Linear::out_features).sum(),
        }
    }

    /// Whether products with this layer quantize their inputs to int8 (some of its
    /// matrices are GGUF blocks; 16-bit floats multiply float32 inputs).
    pub fn int8_activations(&self) -> bool {
        match self {
            Linear::Float(_) => false,
            Linear::Quantized(q) => !matches!(q.kind(), QKind::F16 | QKind::BF16),
            Linear::Stack(parts) => parts.iter().any(Linear::int8_activations),
        }
    }

    fn needs_q8(&self) -> bool {
        match self {
            Linear::Float(_) => false,
            Linear::Quantized(_) => true,
            Linear::Stack(parts) => parts.iter().any(Linear::needs_q8),
        }
    }

    /// The input vector `x` prepared once for every row range of this layer, its int8 form
    /// (where the layer has quantized rows) made in `slot`.
    pub fn prepare<'x>(&self, x: &'x [f32], slot: &'x mut QInput) -> Input<'x> {
        self.fill(x, slot);
        self.input(x, slot)
    }

    /// [`Linear::prepare`] in two steps, for inputs prepared by other threads: `slot` made
    /// the prepared form of `x` where this layer has quantized rows (else left as it is) ...
    pub fn fill(&self, x: &[f32], slot: &mut QInput) {
        if self.needs_q8() {
            slot.fill(x);
        }
    }

    /// ... and the input of `x` with `slot` as [`Linear::fill`] left it for `x`.
    pub fn input<'x>(&self, x: &'x [f32], slot: &'x QInput) -> Input<'x> {
        Input { x, q: self.needs_q8().then_some(slot) }
    }

    /// The product of the rows of `input` ((rows, in_features) row-major float32) with this
    /// layer, into `out` (see [`Out`]): products of many rows, as [`Module::forward`]
    /// computes them, without tensors. Float32 weights and blocks in CPU memory only.
    pub fn product_into(&self, input: &[f32], out: Out<'_>) -> Result<()> {
        match self {
            Linear::Float(_) => {
                let Some(View::Float { guard, start, rows, cols }) = self.view() else {
                    candle_core::bail!("product_into: the weights are not float32 in CPU memory")
                };
                let Storage::Cpu(s) = &*guard else { unreachable!("checked in Linear::view") };
                tiled(input, cols, rows, Tiles::Float(&s.as_slice::<f32>()?[start..start + rows * cols]), out);
            }
            Linear::Quantized(q) => {
                let (n, cols) = (q.rows(), q.cols());
                let m = input.len() / cols.max(1);
                if m > QUANTIZED_MATVEC_MAX_ROWS {
                    tiled(input, cols, n, Tiles::Quantized(q), out);
                } else {
                    let x = Tensor::from_slice(input, (m, cols), &Device::Cpu)?;
                    let y = quantized_forward(q, &x)?.flatten_all()?.to_vec1::<f32>()?;
                    for (i, row) in y.chunks_exact(n.max(1)).enumerate() {
                        let dst = &mut out.data[i * out.ld + out.col..][..n];
                        if out.add {
                            dst.iter_mut().zip(row).for_each(|(d, v)| *d += v);
                        } else {
                            dst.copy_from_slice(row);
                        }
                    }
                }
            }
            Linear::Stack(parts) => {
                let mut col = out.col;
                for p in parts {
                    p.product_into(input, Out { data: &mut *out.data, ld: out.ld, col, add: out.add })?;
                    col += p.out_features();
                }
            }
        }
        Ok(())
    }

    /// The weights borrowed for decode kernels; None unless they are float32 (or blocks)
    /// in CPU memory.
    pub fn view(&self) -> Option<View<'_>> {
        Some(match self {
            Linear::Float(l) => {
                let w = l.weight();
                let (rows, cols) = w.dims2().ok()?;
                let (guard, layout) = w.storage_and_layout();
                let start = layout.contiguous_offsets()?.0;
                match &*guard {
                    Storage::Cpu(s) if s.as_slice::<f32>().is_ok() => {}
                    _ => return None,
                }
                View::Float { guard, start, rows, cols }
            }
            Linear::Quantized(q) => View::Quantized(q),
            Linear::Stack(parts) => {
                let mut views = Vec::with_capacity(parts.len());
                let mut first = 0;
                for p in parts {
                    views.push((first, p.view()?));
                    first += p.out_features();
                }
                View::Stack(views)
            }
        })
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Float(l) => match (x.dtype(), self.view()) {
                (DType::F32, Some(View::Float { guard, start, rows, cols })) => {
                    let Storage::Cpu(s) = &*guard else { unreachable!("checked in Linear::view") };
                    let w = &s.as_slice::<f32>()?[start..start + rows * cols];
                    tiled_forward(x, rows, cols, Tiles::Float(w))
                }
                _ => l.forward(x),
            },
            Self::Quantized(q) => quantized_forward(q, x),
            Self::Stack(parts) => {
                let outs = parts.iter().map(|p| p.forward(x)).collect::<Result<Vec<_>>>()?;
                Tensor::cat(&outs, outs[0].rank() - 1)
            }
        }
    }
}

/// An input vector and, for quantized rows, its int8 form.
pub struct Input<'x> {
    x: &'x [f32],
    q: Option<&'x QInput>,
}

/// A layer's weights borrowed for a decode step (the storage stays read-locked).
pub enum View<'a> {
    Float { guard: RwLockReadGuard<'a, Storage>, start: usize, rows: usize, cols: usize },
    Quantized(&'a QMatrix),
    Stack(Vec<(usize, View<'a>)>),
}

impl View<'_> {
    pub fn out_features(&self) -> usize {
        match self {
            View::Float { rows, .. } => *rows,
            View::Quantized(q) => q.rows(),
            View::Stack(v) => v.iter().map(|(_, p)| p.out_features()).sum(),
        }
    }

    /// Rows the kernels take at once: ranges of rows that are multiples of it run whole
    /// groups only ([`QMatrix::row_group`]; float32: groups of four).
    pub fn row_group(&self) -> usize {
        match self {
            View::Float { .. } => 4,
            View::Quantized(q) => q.row_group(),
            // powers of two: the largest is a multiple of every other
            View::Stack(v) => v.iter().map(|(_, p)| p.row_group()).max().unwrap_or(1),
        }
    }

    /// `out[i] = W[first + i] · x` with the kernels this CPU runs.
    pub fn mul_rows(&self, input: &Input<'_>, first: usize, out: &mut [f32]) {
        match self {
            View::Float { guard, start, rows, cols } => {
                let Storage::Cpu(s) = &**guard else { unreachable!("checked in Linear::view") };
                let w = &s.as_slice::<f32>().expect("checked in Linear::view")[*start..start + rows * cols];
                matvec::kernel().mul_rows(w, input.x, first, out);
            }
            View::Quantized(q) => q.mul_rows(input.q.expect("prepared for quantized rows"), first, out),
            View::Stack(parts) => {
                let end = first + out.len();
                for (start, p) in parts {
                    let (lo, hi) = (first.max(*start), end.min(start + p.out_features()));
                    if lo < hi {
                        p.mul_rows(input, lo - start, &mut out[lo - first..hi - first]);
                    }
                }
            }
        }
    }
}

impl View<'_> {
    /// [`View::mul_rows`] for several inputs at once (`outs[m]` for `inputs[m]`): rows are
    /// read once for all of them ([`crate::kernels::matvec::Kernel::mul_rows_batch`],
    /// [`QMatrix::mul_rows_batch`]), each result bit-identical to `mul_rows`'s.
    pub fn mul_rows_batch(&self, inputs: &[Input<'_>], first: usize, outs: &mut [&mut [f32]]) {
        match self {
            View::Float { guard, start, rows, cols } => {
                let Storage::Cpu(s) = &**guard else { unreachable!("checked in Linear::view") };
                let w = &s.as_slice::<f32>().expect("checked in Linear::view")[*start..start + rows * cols];
                let xs: Vec<&[f32]> = inputs.iter().map(|i| i.x).collect();
                matvec::kernel().mul_rows_batch(w, &xs, first, outs);
            }
            View::Quantized(q) => {
                let prepared: Vec<&QInput> = inputs.iter().map(|i| i.q.expect("prepared for quantized rows")).collect();
                q.mul_rows_batch(&prepared, first, outs);
            }
            View::Stack(parts) => {
                let end = first + outs.first().map_or(0, |o| o.len());
                for (start, p) in parts {
                    let (lo, hi) = (first.max(*start), end.min(start + p.out_features()));
                    if lo < hi {
                        let mut sub: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[lo - first..hi - first]).collect();
                        p.mul_rows_batch(inputs, lo - start, &mut sub);
                    }
                }
            }
        }
    }
}

/// Input rows up to which a quantized product runs integer matrix-vector products (the
/// activations quantized to int8, as in a decode step).
const QUANTIZED_MATVEC_MAX_ROWS: usize = 8;

/// Weight rows per task in a product of many input rows (prefill): a tile of the matrix
/// that stays in the core's cache while every input row is multiplied with it (gemm's
/// kernels, one thread each), so each weight is read from memory once per call. A
/// quantized tile is dequantized into a buffer first: the whole matrix never is.
const TILE_ROWS: usize = 64;

/// Columns (the inner dimension) per partial sum of a tile's product: each output is the
/// sum of its products over `K_PART` columns at a time, added afterwards, instead of one
/// running sum over every column (gemm keeps one accumulator per output): fewer float32
/// roundings per sum, as the decode kernels' several accumulators per row have.
/// Measured (default model, one-pass prefill of six prompts of 39-195 tokens, largest
/// logit error against float64 over transformers float32's): one sum 0.72-1.47, 256
/// columns 0.52-0.93, 128 columns 0.30-0.90 but prefill 8 % slower (256: within 2 %).
const K_PART: usize = 256;

/// Where the tiles of a weight matrix come from.
enum Tiles<'a> {
    /// float32, row-major
    Float(&'a [f32]),
    Quantized(&'a QMatrix),
}

thread_local! {
    /// Each thread's buffer for one tile of a prefill product: the sum of the partial
    /// products so far.
    static PARTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `x W^T` for x (..., cols) float32 and W (n, cols).
fn tiled_forward(x: &Tensor, n: usize, cols: usize, tiles: Tiles<'_>) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    if dims.last() != Some(&cols) {
        candle_core::bail!("linear: input has shape {dims:?}, the matrix {cols} columns");
    }
    let mut out_dims = dims.clone();
    *out_dims.last_mut().expect("rank >= 1") = n;
    let x = x.contiguous()?;
    let (guard, layout) = x.storage_and_layout();
    let Storage::Cpu(s) = &*guard else { candle_core::bail!("tiled product needs CPU memory") };
    let input = &s.as_slice::<f32>()?[layout.start_offset()..layout.start_offset() + x.elem_count()];
    let m = input.len() / cols.max(1);
    let mut out = vec![0f32; m * n];
    tiled(input, cols, n, tiles, Out { data: &mut out, ld: n, col: 0, add: false });
    drop(guard);
    Tensor::from_vec(out, out_dims, x.device())
}

/// Where a product of many rows goes: row i's n results at `data[i * ld + col..][..n]`,
/// written, or added to what is there with `add`.
pub struct Out<'a> {
    pub data: &'a mut [f32],
    pub ld: usize,
    pub col: usize,
    pub add: bool,
}

/// The product of the rows of `input` ((m, cols) row-major) with W^T, W (n, cols) given as
/// tiles, into `out`; one task per tile of [`TILE_ROWS`] weight rows on the team.
fn tiled(input: &[f32], cols: usize, n: usize, tiles: Tiles<'_>, out: Out<'_>) {
    let m = input.len() / cols.max(1);
    assert!(m == 0 || out.data.len() >= (m - 1) * out.ld + out.col + n, "tiled product: output too small");
    let (ld, col, add) = (out.ld, out.col, out.add);
    let shards = Shards::new(out.data);
    Team::global().run(n.div_ceil(TILE_ROWS), &|t| {
        let rows = t * TILE_ROWS..((t + 1) * TILE_ROWS).min(n);
        let mut buffer = Vec::new();
        let w = match tiles {
            Tiles::Float(w) => &w[rows.start * cols..rows.end * cols],
            Tiles::Quantized(q) => {
                buffer.reserve_exact(rows.len() * cols);
                q.dequantize_rows(rows.start, rows.len(), &mut buffer);
                &buffer[..]
            }
        };
        let r = rows.len();
        PARTS.with(|sum| {
            let sum = &mut *sum.borrow_mut();
            sum.resize(m * r, 0.0);
            for k0 in (0..cols).step_by(K_PART) {
                let k = K_PART.min(cols - k0);
                // SAFETY: sum is (m, r) row-major, input columns k0..k0 + k of (m, cols)
                // row-major, the tile's columns k0..k0 + k of (r, cols) row-major read as
                // its transpose; all in bounds. After the first part, each part's sum is
                // added to the sum so far (gemm: dst = 1 * dst + 1 * part, exactly
                // dst + part).
                unsafe {
                    gemm::gemm(
                        m, r, k,
                        sum.as_mut_ptr(), 1, r as isize, k0 > 0,
                        input.as_ptr().add(k0), 1, cols as isize,
                        w.as_ptr().add(k0), cols as isize, 1,
                        1.0, 1.0, false, false, false,
                        gemm::Parallelism::None,
                    );
                }
            }
            for (i, row) in sum.chunks_exact(r).enumerate() {
                let at = i * ld + col + rows.start;
                // SAFETY: the task writes columns rows.start..rows.end of the output's
                // rows, other tasks other columns
                let dst = unsafe { shards.part(at..at + r) };
                if add {
                    dst.iter_mut().zip(row).for_each(|(d, v)| *d += v);
                } else {
                    dst.copy_from_slice(row);
                }
            }
        });
    });
}

fn quantized_forward(q: &QMatrix, x: &Tensor) -> Result<Tensor> {
    let cols = *x.dims().last().unwrap_or(&0);
    if cols != q.cols() {
        candle_core::bail!("quantized linear: input has {cols} features, the matrix {}", q.cols());
    }
    let n = q.rows();
    let m = x.elem_count() / cols.max(1);
    if m > QUANTIZED_MATVEC_MAX_ROWS {
        return tiled_forward(&x.to_dtype(DType::F32)?, n, cols, Tiles::Quantized(q));
    }
    let mut out_dims = x.dims().to_vec();
    *out_dims.last_mut().expect("rank >= 1") = n;
    let input = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let prepared: Vec<QInput> = input.chunks(cols.max(1)).map(QMatrix::prepare).collect();
    let mut out = vec![0f32; m * n];
    let shards = Shards::new(&mut out);
    Team::global().run(n.div_ceil(TILE_ROWS), &|t| {
        let rows = t * TILE_ROWS..((t + 1) * TILE_ROWS).min(n);
        for (i, p) in prepared.iter().enumerate() {
            // SAFETY: tasks cover disjoint row ranges of each output row
            q.mul_rows(p, rows.start, unsafe { shards.part(i * n + rows.start..i * n + rows.end) });
        }
    });
    Tensor::from_vec(out, out_dims, x.device())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q4_1(rows: usize, cols: usize, seed: u64) -> QMatrix {
        let data = crate::kernels::blocks::tests::random_blocks(Format::Q4_1, rows * cols / 32, seed);
        QMatrix::new(QKind::Blocks(Format::Q4_1), rows, cols, data).unwrap()
    }

    /// A stack of a float and a quantized matrix (what a mixed-type GGUF gives): any row
    /// range of the decode view equals the same rows of the prefill product and of each
    /// part alone.
    #[test]
    fn mixed_stack_rows_match_its_parts() {
        let cols = 64;
        let w: Vec<f32> = (0..5 * cols).map(|i| ((i * 7 % 13) as f32 - 6.0) / 10.0).collect();
        let float = Linear::new(Tensor::from_vec(w, (5, cols), &Device::Cpu).unwrap());
        let quant = Linear::Quantized(q4_1(7, cols, 9));
        let stack = Linear::stack(vec![float, quant], None).unwrap();
        assert!(matches!(stack, Linear::Stack(_)));
        assert_eq!(stack.out_features(), 12);
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 - 30.0) / 17.0).collect();
        let mut slot = QInput::default();
        let input = stack.prepare(&x, &mut slot);
        let view = stack.view().unwrap();
        let mut whole = vec![0f32; 12];
        view.mul_rows(&input, 0, &mut whole);
        for (first, n) in [(0, 5), (3, 4), (5, 7), (4, 2), (11, 1)] {
            let mut part = vec![0f32; n];
            view.mul_rows(&input, first, &mut part);
            assert_eq!(part, whole[first..first + n], "rows {first}..{}", first + n);
        }
        // the prefill product (one row here: the same kernels' answers up to rounding)
        let xt = Tensor::from_vec(x.clone(), (1, cols), &Device::Cpu).unwrap();
        let y = stack.forward(&xt).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (a, b) in y.iter().zip(&whole) {
            assert!((a - b).abs() <= 2e-2 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }

    /// A product of many rows (prefill) from quantized blocks, tiled: equals the
    /// dequantized matrix's product in float64, across tile boundaries.
    #[test]
    fn tiled_quantized_product_matches_float64() {
        let (n, cols, m) = (3 * TILE_ROWS + 5, 64, QUANTIZED_MATVEC_MAX_ROWS + 3);
        let q = q4_1(n, cols, 4);
        let w = q.dequantize();
        let x: Vec<f32> = (0..m * cols).map(|i| ((i * 31 % 23) as f32 - 11.0) / 9.0).collect();
        let layer = Linear::Quantized(q);
        let y = layer.forward(&Tensor::from_vec(x.clone(), (1, m, cols), &Device::Cpu).unwrap()).unwrap();
        assert_eq!(y.dims(), &[1, m, n]);
        let y = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for i in 0..m {
            for r in 0..n {
                let want: f64 = (0..cols).map(|c| w[r * cols + c] as f64 * x[i * cols + c] as f64).sum();
                assert!((y[i * n + r] as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()), "row {i} col {r}");
            }
        }
    }

    /// `product_into` of a stack (float32 rows, then blocks) with more columns than one
    /// partial sum: each part's results land in their columns of a wider output, written
    /// or added to what is there, and equal the float64 product; the float32 part equals
    /// `forward`'s bit for bit.
    #[test]
    fn products_into_a_strided_output_match_float64() {
        let (cols, ld, col) = (2 * K_PART + 64, 2 * TILE_ROWS + 40, 3);
        // few rows (blocks multiplied as int8, as in decode) and many (dequantized tiles)
        for m in [3, 2 * QUANTIZED_MATVEC_MAX_ROWS + 1] {
            strided_products(cols, m, ld, col);
        }
    }

    fn strided_products(cols: usize, m: usize, ld: usize, col: usize) {
        let fw: Vec<f32> = (0..(TILE_ROWS + 9) * cols).map(|i| ((i * 7 % 29) as f32 - 14.0) / 40.0).collect();
        let float = Linear::new(Tensor::from_vec(fw.clone(), (TILE_ROWS + 9, cols), &Device::Cpu).unwrap());
        let q = q4_1(TILE_ROWS - 5, cols, 11);
        let qw = q.dequantize();
        let stack = Linear::stack(vec![float, Linear::Quantized(q)], None).unwrap();
        let n = stack.out_features();
        assert!(col + n <= ld);
        let w: Vec<f32> = fw.iter().chain(&qw).copied().collect();
        let x: Vec<f32> = (0..m * cols).map(|i| ((i * 31 % 23) as f32 - 11.0) / 9.0).collect();
        let before: Vec<f32> = (0..m * ld).map(|i| (i % 5) as f32).collect();
        for add in [false, true] {
            let mut out = before.clone();
            stack.product_into(&x, Out { data: &mut out, ld, col, add }).unwrap();
            for i in 0..m {
                for j in 0..ld {
                    let got = out[i * ld + j] as f64;
                    if j < col || j >= col + n {
                        assert_eq!(got, before[i * ld + j] as f64, "row {i}: column {j} outside the product changed");
                        continue;
                    }
                    let r = j - col;
                    let dot: f64 = (0..cols).map(|c| w[r * cols + c] as f64 * x[i * cols + c] as f64).sum();
                    let want = dot + if add { before[i * ld + j] as f64 } else { 0.0 };
                    // int8 activations (few rows) round each input to 1/254 of its block's largest
                    let tol = if m <= QUANTIZED_MATVEC_MAX_ROWS && r >= TILE_ROWS + 9 { 2e-2 } else { 1e-4 };
                    assert!((got - want).abs() <= tol * (1.0 + want.abs()), "{m} rows: row {i} column {j} (add {add}): {got} vs {want}");
                }
            }
        }
        let Linear::Stack(parts) = &stack else { unreachable!("a mixed stack") };
        let y = parts[0].forward(&Tensor::from_vec(x.clone(), (m, cols), &Device::Cpu).unwrap()).unwrap().to_vec2::<f32>().unwrap();
        let mut out = vec![0f32; m * ld];
        parts[0].product_into(&x, Out { data: &mut out, ld, col, add: false }).unwrap();
        for (i, row) in y.iter().enumerate() {
            assert_eq!(row[..], out[i * ld + col..][..TILE_ROWS + 9], "row {i}");
        }
    }
}
