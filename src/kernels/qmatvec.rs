//! Matrix-vector products straight from GGUF quantized blocks, for decode steps.
//!
//! candle's CPU quantized matmul has no SIMD kernel for Q4_1 and compiles its AVX2
//! kernels only when the whole crate is built for AVX2, so on a portable build it is
//! slower than float32. These kernels read the blocks as stored (Q8_0: a scale and 32
//! bytes, the half-precision scale converted to float32 once, at load; every other block
//! type byte for byte, read through [`crate::kernels::blocks`]; Q4_0 and Q4_1 on x86-64
//! the same bytes with each group of sixteen rows interleaved block by block, [`interleave`])
//! and split rows across threads. When the CPU has AVX2
//! and FMA (detected at run time), and on every 64-bit ARM CPU (NEON is part of the
//! architecture), the activations are quantized to int8 per block and multiplied as
//! integers, as llama.cpp does; otherwise a portable float32 loop runs.
//!
//! At the AVX-512 level, on CPUs with AVX512-BW and VNNI, Q4_0, Q4_1 and Q8_0 rows take
//! kernels that put sixteen rows in one register, a row per 32-bit lane, so that a
//! block's integer sum builds up in its lane without a horizontal step
//! ([`rows_q4_vnni`], [`rows_q8_0_vnni`]); the other block types (Q5_0, Q5_1, the
//! K-quants) run the AVX2 kernels' code compiled with VNNI's byte dot product in place of
//! AVX2's two-instruction one, for up to eight inputs at once ([`byte_dots`]: the same
//! integers, so the same results bit for bit).

use half::f16;

use crate::kernels::blocks::{Format, SUB};
#[cfg(target_arch = "x86_64")]
use crate::kernels::transpose::dwords_16x8;

const BLOCK: usize = 32;

/// Whether the integer kernels run (x86-64: the CPU has AVX2, FMA and F16C; aarch64:
/// always), detected once.
static SIMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QKind {
    /// repacked: float32 scales, the values as stored (the int8 kernels)
    Q8_0,
    /// any other GGUF block type, kept byte for byte as stored and read through
    /// [`Format::values`] and [`Format::scales`]
    Blocks(Format),
    /// 16-bit floats kept as stored (IEEE half or bfloat16), widened to float32 as they
    /// are multiplied
    F16,
    BF16,
}

/// A (rows, cols) matrix of quantized blocks. Q8_0 is repacked at load: the
/// half-precision block scales become float32 (`scales`, row-major) and the values stay
/// as stored (`qs`: 32 bytes per block), row-major, except that where the VNNI kernel runs
/// each whole group of [`GROUP`] rows is interleaved block by block (`grouped`,
/// [`interleave_q8_0`]; other readers go through [`QMatrix::q8_0_row_in`]). Every other
/// type is kept byte for byte as stored, row-major, except that Q4_0 and Q4_1 on x86-64
/// with the integer kernels keep each whole group of [`GROUP`] rows interleaved block by
/// block (`grouped`, [`interleave`]): the same bytes in another order, read by the
/// rows-in-lanes kernels as one stream and by every other reader through
/// [`QMatrix::stored_row`].
pub struct QMatrix {
    kind: QKind,
    rows: usize,
    cols: usize,
    scales: Vec<f32>,
    qs: Vec<u8>,
    grouped: bool,
}

/// Rows of a Q4_0 or Q4_1 matrix interleaved as one group ([`interleave`]): the
/// AVX-512 kernels' sixteen lanes (the AVX2 kernels take either half).
const GROUP: usize = 16;

/// A Q4_0 or Q4_1 block's leading bytes (its scale, and Q4_1's minimum), which come
/// before its 16 bytes of nibbles.
fn q4_head(f: Format) -> usize {
    match f {
        Format::Q4_0 => 2,
        Format::Q4_1 => 4,
        _ => unreachable!("{f:?} is not a 4-bit one-sub-block format"),
    }
}

/// Where byte `at` of row `i`'s block (of a group of [`GROUP`] rows) goes in the group's
/// interleaved block ([`interleave`]): the sixteen rows' heads side by side, then four
/// runs of 64 bytes, run `t` holding each row's nibble bytes `4t..4t + 4` in row order
/// (as a 512-bit register: lane `i`, row `i`).
fn interleaved_at(head: usize, i: usize, at: usize) -> usize {
    if at < head {
        i * head + at
    } else {
        let (t, byte) = ((at - head) / 4, (at - head) % 4);
        GROUP * head + 64 * t + 4 * i + byte
    }
}

/// Row `r` (inside a whole interleaved group) of a Q4_0 or Q4_1 matrix as stored, into
/// `out` (`row_bytes`), from its group's interleaved blocks ([`interleave`]).
fn rebuild_row(f: Format, qs: &[u8], row_bytes: usize, r: usize, out: &mut [u8]) {
    let (block, head, i) = (f.block_bytes(), q4_head(f), r % GROUP);
    let span = &qs[(r - i) * row_bytes..(r - i + GROUP) * row_bytes];
    for (run, out) in span.chunks_exact(GROUP * block).zip(out[..row_bytes].chunks_exact_mut(block)) {
        // the head, then each run of four nibble bytes ([`interleaved_at`]'s order)
        out[..head].copy_from_slice(&run[i * head..(i + 1) * head]);
        for t in 0..4 {
            let at = interleaved_at(head, i, head + 4 * t);
            out[head + 4 * t..head + 4 * t + 4].copy_from_slice(&run[at..at + 4]);
        }
    }
}

/// Interleaves every whole group of [`GROUP`] rows of a row-major Q4_0 or Q4_1 matrix
/// in place (a last group of fewer rows stays row-major): for each block, the group's
/// sixteen blocks become one run of `GROUP * block_bytes` bytes ([`interleaved_at`]), the
/// runs in block order, so the group still takes the same bytes of the matrix as before.
/// The rows-in-lanes kernels then load each register straight from one stream, where
/// the stored order needs sixteen streams and a transpose (`examples/qproducts_probe.rs`).
fn interleave(f: Format, qs: &mut [u8], rows: usize, row_bytes: usize) {
    let (bytes, head) = (f.block_bytes(), q4_head(f));
    let mut group = vec![0u8; GROUP * row_bytes];
    for g in 0..rows / GROUP {
        let span = &mut qs[g * GROUP * row_bytes..(g + 1) * GROUP * row_bytes];
        for (i, row) in span.chunks_exact(row_bytes).enumerate() {
            for (b, block) in row.chunks_exact(bytes).enumerate() {
                let run = &mut group[b * GROUP * bytes..(b + 1) * GROUP * bytes];
                for (at, &v) in block.iter().enumerate() {
                    run[interleaved_at(head, i, at)] = v;
                }
            }
        }
        span.copy_from_slice(&group);
    }
}

/// Where block `b` of row `i` of a whole group starts in a Q8_0 matrix's interleaved
/// group ([`interleave_q8_0`]): the group's sixteen rows' 32 bytes of block `b` side by
/// side, the blocks in order.
fn q8_0_interleaved_at(b: usize, i: usize) -> usize {
    (b * GROUP + i) * BLOCK
}

/// Appends row `r` of a Q8_0 matrix's values (`qs`, the first `grouped` rows interleaved
/// by [`interleave_q8_0`]) to `out` as stored, row-major: rebuilt from its group where
/// interleaved.
fn q8_0_stored_row(qs: &[u8], grouped: usize, row_bytes: usize, r: usize, out: &mut Vec<u8>) {
    if r >= grouped {
        out.extend_from_slice(&qs[r * row_bytes..(r + 1) * row_bytes]);
        return;
    }
    let group = &qs[r / GROUP * GROUP * row_bytes..][..GROUP * row_bytes];
    for b in 0..row_bytes / BLOCK {
        let at = q8_0_interleaved_at(b, r % GROUP);
        out.extend_from_slice(&group[at..at + BLOCK]);
    }
}

/// [`interleave`] for Q8_0's repacked values (32 bytes a block; the scales stay
/// row-major): every whole group of [`GROUP`] rows becomes one run of its rows' block 0,
/// then their block 1, and so on, in the same bytes of the matrix; a last group of fewer
/// rows stays row-major. The VNNI kernel ([`rows_q8_0_vnni`]) then reads a group as one
/// stream where the stored order is sixteen.
fn interleave_q8_0(qs: &mut [u8], rows: usize, row_bytes: usize) {
    let mut group = vec![0u8; GROUP * row_bytes];
    for g in 0..rows / GROUP {
        let span = &mut qs[g * GROUP * row_bytes..(g + 1) * GROUP * row_bytes];
        for (i, row) in span.chunks_exact(row_bytes).enumerate() {
            for (b, block) in row.chunks_exact(BLOCK).enumerate() {
                let at = q8_0_interleaved_at(b, i);
                group[at..at + BLOCK].copy_from_slice(block);
            }
        }
        span.copy_from_slice(&group);
    }
}

impl QKind {
    /// Bytes of one GGUF block: half-precision scales, then the quantized values.
    fn block_bytes(self) -> usize {
        2 * self.scales_per_block() + self.qs_per_block()
    }

    fn scales_per_block(self) -> usize {
        match self {
            QKind::Q8_0 => 1,
            QKind::Blocks(_) | QKind::F16 | QKind::BF16 => 0,
        }
    }

    fn qs_per_block(self) -> usize {
        match self {
            QKind::Q8_0 => 32,
            QKind::Blocks(_) | QKind::F16 | QKind::BF16 => unreachable!("kept blocks and 16-bit rows are read whole"),
        }
    }
}

impl QMatrix {
    /// From GGUF block bytes, which kept types take over as they are; the bytes back when
    /// their length does not fit the block type and shape.
    pub fn new(kind: QKind, rows: usize, cols: usize, data: Vec<u8>) -> std::result::Result<Self, Vec<u8>> {
        let fits = match kind {
            QKind::Blocks(f) => cols.is_multiple_of(f.block_values()) && data.len() == rows * (cols / f.block_values()) * f.block_bytes(),
            QKind::F16 | QKind::BF16 => data.len() == rows * cols * 2,
            QKind::Q8_0 => cols.is_multiple_of(BLOCK) && data.len() == rows * (cols / BLOCK) * kind.block_bytes(),
        };
        if !fits {
            return Err(data);
        }
        if let QKind::Blocks(f) = kind {
            return Ok(Self::kept(f, rows, cols, data, cfg!(target_arch = "x86_64") && simd()));
        }
        if matches!(kind, QKind::F16 | QKind::BF16) {
            return Ok(Self { kind, rows, cols, scales: Vec::new(), qs: data, grouped: false });
        }
        // repacked in place: each block's values move down over the scales before them
        // (never past a block not yet read), so loading holds only the new scales besides
        let (n, per, bytes) = (kind.scales_per_block(), kind.qs_per_block(), kind.block_bytes());
        let blocks = rows * cols / BLOCK;
        let mut scales = Vec::with_capacity(blocks * n);
        let mut qs = data;
        for b in 0..blocks {
            let at = b * bytes;
            for i in 0..n {
                scales.push(f16::from_bits(u16::from_le_bytes([qs[at + 2 * i], qs[at + 2 * i + 1]])).to_f32());
            }
            qs.copy_within(at + 2 * n..at + bytes, b * per);
        }
        qs.truncate(blocks * per);
        qs.shrink_to_fit();
        Ok(Self::q8_0(rows, cols, scales, qs, cfg!(target_arch = "x86_64") && has_vnni()))
    }

    /// Repacked Q8_0 blocks, each whole group of rows interleaved when `group`
    /// ([`interleave_q8_0`]: where the VNNI kernel runs; the tests build both layouts on
    /// one CPU).
    fn q8_0(rows: usize, cols: usize, scales: Vec<f32>, mut qs: Vec<u8>, group: bool) -> Self {
        if group {
            interleave_q8_0(&mut qs, rows, cols / BLOCK * QKind::Q8_0.qs_per_block());
        }
        Self { kind: QKind::Q8_0, rows, cols, scales, qs, grouped: group }
    }

    /// Kept blocks (sizes checked), Q4_0 and Q4_1 interleaved by groups of rows when
    /// `group` ([`interleave`]; the tests build both layouts on one CPU).
    fn kept(f: Format, rows: usize, cols: usize, mut qs: Vec<u8>, group: bool) -> Self {
        let grouped = group && matches!(f, Format::Q4_0 | Format::Q4_1);
        if grouped {
            interleave(f, &mut qs, rows, cols / f.block_values() * f.block_bytes());
        }
        Self { kind: QKind::Blocks(f), rows, cols, scales: Vec::new(), qs, grouped }
    }

    /// The rows kept in interleaved groups: the first ones (none when not `grouped`).
    fn grouped_rows(&self) -> usize {
        if self.grouped {
            self.rows / GROUP * GROUP
        } else {
            0
        }
    }

    /// Row `r`'s kept blocks as stored (rebuilt from its group where interleaved).
    fn stored_row(&self, r: usize) -> std::borrow::Cow<'_, [u8]> {
        if r >= self.grouped_rows() {
            return std::borrow::Cow::Borrowed(&self.qs[r * self.row_bytes()..(r + 1) * self.row_bytes()]);
        }
        let mut row = Vec::new();
        self.stored_row_in(r, &mut row);
        std::borrow::Cow::Owned(row)
    }

    /// [`QMatrix::stored_row`] with the buffer a rebuilt row goes into given, so that a
    /// loop over rows allocates once.
    fn stored_row_in<'s>(&'s self, r: usize, buffer: &'s mut Vec<u8>) -> &'s [u8] {
        let bytes = self.row_bytes();
        let QKind::Blocks(f) = self.kind else { unreachable!("only kept blocks are read as stored rows") };
        if r >= self.grouped_rows() {
            return &self.qs[r * bytes..(r + 1) * bytes];
        }
        buffer.resize(bytes, 0);
        rebuild_row(f, &self.qs, bytes, r, buffer);
        buffer
    }

    pub fn kind(&self) -> QKind {
        self.kind
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The matrix as float32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        self.dequantize_rows(0, self.rows, &mut out);
        out
    }

    /// Appends rows `first..first + n` as float32 to `out`.
    pub fn dequantize_rows(&self, first: usize, n: usize, out: &mut Vec<f32>) {
        if matches!(self.kind, QKind::F16 | QKind::BF16) {
            let bytes = &self.qs[first * self.cols * 2..(first + n) * self.cols * 2];
            let widen = if self.kind == QKind::BF16 { widen_half::<true> } else { widen_half::<false> };
            out.extend(bytes.chunks_exact(2).map(|b| widen(u16::from_le_bytes([b[0], b[1]]))));
            return;
        }
        if let QKind::Blocks(f) = self.kind {
            let start = out.len();
            out.resize(start + n * self.cols, 0.0);
            let mut row = Vec::new();
            for (r, out) in (first..first + n).zip(out[start..].chunks_exact_mut(self.cols)) {
                for (block, out) in self.stored_row_in(r, &mut row).chunks_exact(f.block_bytes()).zip(out.chunks_exact_mut(f.block_values())) {
                    f.dequantize_block(block, out);
                }
            }
            return;
        }
        debug_assert_eq!(self.kind, QKind::Q8_0);
        let mut row = Vec::new();
        for r in first..first + n {
            let Row { scales, qs } = self.q8_0_row_in(r, &mut row);
            for (&d, qs) in scales.iter().zip(qs.chunks_exact(BLOCK)) {
                out.extend(qs.iter().map(|q| d * (*q as i8) as f32));
            }
        }
    }

    /// The activations as the kernels read them: computed once per input vector and
    /// shared by every row range (and every matrix) that multiplies it.
    pub fn prepare(x: &[f32]) -> QInput {
        Self::prepare_for(x, has_vnni())
    }

    /// [`QMatrix::prepare`] with or without the per-lane forms the AVX-512 kernels read
    /// (the tests run both kernels on one CPU).
    fn prepare_for(x: &[f32], vnni: bool) -> QInput {
        let mut input = QInput::default();
        input.fill_for(x, vnni);
        input
    }
}

impl QInput {
    /// This input made [`QMatrix::prepare`]'s form of `x` in place, its buffers reused (a
    /// step of many rows prepares every row's input to each of a layer's four products
    /// again at every layer: with a new input each time, 7 allocations a row, freed by
    /// another thread than the one that made them).
    pub fn fill(&mut self, x: &[f32]) {
        self.fill_for(x, has_vnni())
    }

    fn fill_for(&mut self, x: &[f32], vnni: bool) {
        self.x.clear();
        self.x.extend_from_slice(x);
        let q8 = if simd() {
            let (mut q, mut d) = self.q8.take().unwrap_or_default();
            quantize_q8_into(x, &mut q, &mut d);
            Some((q, d))
        } else {
            None
        };
        // With int8 activations, the minimums' terms take the sums of the activations as
        // the integer products see them (int8 times scale), as llama.cpp's Q8_1 does: each
        // weight then meets the same rounded activation in both terms, and the rounding
        // enters the product through the weight's value (centred), not through its
        // unsigned integer (0..63, all one sign), which would add up the rounding errors.
        // Each such sum is its integers' exact sum times the scale, one rounding; a block's
        // integers are summed once, per half, for its half sums, its block sum and (where
        // the AVX-512 kernels run) its `starts` term, all exact.
        self.half_sums.clear();
        self.block_sums.clear();
        let mut starts = self.starts.take().unwrap_or_default();
        starts.clear();
        match &q8 {
            Some((q, d)) => {
                let int_sum = |v: &[i8]| v.iter().map(|&v| v as i32).sum::<i32>();
                for (block, &d) in q.chunks(BLOCK).zip(d) {
                    // a last block may be shorter than one half (then it has no second)
                    let (first, second) = block.split_at(block.len().min(BLOCK / 2));
                    let (a, b) = (int_sum(first), int_sum(second));
                    self.half_sums.push(a as f32 * d);
                    if !second.is_empty() {
                        self.half_sums.push(b as f32 * d);
                    }
                    let sum = a + b;
                    self.block_sums.push(sum as f32 * d);
                    if vnni {
                        starts.push(-128 * sum);
                    }
                }
            }
            None => {
                self.half_sums.extend(x.chunks(BLOCK / 2).map(|half| half.iter().sum::<f32>()));
                self.block_sums.extend(self.half_sums.chunks(2).map(|p| p.iter().sum::<f32>()));
            }
        }
        self.starts = (q8.is_some() && vnni).then_some(starts);
        self.q8 = q8;
    }
}

impl QMatrix {
    /// Bytes of values of one row (for kept blocks: of its whole blocks).
    fn row_bytes(&self) -> usize {
        match self.kind {
            QKind::Blocks(f) => self.cols / f.block_values() * f.block_bytes(),
            QKind::F16 | QKind::BF16 => self.cols * 2,
            _ => self.cols / BLOCK * self.kind.qs_per_block(),
        }
    }

    /// `out[i] = W[first + i] · x`.
    pub fn mul_rows(&self, input: &QInput, first: usize, out: &mut [f32]) {
        assert_eq!(input.x.len(), self.cols);
        assert!(first + out.len() <= self.rows);
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        if let Some(acts) = Acts::<1>::of(&[input]) {
            if !matches!(self.kind, QKind::F16 | QKind::BF16) {
                return self.rows_q8(&acts, first, &mut [out]);
            }
        }
        if matches!(self.kind, QKind::F16 | QKind::BF16) {
            let bytes = self.row_bytes();
            for (i, o) in out.iter_mut().enumerate() {
                *o = dot_half(self.kind == QKind::BF16, &self.qs[(first + i) * bytes..(first + i + 1) * bytes], &input.x);
            }
            return;
        }
        if let QKind::Blocks(f) = self.kind {
            for (i, o) in out.iter_mut().enumerate() {
                *o = dot_blocks(f, &self.stored_row(first + i), input);
            }
            return;
        }
        let mut row = Vec::new();
        for (i, o) in out.iter_mut().enumerate() {
            *o = dot_q8_0(self.q8_0_row_in(first + i, &mut row), &input.x);
        }
    }

    /// Row `r` of a Q8_0 matrix: its values rebuilt into `buffer` where its group is
    /// interleaved ([`interleave_q8_0`]), so that a loop over rows allocates once.
    fn q8_0_row_in<'s>(&'s self, r: usize, buffer: &'s mut Vec<u8>) -> Row<'s> {
        let blocks = self.cols / BLOCK;
        let (sn, qn) = (blocks * self.kind.scales_per_block(), blocks * self.kind.qs_per_block());
        let scales = &self.scales[r * sn..(r + 1) * sn];
        if r >= self.grouped_rows() {
            return Row { scales, qs: &self.qs[r * qn..(r + 1) * qn] };
        }
        buffer.clear();
        q8_0_stored_row(&self.qs, self.grouped_rows(), qn, r, buffer);
        Row { scales, qs: buffer }
    }

    /// [`QMatrix::mul_rows`] for several inputs (`outs[m]` for `inputs[m]`): with the
    /// integer kernels (x86-64, aarch64), each row is read and unpacked once for up to
    /// four inputs (eight with the x86-64 rows-in-lanes kernels, AVX2's Q8_0 kernel and
    /// the VNNI build of the other block types' kernels), every result
    /// bit-identical to `mul_rows`'s (the same arithmetic per input); the float paths run
    /// input by input.
    pub fn mul_rows_batch(&self, inputs: &[&QInput], first: usize, outs: &mut [&mut [f32]]) {
        // the AVX-512 kernels keep eight inputs' accumulators in their 32 registers; the
        // AVX2 Q4 kernel's sixteen spill some of eight inputs' to the first-level cache,
        // which costs less than unpacking every block twice (`examples/qproducts_probe.rs`
        // on an AMD EPYC Zen 3, AVX2 only, 2026-12-03: eight inputs, one thread, the o
        // matrix from the second-level cache 132-133 -> 111 ns per block, from memory
        // 115 / 89.5 -> 96.3 / 71.7, in turns); the VNNI build of the K-quant and Q5
        // kernels holds eight inputs' accumulators in 24 of its 32 registers
        let vnni = !inputs.is_empty() && inputs.iter().all(|i| i.starts.is_some());
        let width = match self.kind {
            QKind::Q8_0 | QKind::Blocks(_) if vnni => 8,
            QKind::Q8_0 | QKind::Blocks(Format::Q4_0 | Format::Q4_1) if cfg!(target_arch = "x86_64") => 8,
            _ => 4,
        };
        for (inputs, outs) in inputs.chunks(width).zip(outs.chunks_mut(width)) {
            #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
            if !matches!(self.kind, QKind::F16 | QKind::BF16) {
                let done = match inputs.len() {
                    2 => Acts::<2>::of(inputs).map(|a| self.rows_q8(&a, first, outs)),
                    3 => Acts::<3>::of(inputs).map(|a| self.rows_q8(&a, first, outs)),
                    4 => Acts::<4>::of(inputs).map(|a| self.rows_q8(&a, first, outs)),
                    5 => Acts::<5>::of(inputs).map(|a| self.rows_q8(&a, first, outs)),
                    6 => Acts::<6>::of(inputs).map(|a| self.rows_q8(&a, first, outs)),
                    7 => Acts::<7>::of(inputs).map(|a| self.rows_q8(&a, first, outs)),
                    8 => Acts::<8>::of(inputs).map(|a| self.rows_q8(&a, first, outs)),
                    _ => None,
                };
                if done.is_some() {
                    continue;
                }
            }
            for (input, out) in inputs.iter().zip(outs.iter_mut()) {
                self.mul_rows(input, first, out);
            }
        }
    }

    /// `outs[m][i] = W[first + i] · x[m]` for `M` inputs' int8 forms (x86-64 with AVX2,
    /// aarch64 with NEON): the rows-in-lanes kernels where they exist, else row by row.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn rows_q8<const M: usize>(&self, acts: &Acts<'_, M>, first: usize, outs: &mut [&mut [f32]]) {
        let n = outs[0].len();
        assert!(first + n <= self.rows && outs.len() == M && outs.iter().all(|o| o.len() == n));
        #[cfg(target_arch = "x86_64")]
        if self.rows_in_lanes(acts, first, outs) {
            return;
        }
        let mut row = Vec::new();
        for i in 0..n {
            let r = first + i;
            let dots = match self.kind {
                QKind::Blocks(f) => dot_blocks_q8(f, &self.stored_row(r), acts),
                QKind::Q8_0 => dot_q8_0_int8(self.q8_0_row_in(r, &mut row), acts),
                QKind::F16 | QKind::BF16 => unreachable!("16-bit rows multiply float32 inputs"),
            };
            for (out, dot) in outs.iter_mut().zip(dots) {
                out[i] = dot;
            }
        }
    }

    /// Rows the kernels take at once, one row per 32-bit lane ([`QMatrix::rows_in_lanes`]):
    /// a caller that splits a matrix into ranges of rows should make each range a multiple
    /// of it. A range that starts or ends inside a group still gives the same results (a
    /// row's arithmetic is its lane's), but its partial groups cost as much as whole ones,
    /// are read with gathers, and with Q4 are rebuilt from their interleaved group first:
    /// ranges of 36 rows (the o and down matrices' tasks on 2 threads) made the quantized
    /// products up to 45 % slower before the interleaving, and tasks of a multiple of 4
    /// rows run about twice as slow again since (`examples/qproducts_probe.rs`).
    pub fn row_group(&self) -> usize {
        match self.kind {
            QKind::Blocks(Format::Q4_0 | Format::Q4_1) | QKind::Q8_0 if has_vnni() => 16,
            QKind::Blocks(Format::Q4_0 | Format::Q4_1) if cfg!(target_arch = "x86_64") && simd() => 8,
            _ => 1,
        }
    }

    /// [`QMatrix::rows_q8`] for the formats with rows-in-lanes kernels (Q4_0, Q4_1; Q8_0
    /// with VNNI); false for the others.
    #[cfg(target_arch = "x86_64")]
    fn rows_in_lanes<const M: usize>(&self, acts: &Acts<'_, M>, first: usize, outs: &mut [&mut [f32]]) -> bool {
        if acts.vnni {
            let row_bytes = self.row_bytes();
            // SAFETY: per-lane forms exist only when AVX512-BW and VNNI were detected
            match self.kind {
                QKind::Blocks(Format::Q4_0) => unsafe { rows_q4_vnni::<{ Format::Q4_0 as u8 }, M>(self.q4_rows(), row_bytes, first, acts, outs) },
                QKind::Blocks(Format::Q4_1) => unsafe { rows_q4_vnni::<{ Format::Q4_1 as u8 }, M>(self.q4_rows(), row_bytes, first, acts, outs) },
                QKind::Q8_0 => unsafe { rows_q8_0_vnni::<M>(&self.scales, &self.qs, self.grouped_rows(), self.cols / BLOCK, first, acts, outs) },
                _ => return false,
            }
            return true;
        }
        // SAFETY: int8 forms exist on x86-64 only when AVX2, FMA and F16C were detected
        match self.kind {
            QKind::Blocks(Format::Q4_0) => unsafe { rows_q4_avx2::<{ Format::Q4_0 as u8 }, M>(self.q4_rows(), self.row_bytes(), first, acts, outs) },
            QKind::Blocks(Format::Q4_1) => unsafe { rows_q4_avx2::<{ Format::Q4_1 as u8 }, M>(self.q4_rows(), self.row_bytes(), first, acts, outs) },
            _ => return false,
        }
        true
    }

    /// Bytes of the kept blocks (scales and values).
    pub fn nbytes(&self) -> usize {
        self.scales.len() * 4 + self.qs.len()
    }

    /// The rows of several matrices of one block type stacked into one matrix (q, k and v
    /// read by one pass over the input); None when the types or widths differ.
    pub fn stack(parts: &[&QMatrix]) -> Option<QMatrix> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.kind != first.kind || p.cols != first.cols) {
            return None;
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        if let QKind::Blocks(f) = first.kind {
            // the rows as stored, stacked, then grouped again (a part's last rows may not
            // make a whole group): into one allocation of the stack's size, with one
            // buffer for rebuilt rows (a collected iterator of rows grew by doubling and
            // left the quantized load 20 MB more resident, `tests/test_loading.py`)
            let mut qs = Vec::with_capacity(rows * first.row_bytes());
            let mut row = Vec::new();
            for p in parts {
                for r in 0..p.rows {
                    qs.extend_from_slice(p.stored_row_in(r, &mut row));
                }
            }
            return Some(Self::kept(f, rows, first.cols, qs, first.grouped));
        }
        let scales = parts.iter().flat_map(|p| p.scales.iter().copied()).collect();
        if first.kind == QKind::Q8_0 {
            // as Q4: the rows as stored, stacked, then grouped again
            let mut qs = Vec::with_capacity(rows * first.row_bytes());
            let mut row = Vec::new();
            for p in parts {
                for r in 0..p.rows {
                    qs.extend_from_slice(p.q8_0_row_in(r, &mut row).qs);
                }
            }
            return Some(Self::q8_0(rows, first.cols, scales, qs, first.grouped));
        }
        Some(QMatrix { kind: first.kind, rows, cols: first.cols, scales, qs: parts.iter().flat_map(|p| p.qs.iter().copied()).collect(), grouped: false })
    }

    /// A Q4_0 or Q4_1 matrix's bytes for the rows-in-lanes kernels, with how its rows are
    /// kept.
    #[cfg(target_arch = "x86_64")]
    fn q4_rows(&self) -> Q4Bytes<'_> {
        Q4Bytes { qs: &self.qs, grouped: self.grouped_rows() }
    }
}

/// One input vector prepared for [`QMatrix::mul_rows`]: the floats, their sums per 16 values
/// (the K-quants' minimums apply per 16) and, when the integer kernels run, their int8
/// quantization (the sums are then those of the quantized activations).
#[derive(Clone, Default)]
pub struct QInput {
    x: Vec<f32>,
    half_sums: Vec<f32>,
    /// the sums per 32 values (two half sums added), for the one-sub-block formats' x86-64
    /// kernel
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    block_sums: Vec<f32>,
    q8: Option<(Vec<i8>, Vec<f32>)>,
    /// where the AVX-512 integer kernels run: per block of the int8 form, minus 128 times
    /// the sum of its 32 integers (the Q8_0 kernel's byte products start from it, its
    /// signed weights made unsigned by adding 128, and so end exactly at the signed
    /// products' sum)
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    starts: Option<Vec<i32>>,
}

/// Activations as int8 per 32-value block: values and one float scale per block, into
/// `q` and `d` (emptied first); whole blocks with AVX2 where the CPU has it, the same
/// integers and scales ([`quantize_block`]).
fn quantize_q8_into(x: &[f32], q: &mut Vec<i8>, d: &mut Vec<f32>) {
    q.clear();
    d.clear();
    q.resize(x.len(), 0);
    d.resize(x.len().div_ceil(BLOCK), 0.0);
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        let whole = x.len() / BLOCK * BLOCK;
        // SAFETY: AVX2 and FMA were detected at run time; the slices hold whole blocks
        unsafe { quantize_blocks_avx2(&x[..whole], &mut q[..whole], &mut d[..whole / BLOCK]) };
        if let Some(last) = d.last_mut().filter(|_| whole < x.len()) {
            *last = quantize_block(&x[whole..], &mut q[whole..]);
        }
        return;
    }
    for ((x, q), d) in x.chunks(BLOCK).zip(q.chunks_mut(BLOCK)).zip(d.iter_mut()) {
        *d = quantize_block(x, q);
    }
}

/// One block of activations as int8: `q[i] = nearest(x[i] * 127 / max |x|)`; returns the
/// scale, max |x| / 127.
fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = amax / 127.0;
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    q.iter_mut().zip(x).for_each(|(q, v)| *q = nearest(v * inv) as i8);
    scale
}

/// [`quantize_block`] for whole blocks with AVX2: the largest magnitude is exact in any
/// order, the scale and its inverse are computed as there, each value's product with the
/// inverse is the same single rounding, and [`nearest`]'s addition and bit mask run on
/// eight lanes, so the integers and scales are the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_blocks_avx2(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(x.len() == q.len() && x.len() == d.len() * BLOCK);
    let (shift, fraction, half) = (_mm256_set1_ps(12_582_912.0), _mm256_set1_epi32(0x007f_ffff), _mm256_set1_epi32(0x0040_0000));
    for (b, scale) in d.iter_mut().enumerate() {
        let v: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(x.as_ptr().add(b * BLOCK + 8 * k)));
        *scale = block_amax_avx2(&v) / 127.0;
        let inv = _mm256_set1_ps(if *scale > 0.0 { 1.0 / *scale } else { 0.0 });
        let ints: [__m256i; 4] = std::array::from_fn(|k| _mm256_sub_epi32(_mm256_and_si256(_mm256_castps_si256(_mm256_add_ps(_mm256_mul_ps(v[k], inv), shift)), fraction), half));
        _mm256_storeu_si256(q.as_mut_ptr().add(b * BLOCK) as *mut __m256i, bytes_avx2(ints));
    }
}

/// The largest magnitude of 32 floats (four registers) as `fold(0, |m, v| m.max(v.abs()))`
/// finds it, a NaN passed over (`max_ps` returns its second operand, the running maximum,
/// when either is NaN).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn block_amax_avx2(v: &[std::arch::x86_64::__m256; 4]) -> f32 {
    use std::arch::x86_64::*;
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let mut m = _mm256_setzero_ps();
    for v in v {
        m = _mm256_max_ps(_mm256_and_ps(*v, magnitude), m);
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)))
}

/// 32 integers within -128..127 in four registers of 32-bit lanes as 32 bytes, in order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn bytes_avx2(ints: [std::arch::x86_64::__m256i; 4]) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // the packs interleave 128-bit lanes: 4-byte groups come out as 0, 2, 4, 6, 1, 3, 5, 7
    let bytes = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
    _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// Round to nearest, ties to even, for |v| <= 2^22 (activations scaled to [-127, 127],
/// the 8-bit cache's queries to [-32767, 32767]), without a call to libm's `roundf`
/// (baseline x86-64 has no rounding instruction).
#[inline(always)]
pub(crate) fn nearest(v: f32) -> i32 {
    let shifted = v + 12_582_912.0; // 1.5 * 2^23: the fraction bits now hold the integer
    (shifted.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// Q8_0 row against int8 activations (signs moved onto the activations so the
/// unsigned-by-signed byte product applies), for `M` inputs at once: each block's bytes
/// loaded once, every input's arithmetic exactly that of `M = 1`. As
/// [`dot_small_q8_body`] does for the one-sub-block formats, eight blocks at a time:
/// each block's 32 products summed to eight 32-bit lanes (`maddubs`, `madd`), the eight
/// blocks' lanes folded into one register of one block's sum per lane
/// ([`fold_blocks`]), then one conversion and one multiply-add with the eight blocks' scales times
/// the activations' eight scales (per block and input one of each, and a scalar
/// multiply and a broadcast, before); a row's last blocks (fewer than eight) one by one.
/// Eight inputs a pass (was four), so the LM head of the default model (Q8_0) is read
/// once for eight. `examples/q8_0_probe.rs`, one thread, AMD EPYC Zen 3, builds in turns
/// (2 runs each, best of 15): 49,152 x 576 from memory, 8 inputs 9.37-9.40 -> 8.34-8.39
/// ns per block of a row; 576 x 576 from the second-level cache, 8 inputs 9.20-9.26 ->
/// 8.28-8.29, 1 input 1.58-1.59 -> 1.45-1.46 (from memory unchanged, 1.81-1.94).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)] // `b` addresses the weight bytes, the activations and both scales at different strides
unsafe fn dot_q8_0_avx2<const M: usize>(row: Row<'_>, acts: &Acts<'_, M>) -> [f32; M] {
    use std::arch::x86_64::*;
    let blocks = row.qs.len() / 32;
    assert!(acts.xq.iter().all(|x| x.len() >= blocks * BLOCK) && acts.xd.iter().all(|d| d.len() >= blocks) && row.scales.len() >= blocks);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); M];
    let groups = blocks / 8;
    for g in 0..groups {
        let first = row.qs.as_ptr().add(g * 8 * 32);
        for line in (0..8 * 32).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(first.wrapping_add(PREFETCH + line) as *const i8);
        }
        _mm_prefetch::<_MM_HINT_T0>(row.scales.as_ptr().wrapping_add(g * 8 + PREFETCH / 32) as *const i8);
        let q = |k: usize| _mm256_loadu_si256(first.add(k * 32) as *const __m256i);
        let unsigned: [__m256i; 8] = std::array::from_fn(|k| _mm256_sign_epi8(q(k), q(k)));
        let d = _mm256_loadu_ps(row.scales.as_ptr().add(g * 8));
        for m in 0..M {
            let x = acts.xq[m].as_ptr().add(g * 8 * BLOCK);
            // a macro, not a closure: closures are compiled without the function's target features
            macro_rules! products {
                ($k:literal) => {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned[$k], _mm256_sign_epi8(_mm256_loadu_si256(x.add($k * BLOCK) as *const __m256i), q($k))), ones)
                };
            }
            let sums = fold_blocks([products!(0), products!(1), products!(2), products!(3), products!(4), products!(5), products!(6), products!(7)]);
            let scales = _mm256_mul_ps(d, _mm256_loadu_ps(acts.xd[m].as_ptr().add(g * 8)));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scales, acc[m]);
        }
    }
    // the last blocks, one at a time
    let mut tail = [_mm256_setzero_ps(); M];
    for b in groups * 8..blocks {
        _mm_prefetch::<_MM_HINT_T0>(row.qs.as_ptr().wrapping_add(b * 32 + PREFETCH) as *const i8);
        let q = _mm256_loadu_si256(row.qs.as_ptr().add(b * 32) as *const __m256i);
        let unsigned = _mm256_sign_epi8(q, q);
        for m in 0..M {
            let x = _mm256_loadu_si256(acts.xq[m].as_ptr().add(b * BLOCK) as *const __m256i);
            let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned, _mm256_sign_epi8(x, q)), ones);
            let scale = _mm256_set1_ps(*row.scales.get_unchecked(b) * *acts.xd[m].get_unchecked(b));
            tail[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, tail[m]);
        }
    }
    std::array::from_fn(|m| hsum(acc[m]) + hsum(tail[m]))
}

/// Eight blocks' sums, each given as eight 32-bit lanes, folded into one register whose
/// lane k is block k's whole sum (horizontal adds, then the two halves added).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn fold_blocks(p: [std::arch::x86_64::__m256i; 8]) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let (s01, s23) = (_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    let (s45, s67) = (_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    // lanes: blocks 0..4's sums over their low 128 bits, then over their high
    let (lo, hi) = (_mm256_hadd_epi32(s01, s23), _mm256_hadd_epi32(s45, s67));
    _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(lo, hi), _mm256_permute2x128_si256::<0x31>(lo, hi))
}

/// One Q8_0 row against `M` inputs' int8 forms: AVX2 on x86-64, NEON on aarch64.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn dot_q8_0_int8<const M: usize>(row: Row<'_>, acts: &Acts<'_, M>) -> [f32; M] {
    // SAFETY: int8 forms exist on x86-64 only when AVX2 and FMA were detected; NEON is
    // part of aarch64; the kernels check the slices' lengths
    #[cfg(target_arch = "x86_64")]
    return unsafe { dot_q8_0_avx2(row, acts) };
    #[cfg(target_arch = "aarch64")]
    return unsafe { dot_q8_0_neon(row, acts) };
}

/// `M` prepared inputs' int8 forms side by side, for the kernels that read a row once for
/// all of them.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[cfg_attr(target_arch = "aarch64", allow(dead_code))] // the block sums and starts serve x86-64's kernels
struct Acts<'a, const M: usize> {
    xq: [&'a [i8]; M],
    xd: [&'a [f32]; M],
    half_sums: [&'a [f32]; M],
    block_sums: [&'a [f32]; M],
    /// [`QInput`]'s `starts`, empty unless every input has them (then the AVX-512 kernels run)
    starts: [&'a [i32]; M],
    vnni: bool,
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
impl<'a, const M: usize> Acts<'a, M> {
    /// None when an input has no int8 form (the integer kernels do not run).
    fn of(inputs: &[&'a QInput]) -> Option<Self> {
        debug_assert_eq!(inputs.len(), M);
        if inputs.iter().any(|i| i.q8.is_none()) {
            return None;
        }
        let q8 = |m: usize| inputs[m].q8.as_ref().expect("checked above");
        let vnni = inputs.iter().all(|i| i.starts.is_some());
        Some(Acts {
            starts: std::array::from_fn(|m| inputs[m].starts.as_deref().filter(|_| vnni).unwrap_or(&[])),
            vnni,
            xq: std::array::from_fn(|m| &q8(m).0[..]),
            xd: std::array::from_fn(|m| &q8(m).1[..]),
            half_sums: std::array::from_fn(|m| &inputs[m].half_sums[..]),
            block_sums: std::array::from_fn(|m| &inputs[m].block_sums[..]),
        })
    }
}

#[derive(Clone, Copy)]
struct Row<'a> {
    scales: &'a [f32],
    qs: &'a [u8],
}

/// Whether the AVX2 kernels run: the CPU has AVX2, FMA and F16C, and
/// [`crate::kernels::matvec::SIMD_ENV`] does not force the portable ones.
fn has_avx2_fma() -> bool {
    crate::kernels::matvec::kernel() != crate::kernels::matvec::Kernel::Portable
}

/// Whether the AVX-512 integer kernels run: the AVX-512 level is chosen
/// ([`crate::kernels::matvec::kernel`]) and the CPU has AVX512-BW, AVX512-VL and
/// AVX512-VNNI (byte dot products into 32-bit lanes), detected once.
fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *V.get_or_init(|| crate::kernels::matvec::kernel() == crate::kernels::matvec::Kernel::Avx512 && vnni_detected())
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
fn vnni_detected() -> bool {
    std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") && std::is_x86_feature_detected!("avx512vl") && std::is_x86_feature_detected!("avx512vnni")
}

/// Whether this CPU runs the int8 kernels: AVX2 + FMA + F16C on x86-64; NEON, which every
/// aarch64 CPU has, on ARM.
fn has_int8_kernels() -> bool {
    cfg!(target_arch = "aarch64") || has_avx2_fma()
}

/// The sum of the 16 products of two registers of bytes (values below 128 in magnitude:
/// each product fits 16 bits), in four 32-bit lanes.
#[cfg(target_arch = "aarch64")]
#[inline(always)]
unsafe fn dot16_neon(q: std::arch::aarch64::int8x16_t, x: std::arch::aarch64::int8x16_t) -> std::arch::aarch64::int32x4_t {
    use std::arch::aarch64::*;
    let lo = vmull_s8(vget_low_s8(q), vget_low_s8(x));
    vpadalq_s16(vpaddlq_s16(lo), vmull_high_s8(q, x))
}

/// [`dot_q8_0_avx2`] with NEON (signed bytes multiply directly).
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
#[allow(clippy::needless_range_loop)] // `b` addresses the weight bytes, the activations and both scales at different strides
unsafe fn dot_q8_0_neon<const M: usize>(row: Row<'_>, acts: &Acts<'_, M>) -> [f32; M] {
    use std::arch::aarch64::*;
    let blocks = row.qs.len() / 32;
    assert!(row.scales.len() >= blocks && (0..M).all(|m| acts.xq[m].len() >= blocks * BLOCK && acts.xd[m].len() >= blocks));
    let mut acc = [vdupq_n_f32(0.0); M];
    for b in 0..blocks {
        let q = row.qs.as_ptr().add(b * 32) as *const i8;
        let (q0, q1) = (vld1q_s8(q), vld1q_s8(q.add(16)));
        for m in 0..M {
            let x = acts.xq[m].as_ptr().add(b * BLOCK);
            let sums = vaddq_s32(dot16_neon(q0, vld1q_s8(x)), dot16_neon(q1, vld1q_s8(x.add(16))));
            acc[m] = vfmaq_n_f32(acc[m], vcvtq_f32_s32(sums), row.scales[b] * acts.xd[m][b]);
        }
    }
    acc.map(|a| vaddvq_f32(a))
}

/// [`dot_blocks_q8_avx2`] with NEON: each sub-block's integers (0..64, unpacked by
/// [`crate::kernels::blocks::values_neon`]) times the int8 activations, a half (16 values) per
/// register.
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
#[allow(clippy::needless_range_loop)] // register arrays indexed by input
unsafe fn dot_blocks_q8_neon<const F: u8, const M: usize>(row: &[u8], acts: &Acts<'_, M>) -> [f32; M] {
    use std::arch::aarch64::*;
    let f = Format::from_id(F);
    let subs = f.block_values() / SUB;
    let n = row.len() / f.block_bytes();
    assert!((0..M).all(|m| acts.xq[m].len() >= n * f.block_values() && acts.xd[m].len() >= n * subs && acts.half_sums[m].len() >= 2 * n * subs));
    let mut acc = [vdupq_n_f32(0.0); M];
    let mut offset = [0f32; M];
    for (b, block) in row.chunks_exact(f.block_bytes()).enumerate() {
        let scales = f.scales(block);
        for s in 0..subs {
            let k = b * subs + s;
            let [q_lo, q_hi] = crate::kernels::blocks::values_neon(f, block, s);
            let (q_lo, q_hi) = (vreinterpretq_s8_u8(q_lo), vreinterpretq_s8_u8(q_hi));
            let (scale, min) = (scales.scale[s], scales.min[s]);
            for m in 0..M {
                let x = acts.xq[m].as_ptr().add(k * SUB);
                let lo = vcvtq_f32_s32(dot16_neon(q_lo, vld1q_s8(x)));
                let hi = vcvtq_f32_s32(dot16_neon(q_hi, vld1q_s8(x.add(16))));
                let d = acts.xd[m][k];
                acc[m] = vfmaq_n_f32(vfmaq_n_f32(acc[m], lo, scale[0] * d), hi, scale[1] * d);
                offset[m] += min[0] * acts.half_sums[m][2 * k] + min[1] * acts.half_sums[m][2 * k + 1];
            }
        }
    }
    std::array::from_fn(|m| vaddvq_f32(acc[m]) - offset[m])
}

/// A 16-bit float (bfloat16 with `BF16`, else IEEE half) as float32, exactly.
#[inline(always)]
fn widen_half<const BF16: bool>(h: u16) -> f32 {
    if BF16 {
        f32::from_bits((h as u32) << 16)
    } else {
        crate::kernels::blocks::f16_to_f32(h)
    }
}

/// One 16-bit row (`bf16`: bfloat16, else IEEE half) against float32 activations: each
/// number widened exactly, eight partial sums; on the best path the CPU has.
fn dot_half(bf16: bool, row: &[u8], x: &[f32]) -> f32 {
    match (bf16, simd()) {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked at run time)
        #[cfg(target_arch = "x86_64")]
        (true, true) => unsafe { dot_half_avx2::<true>(row, x) },
        #[cfg(target_arch = "x86_64")]
        (false, true) => unsafe { dot_half_avx2::<false>(row, x) },
        (true, _) => dot_half_body::<true>(row, x),
        (false, _) => dot_half_body::<false>(row, x),
    }
}

/// Whether the int8 kernels run ([`SIMD`]); on x86-64 also the AVX2 16-bit kernel.
fn simd() -> bool {
    *SIMD.get_or_init(has_int8_kernels)
}

/// [`dot_half_body`] with AVX2: 16 numbers per step widened in registers (F16C's
/// conversion for halves; a 16-bit shift for bfloat16), two accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_half_avx2<const BF16: bool>(row: &[u8], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len() / 16 * 16;
    let (mut a, mut b) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let widen = |p: *const u8| {
        let h = _mm_loadu_si128(p as *const __m128i);
        if BF16 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        } else {
            _mm256_cvtph_ps(h)
        }
    };
    for i in (0..n).step_by(16) {
        let p = row.as_ptr().add(2 * i);
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH) as *const i8);
        a = _mm256_fmadd_ps(widen(p), _mm256_loadu_ps(x.as_ptr().add(i)), a);
        b = _mm256_fmadd_ps(widen(p.add(16)), _mm256_loadu_ps(x.as_ptr().add(i + 8)), b);
    }
    hsum(_mm256_add_ps(a, b)) + dot_half_body::<BF16>(&row[2 * n..], &x[n..])
}

#[inline(always)]
fn dot_half_body<const BF16: bool>(row: &[u8], x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (rc, xc) = (row.chunks_exact(16), x.chunks_exact(8));
    let mut tail = 0f32;
    for (b, v) in rc.remainder().chunks_exact(2).zip(xc.remainder()) {
        tail += widen_half::<BF16>(u16::from_le_bytes([b[0], b[1]])) * v;
    }
    for (r, v) in rc.zip(xc) {
        for l in 0..8 {
            lanes[l] += widen_half::<BF16>(u16::from_le_bytes([r[2 * l], r[2 * l + 1]])) * v[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// One row of kept blocks against float32 activations, where the integer kernels do not
/// run ([`dot_blocks_q8`] does where they do).
fn dot_blocks(f: Format, row: &[u8], input: &QInput) -> f32 {
    // each arm's kernel specialized to its format (the unpacking inlined with it constant)
    macro_rules! each {
        ($($v:ident),*) => {
            match f {
                $(Format::$v => dot_blocks_float(Format::$v, row, &input.x, &input.half_sums),)*
            }
        };
    }
    each!(Q4_0, Q4_1, Q5_0, Q5_1, Q2K, Q3K, Q4K, Q5K, Q6K)
}

/// One row of kept blocks against `M` inputs' int8 forms, the NEON kernel specialized to
/// the format (the unpacking inlined with it constant).
#[cfg(target_arch = "aarch64")]
fn dot_blocks_q8<const M: usize>(f: Format, row: &[u8], acts: &Acts<'_, M>) -> [f32; M] {
    macro_rules! each {
        ($($v:ident),*) => {
            match f {
                // SAFETY: NEON is part of aarch64; the kernel checks the slices' lengths
                $(Format::$v => unsafe { dot_blocks_q8_neon::<{ Format::$v as u8 }, M>(row, acts) },)*
            }
        };
    }
    each!(Q4_0, Q4_1, Q5_0, Q5_1, Q2K, Q3K, Q4K, Q5K, Q6K)
}

/// One row of kept blocks against `M` inputs' int8 forms, the kernel specialized to the
/// format (the unpacking inlined with it constant): the VNNI build of the kernels for
/// inputs prepared for the AVX-512 level, the AVX2 build otherwise.
#[cfg(target_arch = "x86_64")]
fn dot_blocks_q8<const M: usize>(f: Format, row: &[u8], acts: &Acts<'_, M>) -> [f32; M] {
    macro_rules! each {
        ($($v:ident),*) => {
            match (f, acts.vnni) {
                // SAFETY: int8 forms exist on x86-64 only when AVX2, FMA and F16C were
                // detected; per-lane forms (`acts.vnni`) only when AVX512-BW, VL and VNNI were
                $((Format::$v, false) if f.block_values() == SUB => unsafe { dot_small_q8_avx2::<{ Format::$v as u8 }, M>(row, acts) },
                (Format::$v, true) if f.block_values() == SUB => unsafe { dot_small_q8_vnni::<{ Format::$v as u8 }, M>(row, acts) },
                (Format::$v, false) => unsafe { dot_blocks_q8_avx2::<{ Format::$v as u8 }, M>(row, acts) },
                (Format::$v, true) => unsafe { dot_blocks_q8_vnni::<{ Format::$v as u8 }, M>(row, acts) },)*
            }
        };
    }
    each!(Q4_0, Q4_1, Q5_0, Q5_1, Q2K, Q3K, Q4K, Q5K, Q6K)
}

/// The sums of four byte products per 32-bit lane, unsigned `q` times signed `x` (every
/// pair of products within 16 bits: the kept blocks' integers are below 64): AVX2's
/// `maddubs` and `madd`, or with `VNNI` one `dpbusd`, which gives the same integers.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn byte_dots<const VNNI: bool>(q: std::arch::x86_64::__m256i, x: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    if VNNI {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x)
    } else {
        _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1))
    }
}

/// The kept-block kernels built twice: for AVX2 and, with the byte dot products of
/// AVX-512 VNNI on 256-bit registers (AVX512-VL, 32 registers), for the AVX-512 level.
#[cfg(target_arch = "x86_64")]
macro_rules! avx2_and_vnni {
    ($($avx2:ident, $vnni:ident => $body:ident;)*) => {$(
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $avx2<const F: u8, const M: usize>(row: &[u8], acts: &Acts<'_, M>) -> [f32; M] {
            $body::<F, M, false>(row, acts)
        }
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn $vnni<const F: u8, const M: usize>(row: &[u8], acts: &Acts<'_, M>) -> [f32; M] {
            $body::<F, M, true>(row, acts)
        }
    )*};
}

#[cfg(target_arch = "x86_64")]
avx2_and_vnni! {
    dot_blocks_q8_avx2, dot_blocks_q8_vnni => dot_blocks_q8_body;
    dot_small_q8_avx2, dot_small_q8_vnni => dot_small_q8_body;
}

/// Bytes of values ahead of the block being read that the integer kernels prefetch (the
/// scales, a smaller stream, proportionally fewer): the hardware prefetcher alone left
/// these kernels waiting on memory. Measured here (Q4_K_M file, 2 threads): none 58
/// tok/s, 512 B 77, 1 KB 108, 2 KB 110, 4 KB 117; 2 KB is the choice.
#[cfg(target_arch = "x86_64")]
const PREFETCH: usize = 2048;

/// Kept blocks against int8 activations, with AVX2: per sub-block, its integers unpacked
/// into one register ([`crate::kernels::blocks::values_avx2`]) and multiplied with the activations
/// as bytes (the integers are unsigned, in 0..64), summed per 4 bytes: lanes 0..4 hold the
/// first half's sums, lanes 4..8 the second's, scaled by their halves' scales times the
/// activations' scale (two accumulators, even and odd sub-blocks); minus each half's
/// minimum times the activations' sum (a block's 16 at once). For the K-quants; the
/// one-sub-block formats have [`dot_small_q8_avx2`]. `M` inputs at once, each sub-block
/// unpacked once for all of them.
/// (Built by [`avx2_and_vnni`] as `dot_blocks_q8_avx2` and `dot_blocks_q8_vnni`.)
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register arrays indexed by input
unsafe fn dot_blocks_q8_body<const F: u8, const M: usize, const VNNI: bool>(row: &[u8], acts: &Acts<'_, M>) -> [f32; M] {
    use std::arch::x86_64::*;
    let f = Format::from_id(F);
    let (subs, n) = (f.block_values() / SUB, row.len() / f.block_bytes());
    // the K-quants: 8 sub-blocks of two halves, so a block's 16 minimums and its 16
    // activation sums are two registers each
    assert!(subs == 8);
    assert!((0..M).all(|m| acts.xq[m].len() >= n * f.block_values() && acts.xd[m].len() >= n * subs && acts.half_sums[m].len() >= 2 * n * subs));
    let (mut acc0, mut acc1, mut offset) = ([_mm256_setzero_ps(); M], [_mm256_setzero_ps(); M], [_mm256_setzero_ps(); M]);
    for (b, block) in row.chunks_exact(f.block_bytes()).enumerate() {
        _mm_prefetch::<_MM_HINT_T0>(block.as_ptr().wrapping_add(PREFETCH) as *const i8);
        let scales = f.scales(block);
        let mins = scales.min.as_ptr() as *const f32;
        let (min_lo, min_hi) = (_mm256_loadu_ps(mins), _mm256_loadu_ps(mins.add(8)));
        for m in 0..M {
            let sums = acts.half_sums[m].as_ptr().add(2 * b * subs);
            offset[m] = _mm256_fmadd_ps(min_lo, _mm256_loadu_ps(sums), offset[m]);
            offset[m] = _mm256_fmadd_ps(min_hi, _mm256_loadu_ps(sums.add(8)), offset[m]);
        }
        // a macro, not a closure: closures are compiled without the function's target features
        macro_rules! sub {
            ($s:expr, $acc:ident) => {{
                let (s, k) = ($s, b * subs + $s);
                let q = crate::kernels::blocks::values_avx2(f, block, s);
                let scale = scales.scale[s];
                for m in 0..M {
                    let x = _mm256_loadu_si256(acts.xq[m].as_ptr().add(k * SUB) as *const __m256i);
                    let products = byte_dots::<VNNI>(q, x);
                    let d = *acts.xd[m].get_unchecked(k);
                    let sv = _mm256_setr_m128(_mm_set1_ps(scale[0] * d), _mm_set1_ps(scale[1] * d));
                    $acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), sv, $acc[m]);
                }
            }};
        }
        for s in (0..subs).step_by(2) {
            sub!(s, acc0);
            sub!(s + 1, acc1);
        }
    }
    std::array::from_fn(|m| hsum(_mm256_add_ps(acc0[m], acc1[m])) - hsum(offset[m]))
}

/// [`dot_blocks_q8_avx2`] for the formats whose block is one 32-value sub-block (Q4_0,
/// Q4_1, Q5_0, Q5_1), where the work per block and input is most of the work, so it is
/// done for eight blocks at once: each block's 32 byte products summed to eight 32-bit
/// lanes (`maddubs`, `madd`), the eight blocks' lanes folded by horizontal adds into one
/// register holding one block's sum per lane, then one conversion and one multiply-add
/// with the eight blocks' scales times the activations' eight scales; the minimums'
/// terms likewise (eight minimums times the activations' eight block sums). The blocks'
/// half-precision numbers are widened eight at a time and each block is unpacked once,
/// for all `M` inputs. A row's last blocks (fewer than eight) run one by one.
/// (Built by [`avx2_and_vnni`] as `dot_small_q8_avx2` and `dot_small_q8_vnni`.)
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register arrays indexed by input and block
unsafe fn dot_small_q8_body<const F: u8, const M: usize, const VNNI: bool>(row: &[u8], acts: &Acts<'_, M>) -> [f32; M] {
    use std::arch::x86_64::*;
    let f = Format::from_id(F);
    let (bytes, n) = (f.block_bytes(), row.len() / f.block_bytes());
    assert!(f.block_values() == SUB);
    assert!((0..M).all(|m| acts.xq[m].len() >= n * SUB && acts.xd[m].len() >= n && acts.block_sums[m].len() >= n));
    let (mut acc, mut offset) = ([_mm256_setzero_ps(); M], [_mm256_setzero_ps(); M]);
    let groups = n / 8;
    for g in 0..groups {
        let first = row.as_ptr().add(g * 8 * bytes);
        _mm_prefetch::<_MM_HINT_T0>(first.wrapping_add(PREFETCH) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(first.wrapping_add(PREFETCH + 64) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(first.wrapping_add(PREFETCH + 128) as *const i8);
        let (mut dh, mut sh) = ([0u16; 8], [0u16; 8]);
        let mut q = [_mm256_setzero_si256(); 8];
        for k in 0..8 {
            let p = first.add(k * bytes);
            dh[k] = std::ptr::read_unaligned(p as *const u16);
            sh[k] = std::ptr::read_unaligned(p.add(2) as *const u16);
            q[k] = crate::kernels::blocks::values_avx2(f, std::slice::from_raw_parts(p, bytes), 0);
        }
        let d = _mm256_cvtph_ps(_mm_loadu_si128(dh.as_ptr() as *const __m128i));
        let min = match f {
            Format::Q4_0 => _mm256_mul_ps(d, _mm256_set1_ps(8.0)),
            Format::Q5_0 => _mm256_mul_ps(d, _mm256_set1_ps(16.0)),
            _ => _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128(sh.as_ptr() as *const __m128i))),
        };
        for m in 0..M {
            let x = acts.xq[m].as_ptr().add(g * 8 * SUB);
            // a macro, not a closure: closures are compiled without the function's target features
            macro_rules! products {
                ($k:literal) => {
                    byte_dots::<VNNI>(q[$k], _mm256_loadu_si256(x.add($k * SUB) as *const __m256i))
                };
            }
            let sums = fold_blocks([products!(0), products!(1), products!(2), products!(3), products!(4), products!(5), products!(6), products!(7)]);
            let scales = _mm256_mul_ps(d, _mm256_loadu_ps(acts.xd[m].as_ptr().add(g * 8)));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scales, acc[m]);
            offset[m] = _mm256_fmadd_ps(min, _mm256_loadu_ps(acts.block_sums[m].as_ptr().add(g * 8)), offset[m]);
        }
    }
    // the last blocks, one at a time
    let (mut tail, mut tail_offset) = ([_mm256_setzero_ps(); M], [0f32; M]);
    for b in groups * 8..n {
        let p = row.as_ptr().add(b * bytes);
        let halves = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)));
        let (d, second) = (_mm_cvtss_f32(halves), _mm_cvtss_f32(_mm_movehdup_ps(halves)));
        let q = crate::kernels::blocks::values_avx2(f, std::slice::from_raw_parts(p, bytes), 0);
        let min = f.small_min(d, second);
        for m in 0..M {
            let x = _mm256_loadu_si256(acts.xq[m].as_ptr().add(b * SUB) as *const __m256i);
            let sums = byte_dots::<VNNI>(q, x);
            tail[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d * *acts.xd[m].get_unchecked(b)), tail[m]);
            tail_offset[m] += min * *acts.block_sums[m].get_unchecked(b);
        }
    }
    std::array::from_fn(|m| (hsum(acc[m]) - hsum(offset[m])) + (hsum(tail[m]) - tail_offset[m]))
}

/// Q8_0 rows against int8 activations with AVX-512 VNNI, sixteen rows at once, one row
/// per 32-bit lane, as [`rows_q4_vnni`]: for each block, eight registers of the rows'
/// bytes `4t..4t + 4` (each row's 32 bytes loaded and transposed in registers,
/// [`dwords_16x8`], from one run of 512 bytes where the first `grouped` rows are
/// interleaved ([`interleave_q8_0`]: the LM head of the default model from memory, one
/// input, 1.74-1.98 -> 1.16-1.36 ns a block-row, eight inputs 2.90-3.34 -> 2.38-2.58,
/// `examples/q8_0_probe.rs`, AMD EPYC Zen 4, 2026-12-07, three runs each in turns);
/// gathered for a last group of fewer than sixteen rows: on an AMD EPYC
/// Zen 4, whose gathers are slow, the loads took a block of one row for one input from
/// 2.8 to 0.8 ns from the second-level cache and from 2.8 to 1.3-1.4 from memory, for
/// eight inputs 3.9 -> 1.8 and 4.1 -> 2.7-2.9, `examples/q8_0_probe.rs` in turns; on the
/// Intel Xeon they had measured the same as the gathers), made unsigned by adding 128
/// (one exclusive or), each input's
/// eight byte dot products starting from minus 128 times its block's activation sum
/// (which the additions put back), so that every lane ends at the signed products' sum
/// exactly; then one conversion and one multiply-add with the rows' scales times the
/// activations' scale (a full group's scales of eight blocks loaded and transposed
/// together, as its bytes are: one block-row for one input from the second-level cache
/// 0.87 -> 0.75 ns on the Zen 4, the rest the same within noise; gathered otherwise).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::needless_range_loop)] // register arrays indexed by input
unsafe fn rows_q8_0_vnni<const M: usize>(scales: &[f32], qs: &[u8], grouped: usize, blocks: usize, first: usize, acts: &Acts<'_, M>, outs: &mut [&mut [f32]]) {
    use std::arch::x86_64::*;
    let (row_bytes, rows) = (blocks * 32, outs[0].len());
    assert!(qs.len() >= (first + rows) * row_bytes && scales.len() >= (first + rows) * blocks && row_bytes * 16 <= i32::MAX as usize);
    assert!(grouped.is_multiple_of(GROUP) && grouped * row_bytes <= qs.len());
    // the rows of a range that starts or ends inside an interleaved group, rebuilt
    // row-major (callers split matrices by `row_group`, so this is a range's edge at most)
    let mut rebuilt = Vec::new();
    assert!((0..M).all(|m| outs[m].len() == rows && acts.xq[m].len() >= blocks * BLOCK && acts.xd[m].len() >= blocks && acts.starts[m].len() >= blocks));
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let (offsets, scale_offsets) = (_mm512_mullo_epi32(lanes, _mm512_set1_epi32(row_bytes as i32)), _mm512_mullo_epi32(lanes, _mm512_set1_epi32(blocks as i32)));
    let flip = _mm512_set1_epi8(-128);
    for g in (0..rows).step_by(16) {
        let mask: __mmask16 = if rows - g >= 16 { 0xFFFF } else { (1u16 << (rows - g)) - 1 };
        let (r0, k) = (first + g, (rows - g).min(GROUP));
        let stored = qs.as_ptr().add(r0 * row_bytes);
        // where this group's bytes are read from, and whether as one interleaved group
        let (base, interleaved) = if r0 >= grouped {
            (stored, false)
        } else if r0.is_multiple_of(GROUP) && k == GROUP {
            (stored, true)
        } else {
            rebuilt.clear();
            for r in r0..r0 + k {
                q8_0_stored_row(qs, grouped, row_bytes, r, &mut rebuilt);
            }
            (rebuilt.as_ptr(), false)
        };
        let scale_base = scales.as_ptr().add(r0 * blocks);
        let (next, next_scales) = (stored.wrapping_add(16 * row_bytes), scale_base.wrapping_add(16 * blocks) as *const u8);
        let mut acc = [_mm512_setzero_ps(); M];
        // the rows' scales of eight blocks at a time (register k: block b + k's)
        let mut scales8 = [_mm512_setzero_ps(); 8];
        for b in 0..blocks {
            if b % 8 == 0 {
                scales8 = if mask == 0xFFFF && b + 8 <= blocks {
                    // a full group: each row's eight scales loaded and transposed in registers
                    dwords_16x8(&std::array::from_fn(|r| _mm256_loadu_si256(scale_base.add(r * blocks + b) as *const __m256i))).map(|x| _mm512_castsi512_ps(x))
                } else {
                    std::array::from_fn(|k| if b + k < blocks { _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), mask, scale_offsets, scale_base.add(b + k) as *const _) } else { _mm512_setzero_ps() })
                };
            }
            // the next group's bytes and scales, a block's share of them at each block,
            // into the second-level cache: with rows of 1,536 values a group is 24 KB, and
            // two of them do not stay in a first level of 32 KB (an all-Q8_0 file on the
            // Zen 4, in turns: a decode step on 1 thread 12.6-15.0 -> 11.2-11.7 ms, eight
            // sequences on 2 threads 630-666 -> 702-723 tok/s)
            for line in (0..16 * 32).step_by(64) {
                _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(b * 16 * 32 + line) as *const i8);
            }
            _mm_prefetch::<_MM_HINT_T1>(next_scales.wrapping_add(b * 64) as *const i8);
            let p = base.add(b * 32);
            let words: [__m512i; 8] = if interleaved {
                // an interleaved group: its rows' 32 bytes side by side, transposed
                dwords_16x8(&std::array::from_fn(|r| _mm256_loadu_si256(base.add(q8_0_interleaved_at(b, r)) as *const __m256i)))
            } else if mask == 0xFFFF {
                // a full group: each row's 32 bytes loaded and transposed in registers
                dwords_16x8(&std::array::from_fn(|r| _mm256_loadu_si256(p.add(r * row_bytes) as *const __m256i)))
            } else {
                std::array::from_fn(|t| _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), mask, offsets, p.add(4 * t) as *const _))
            };
            let q: [__m512i; 8] = std::array::from_fn(|t| _mm512_xor_si512(words[t], flip));
            let d = scales8[b % 8];
            for m in 0..M {
                let x = acts.xq[m].as_ptr().add(b * BLOCK) as *const i32;
                let xs = |t: usize| _mm512_set1_epi32(std::ptr::read_unaligned(x.add(t)));
                // two chains of four (integer sums: exact in any order)
                let (mut even, mut odd) = (_mm512_set1_epi32(*acts.starts[m].get_unchecked(b)), _mm512_setzero_si512());
                for t in (0..8).step_by(2) {
                    even = _mm512_dpbusd_epi32(even, q[t], xs(t));
                    odd = _mm512_dpbusd_epi32(odd, q[t + 1], xs(t + 1));
                }
                let sums = _mm512_add_epi32(even, odd);
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(d, _mm512_set1_ps(*acts.xd[m].get_unchecked(b))), acc[m]);
            }
        }
        for m in 0..M {
            _mm512_mask_storeu_ps(outs[m].as_mut_ptr().add(g), mask, acc[m]);
        }
    }
}

/// What the Q4_0 / Q4_1 rows-in-lanes kernels need of a block format, checked against
/// the matrix, the inputs and the outputs they are given.
/// Whether a Q4 kernel's pass of one input over interleaved groups (one stream, as the
/// float32 kernels' rows read one at a time) asks for the next group ahead: as the
/// float32 prefetch level says ([`crate::kernels::matvec::Prefetch::one_input`]). On an
/// AMD EPYC Zen 4 (`l2`: no), a quantized decode step after 300 tokens on one thread took
/// 5.7-6.6 ms against 6.4-7.0 with the requests, and in a slower minute 6.6-7.7 against
/// 7.5-8.1 (four rounds each, in turns); on two threads the same within noise. An
/// interleaved group is one stream the hardware prefetcher follows; the requests hold
/// first-level miss buffers the memory's latency long.
#[cfg(target_arch = "x86_64")]
fn one_input_prefetch(avx512: bool) -> bool {
    crate::kernels::matvec::prefetch().one_input(true, avx512)
}

/// A Q4_0 or Q4_1 matrix's bytes as the rows-in-lanes kernels read them: its first
/// `grouped` rows in interleaved groups ([`interleave`]), the rest row-major.
#[cfg(target_arch = "x86_64")]
struct Q4Bytes<'a> {
    qs: &'a [u8],
    grouped: usize,
}

#[cfg(target_arch = "x86_64")]
impl Q4Bytes<'_> {
    /// Where the kernel reads `count` rows from `first` row-major: in place, or rebuilt
    /// into `buffer` when some of them are interleaved but not as one group the kernel
    /// takes whole (a range of rows that starts or ends inside a group).
    fn row_major(&self, f: Format, row_bytes: usize, first: usize, count: usize, buffer: &mut Vec<u8>) -> *const u8 {
        if first >= self.grouped {
            return self.qs[first * row_bytes..].as_ptr();
        }
        buffer.resize(count * row_bytes, 0);
        for (i, out) in buffer.chunks_exact_mut(row_bytes).enumerate() {
            let r = first + i;
            if r < self.grouped {
                rebuild_row(f, self.qs, row_bytes, r, out);
            } else {
                out.copy_from_slice(&self.qs[r * row_bytes..(r + 1) * row_bytes]);
            }
        }
        buffer.as_ptr()
    }
}

#[cfg(target_arch = "x86_64")]
struct Q4Rows {
    /// bytes per block, and where its 16 bytes of nibbles start (after the scales)
    bytes: usize,
    values_at: usize,
    /// blocks per row, rows to compute
    n: usize,
    rows: usize,
}

#[cfg(target_arch = "x86_64")]
impl Q4Rows {
    fn checked<const M: usize>(f: Format, qs: &[u8], row_bytes: usize, first: usize, acts: &Acts<'_, M>, outs: &[&mut [f32]]) -> Q4Rows {
        let (bytes, values_at) = (f.block_bytes(), q4_head(f));
        let (n, rows) = (row_bytes / bytes, outs[0].len());
        assert!(row_bytes.is_multiple_of(bytes) && qs.len() >= (first + rows) * row_bytes);
        assert!((0..M).all(|m| outs[m].len() == rows && acts.xq[m].len() >= n * SUB && acts.xd[m].len() >= n && acts.block_sums[m].len() >= n));
        Q4Rows { bytes, values_at, n, rows }
    }
}

/// Q4_0 and Q4_1 rows against int8 activations with AVX-512 VNNI, sixteen rows at once,
/// one row per 32-bit lane: for each block, the sixteen rows' 16 bytes of nibbles become
/// four registers (lane `r`: row `r`'s bytes `4t..4t + 4`), whose low and high nibbles are the block's values
/// `4t..4t + 4` and `16 + 4t..`; the rows' scales (and minimums) are loaded and
/// transposed the same way (a gather of sixteen before: 13 % of the kernel on Zen 5).
/// Each input's block is then eight byte dot products against its activations' matching
/// four bytes (broadcast), which sum the block in every lane exactly, as integers, with
/// no horizontal step; then, per block and input for sixteen rows, one conversion and
/// the two multiply-adds of [`rows_q4_avx2`] in its order (the rows' scales times the
/// activations' scale, then the minimums' term), so that both levels give the same bits.
/// A row's arithmetic is its own lane's, whatever rows share the register and however
/// many inputs run.
///
/// An interleaved group ([`interleave`]) gives the heads and the four registers as five
/// plain loads from one stream per block. Rows kept row-major (a last group of fewer
/// than sixteen, or rows of a range that starts or ends inside a group, rebuilt first)
/// are loaded and transposed as 4 x 4 dwords within each 128-bit lane, or gathered for
/// fewer than sixteen rows (the loads made a quantized decode step 2-4 % faster than
/// four gathers, and the scales' loads, a gather of sixteen before, saved 13 % of the
/// kernel on Zen 5). `examples/qproducts_probe.rs`, AMD EPYC Zen 4, ns per block of 16 x
/// 32, two runs of 5 rounds, builds in turns, stored layout -> interleaved: one thread,
/// from memory, 1 input 27.8-34.2 -> 25.1-26.0 and 8 inputs 39.0-49.2 -> 40.5-41.0; the
/// o matrix hot, 12.6-16.7 -> 7.9-8.2 and 29.2-35.8 -> 26.6-27.7; two threads from
/// memory 41.0-43.4 -> 30.9-35.7 and 60.4-65.6 -> 49.2-51.6.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
#[allow(clippy::needless_range_loop)] // register arrays indexed by input
unsafe fn rows_q4_vnni<const F: u8, const M: usize>(q4: Q4Bytes<'_>, row_bytes: usize, first: usize, acts: &Acts<'_, M>, outs: &mut [&mut [f32]]) {
    use std::arch::x86_64::*;
    let f = Format::from_id(F);
    let Q4Rows { bytes, values_at, n, rows } = Q4Rows::checked(f, q4.qs, row_bytes, first, acts, outs);
    assert!(row_bytes * 16 <= i32::MAX as usize);
    let offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(row_bytes as i32));
    let low4 = _mm512_set1_epi8(0x0F);
    let mut rebuilt = Vec::new();
    for g in (0..rows).step_by(16) {
        let (row, count) = (first + g, (rows - g).min(16));
        let mask: __mmask16 = if count == 16 { 0xFFFF } else { (1u16 << count) - 1 };
        // one interleaved group, read as it is kept; any other rows row-major
        let whole = row.is_multiple_of(GROUP) && row + GROUP <= q4.grouped && count == 16;
        let at = q4.qs.as_ptr().add(row * row_bytes);
        let base = if whole { at } else { q4.row_major(f, row_bytes, row, count, &mut rebuilt) };
        let mut acc = [_mm512_setzero_ps(); M];
        // the sixteen rows are one stretch of memory (in either layout): the next group's,
        // a block's share of it at each block (one input's interleaved groups, one
        // stream, as the prefetch level says of one row at a time)
        let ahead = M > 1 || !whole || one_input_prefetch(true);
        let (next, share) = (at.wrapping_add(16 * row_bytes), 16 * bytes);
        let asked = if ahead { share } else { 0 };
        for b in 0..n {
            let p = base.add(b * bytes);
            for line in (0..asked).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(b * share + line) as *const i8);
            }
            // a macro, not a closure: closures are compiled without the function's target features
            macro_rules! gather {
                ($at:expr) => {
                    _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), mask, offsets, p.add($at) as *const _)
                };
            }
            let (heads, packed) = if whole {
                // the group's block: the sixteen heads, then the nibbles as the four
                // registers ([`interleave`]); a Q4_0 head (the scale alone) widened to
                // the dword the transposed loads give
                let run = base.add(b * share);
                let heads = match f {
                    Format::Q4_0 => _mm512_cvtepu16_epi32(_mm256_loadu_si256(run as *const __m256i)),
                    _ => _mm512_loadu_si512(run as *const _),
                };
                let nibbles = run.add(GROUP * values_at);
                (heads, std::array::from_fn(|t| _mm512_loadu_si512(nibbles.add(64 * t) as *const _)))
            } else if mask == 0xFFFF {
                // a full group: each row's 16 bytes at `at` loaded (rows k, k + 4, k + 8,
                // k + 12 in the four 128-bit lanes of the k-th register) and transposed as
                // 4 x 4 dwords within each lane, which gives lane r row r's bytes
                // at + 4t..at + 4t + 4 in the t-th register, as gathers would
                macro_rules! lanes {
                    ($at:expr, $k:expr) => {{
                        let row = |r: usize| p.add(r * row_bytes + $at) as *const __m128i;
                        let v = _mm512_castsi128_si512(_mm_loadu_si128(row($k)));
                        let v = _mm512_inserti32x4::<1>(v, _mm_loadu_si128(row($k + 4)));
                        let v = _mm512_inserti32x4::<2>(v, _mm_loadu_si128(row($k + 8)));
                        _mm512_inserti32x4::<3>(v, _mm_loadu_si128(row($k + 12)))
                    }};
                }
                let (z0, z1, z2, z3) = (lanes!(values_at, 0), lanes!(values_at, 1), lanes!(values_at, 2), lanes!(values_at, 3));
                let (t0, t1) = (_mm512_unpacklo_epi32(z0, z1), _mm512_unpackhi_epi32(z0, z1));
                let (t2, t3) = (_mm512_unpacklo_epi32(z2, z3), _mm512_unpackhi_epi32(z2, z3));
                // the scales' dwords (the first of each row's block) the same way, from the
                // same cache lines
                let (h0, h1, h2, h3) = (lanes!(0, 0), lanes!(0, 1), lanes!(0, 2), lanes!(0, 3));
                let heads = _mm512_unpacklo_epi64(_mm512_unpacklo_epi32(h0, h1), _mm512_unpacklo_epi32(h2, h3));
                (heads, [_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2), _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)])
            } else {
                (gather!(0), [gather!(values_at), gather!(values_at + 4), gather!(values_at + 8), gather!(values_at + 12)])
            };
            let q: [__m512i; 8] = std::array::from_fn(|t| if t < 4 { _mm512_and_si512(packed[t], low4) } else { _mm512_and_si512(_mm512_srli_epi16::<4>(packed[t - 4]), low4) });
            let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(heads));
            // what each row adds per unit of the activations' block sum: its minimum
            // (Q4_1), or minus 8 times its scale (Q4_0's offset of 8), as in rows_q4_avx2
            let add = match f {
                Format::Q4_0 => _mm512_mul_ps(d, _mm512_set1_ps(-8.0)),
                _ => _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(heads))),
            };
            for m in 0..M {
                let x = acts.xq[m].as_ptr().add(b * SUB) as *const i32;
                let xs = |t: usize| _mm512_set1_epi32(std::ptr::read_unaligned(x.add(t)));
                // integer sums, exact in any order: two chains of four for one or two
                // inputs (the dot products' latency), one chain of eight for more (fewer
                // registers; the inputs' chains overlap)
                let sums = if M < 4 {
                    let (mut even, mut odd) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                    for t in (0..8).step_by(2) {
                        even = _mm512_dpbusd_epi32(even, q[t], xs(t));
                        odd = _mm512_dpbusd_epi32(odd, q[t + 1], xs(t + 1));
                    }
                    _mm512_add_epi32(even, odd)
                } else {
                    let mut sums = _mm512_setzero_si512();
                    for t in 0..8 {
                        sums = _mm512_dpbusd_epi32(sums, q[t], xs(t));
                    }
                    sums
                };
                // the arithmetic of rows_q4_avx2 lane for lane: the two levels agree bit for bit
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(d, _mm512_set1_ps(*acts.xd[m].get_unchecked(b))), acc[m]);
                acc[m] = _mm512_fmadd_ps(add, _mm512_set1_ps(*acts.block_sums[m].get_unchecked(b)), acc[m]);
            }
        }
        for m in 0..M {
            _mm512_mask_storeu_ps(outs[m].as_mut_ptr().add(g), mask, acc[m]);
        }
    }
}

/// [`rows_q4_vnni`] for AVX2 (no VNNI, no gathers): eight rows at once, one row per
/// 32-bit lane, four registers whose lane `r` holds row `r`'s bytes `4t..4t + 4`: one
/// half of an interleaved group ([`interleave`]) as five plain loads per block (the
/// `half`-th 256 bits of each of the group's 512-bit runs), other rows loaded and
/// transposed (two rows per register, then two rounds of interleaving). Each input's block is
/// eight unsigned-by-signed byte products (`maddubs`) against its activations' matching
/// four bytes (broadcast), added as 16-bit sums (at most 8 · 2 · 15 · 127 = 30,480:
/// no overflow) and widened once, so every lane holds its row's block sum exactly. Then
/// per block and input one conversion and two multiply-adds (the rows' scales times the
/// activations' scale, and the minimums' term) for eight rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // register arrays indexed by input
unsafe fn rows_q4_avx2<const F: u8, const M: usize>(q4: Q4Bytes<'_>, row_bytes: usize, first: usize, acts: &Acts<'_, M>, outs: &mut [&mut [f32]]) {
    use std::arch::x86_64::*;
    let f = Format::from_id(F);
    let Q4Rows { bytes, values_at, n, rows } = Q4Rows::checked(f, q4.qs, row_bytes, first, acts, outs);
    let (low4, low16, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi32(0xFFFF), _mm256_set1_epi16(1));
    let mut rebuilt = Vec::new();
    for g in (0..rows).step_by(8) {
        let (row, count) = (first + g, (rows - g).min(8));
        // half `half` of one interleaved group, read as it is kept (the group's other half
        // shares its cache lines); any other rows row-major
        let (group, half) = (row / GROUP * GROUP, row % GROUP / 8);
        let whole = row.is_multiple_of(8) && group + GROUP <= q4.grouped && count == 8;
        let base = if whole { q4.qs.as_ptr().add(group * row_bytes) } else { q4.row_major(f, row_bytes, row, count, &mut rebuilt) };
        // a last group of fewer than eight rows reads its last row again in the spare lanes
        let row_at: [*const u8; 8] = std::array::from_fn(|r| base.add(r.min(count - 1) * row_bytes));
        // the rows are one stretch of memory (in either layout): the next group's, a
        // block's share of it at each block (an interleaved group's whole stretch while
        // its first half is read)
        let (next, share) = match (whole, half) {
            (true, 0) if M > 1 || one_input_prefetch(false) => (base.wrapping_add(GROUP * row_bytes), GROUP * bytes),
            (true, _) => (base, 0),
            _ => (q4.qs.as_ptr().wrapping_add((row + 8) * row_bytes), 8 * bytes),
        };
        let mut acc = [_mm256_setzero_ps(); M];
        for b in 0..n {
            for line in (0..share).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(b * share + line) as *const i8);
            }
            let (head, packed) = if whole {
                // the group's block: the heads, then the nibbles as four 512-bit registers
                // ([`interleave`]), this half's eight rows the `half`-th 256 bits of each;
                // a Q4_0 head (the scale alone) widened to the dword the rows' reads give
                let run = base.add(b * GROUP * bytes);
                let head = match f {
                    Format::Q4_0 => _mm256_cvtepu16_epi32(_mm_loadu_si128(run.add(16 * half) as *const __m128i)),
                    _ => _mm256_loadu_si256(run.add(32 * half) as *const __m256i),
                };
                let nibbles = run.add(GROUP * values_at + 32 * half);
                (head, std::array::from_fn(|t| _mm256_loadu_si256(nibbles.add(64 * t) as *const __m256i)))
            } else {
                let at = |r: usize| row_at[r].add(b * bytes);
                let load = |r: usize| _mm_loadu_si128(at(r).add(values_at) as *const __m128i);
                // rows r and r + 4 in one register
                let z: [__m256i; 4] = std::array::from_fn(|r| _mm256_set_m128i(load(r + 4), load(r)));
                let (t0, t1) = (_mm256_unpacklo_epi32(z[0], z[1]), _mm256_unpackhi_epi32(z[0], z[1]));
                let (t2, t3) = (_mm256_unpacklo_epi32(z[2], z[3]), _mm256_unpackhi_epi32(z[2], z[3]));
                // the eight rows' first four bytes: the scale and (Q4_1) the minimum, as
                // half-precision numbers; read as one register, not through memory
                let h = |r: usize| std::ptr::read_unaligned(at(r) as *const i32);
                let head = _mm256_setr_epi32(h(0), h(1), h(2), h(3), h(4), h(5), h(6), h(7));
                // packed[t], lane r: row r's bytes 4t..4t + 4
                (head, [_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2), _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)])
            };
            // lanes 0..8: the eight scales; 8..16: the eight second halves
            let halves = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(_mm256_and_si256(head, low16), _mm256_srli_epi32::<16>(head)));
            let d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
            // what each row adds per unit of the activations' block sum: its minimum
            // (Q4_1), or minus 8 times its scale (Q4_0's offset of 8)
            let add = match f {
                Format::Q4_0 => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
                _ => _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(halves)),
            };
            let low: [__m256i; 4] = std::array::from_fn(|t| _mm256_and_si256(packed[t], low4));
            let high: [__m256i; 4] = std::array::from_fn(|t| _mm256_and_si256(_mm256_srli_epi16::<4>(packed[t]), low4));
            // input by input, so that one input's sums stay in a register
            for m in 0..M {
                let x = acts.xq[m].as_ptr().add(b * SUB) as *const i32;
                let mut sums = _mm256_setzero_si256();
                for t in 0..4 {
                    let (xl, xh) = (_mm256_set1_epi32(std::ptr::read_unaligned(x.add(t))), _mm256_set1_epi32(std::ptr::read_unaligned(x.add(4 + t))));
                    sums = _mm256_add_epi16(sums, _mm256_add_epi16(_mm256_maddubs_epi16(low[t], xl), _mm256_maddubs_epi16(high[t], xh)));
                }
                let block = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, ones));
                acc[m] = _mm256_fmadd_ps(block, _mm256_mul_ps(d, _mm256_set1_ps(*acts.xd[m].get_unchecked(b))), acc[m]);
                acc[m] = _mm256_fmadd_ps(add, _mm256_set1_ps(*acts.block_sums[m].get_unchecked(b)), acc[m]);
            }
        }
        for m in 0..M {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc[m]);
            outs[m][g..g + count].copy_from_slice(&lanes[..count]);
        }
    }
}

/// Kept blocks against float32 activations (CPUs without AVX2), the same sums in float.
#[inline(always)]
fn dot_blocks_float(f: Format, row: &[u8], x: &[f32], half_sums: &[f32]) -> f32 {
    let subs = f.block_values() / SUB;
    let (mut total, mut offset) = (0f32, 0f32);
    for (b, block) in row.chunks_exact(f.block_bytes()).enumerate() {
        let scales = f.scales(block);
        for s in 0..subs {
            let (q, scale, min) = (f.values(block, s), scales.scale[s], scales.min[s]);
            let k = b * subs + s;
            let xs = &x[k * SUB..][..SUB];
            let (mut lo, mut hi) = ([0f32; 8], [0f32; 8]);
            for l in 0..SUB / 2 {
                lo[l % 8] += q[l] as f32 * xs[l];
                hi[l % 8] += q[l + SUB / 2] as f32 * xs[l + SUB / 2];
            }
            total += scale[0] * lo.iter().sum::<f32>() + scale[1] * hi.iter().sum::<f32>();
            offset += min[0] * half_sums[2 * k] + min[1] * half_sums[2 * k + 1];
        }
    }
    total - offset
}

/// One Q8_0 row: value = d * q.
#[inline(always)]
fn dot_q8_0(row: Row<'_>, x: &[f32]) -> f32 {
    let mut total = [0f32; 8];
    for ((qs, xs), d) in row.qs.chunks_exact(32).zip(x.chunks_exact(BLOCK)).zip(row.scales) {
        let mut lanes = [0f32; 8];
        for group in 0..4 {
            for k in 0..8 {
                lanes[k] += (qs[group * 8 + k] as i8) as f32 * xs[group * 8 + k];
            }
        }
        for k in 0..8 {
            total[k] += d * lanes[k];
        }
    }
    total.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_q8_0(rows: usize, cols: usize, seed: u64) -> QMatrix {
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let mut data = Vec::new();
        for _ in 0..rows * cols / BLOCK {
            data.extend(f16::from_f32((next() % 1000) as f32 / 50_000.0).to_bits().to_le_bytes());
            data.extend((0..32).map(|_| next() as u8));
        }
        QMatrix::new(QKind::Q8_0, rows, cols, data).unwrap()
    }

    /// The integer kernels' levels this CPU runs: AVX2 (false) and, with AVX512-BW and
    /// VNNI, the AVX-512 kernels (true), whatever level the process chose.
    fn levels() -> Vec<bool> {
        #[cfg(target_arch = "x86_64")]
        if vnni_detected() {
            return vec![false, true];
        }
        vec![false]
    }

    /// The AVX2 quantizer gives [`quantize_block`]'s integers and scales, bit for bit:
    /// random magnitudes, a block of zeros, signed zeros, halves (ties to even), values at
    /// the largest magnitude of either sign, and a last block of fewer than 32 values.
    #[test]
    fn quantize_whole_blocks_as_one_block_at_a_time() {
        let mut s = 7u64;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let mut x: Vec<f32> = (0..32 * 40 + 17).map(|i| next() * [1e-6f32, 1.0, 3e4][i / 32 % 3]).collect();
        x[32..64].fill(0.0);
        x[64..96].iter_mut().enumerate().for_each(|(i, v)| *v = if i % 2 == 0 { -0.0 } else { 0.0 });
        // a largest magnitude of 127 (scale 1): the others are halves, ties
        x[96..128].iter_mut().enumerate().for_each(|(i, v)| *v = i as f32 - 15.5);
        x[127] = 127.0;
        x[128] = -127.0;
        let mut want_q = vec![0i8; x.len()];
        let want_d: Vec<f32> = x.chunks(BLOCK).zip(want_q.chunks_mut(BLOCK)).map(|(x, q)| quantize_block(x, q)).collect();
        let (mut q, mut d) = (Vec::new(), Vec::new());
        quantize_q8_into(&x, &mut q, &mut d);
        assert_eq!(q, want_q);
        assert_eq!(d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want_d.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        assert_eq!(d[3], 1.0);
        assert!(q[96..127].iter().all(|&v| v % 2 == 0), "ties not to even: {:?}", &q[96..127]);
    }

    /// A filled input's sums from its integers, each by its definition: per 16 values and
    /// per block the integers' sum times the block's scale, and minus 128 times the block's
    /// sum where the AVX-512 kernels read them; for lengths ending in a whole block, in a
    /// second half, in a first half and in a block of one value, and for an input filled
    /// again with a shorter vector (its buffers reused) Where the int8 kernels do not run,
    /// the float sums of the values per 16 and per block, and no `starts`.
    #[test]
    fn an_inputs_sums_are_its_integers_sums() {
        let mut input = QInput::default();
        for (len, vnni) in [(576, true), (1536, false), (40, true), (8, true), (33, false), (17, true)] {
            let x: Vec<f32> = (0..len).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
            input.fill_for(&x, vnni);
            let Some((q, d)) = &input.q8 else {
                // no int8 kernels on this CPU (or level): the float sums of the values
                assert!(!simd());
                let halves: Vec<f32> = x.chunks(BLOCK / 2).map(|h| h.iter().sum::<f32>()).collect();
                let blocks: Vec<f32> = halves.chunks(2).map(|p| p.iter().sum::<f32>()).collect();
                assert_eq!((&input.half_sums, &input.block_sums, &input.starts), (&halves, &blocks, &None), "length {len}");
                continue;
            };
            let sum = |v: &[i8]| v.iter().map(|&v| v as i32).sum::<i32>();
            let halves: Vec<f32> = q.chunks(BLOCK / 2).enumerate().map(|(i, h)| sum(h) as f32 * d[i / 2]).collect();
            let blocks: Vec<f32> = q.chunks(BLOCK).zip(d).map(|(b, d)| sum(b) as f32 * d).collect();
            assert_eq!(input.half_sums, halves, "length {len}");
            assert_eq!(input.block_sums, blocks, "length {len}");
            let starts: Vec<i32> = q.chunks(BLOCK).map(|b| -128 * sum(b)).collect();
            assert_eq!(input.starts, vnni.then_some(starts), "length {len}");
        }
    }

    #[test]
    fn q8_0_matvec_equals_dequantized_product() {
        // 3 blocks a row: a two-block step and an odd last block for the AVX-512 kernel;
        // 19: two groups of eight blocks and three alone for the AVX2 kernel
        for (rows, cols) in [(200, 96), (37, 19 * 32)] {
            let m = random_q8_0(rows, cols, 7);
            let x: Vec<f32> = (0..cols).map(|i| ((i * 37 % 17) as f32 - 8.0) / 4.0).collect();
            for vnni in levels() {
                q8_0_product_checked(&m, &x, vnni);
            }
        }
    }

    fn q8_0_product_checked(m: &QMatrix, x: &[f32], vnni: bool) {
        let (rows, cols) = (m.rows(), m.cols());
        let mut got = vec![0f32; rows];
        m.mul_rows(&QMatrix::prepare_for(x, vnni), 0, &mut got[..]);
        let w = m.dequantize();
        // int8 activations (AVX2 / NEON path) cost about 1/254 of each block's largest value
        let tol = if simd() { 1e-2 } else { 1e-4 };
        let mut buffer = Vec::new();
        for r in 0..rows {
            let want: f64 = (0..cols).map(|c| w[r * cols + c] as f64 * x[c] as f64).sum();
            let scale: f64 = (0..cols).map(|c| (w[r * cols + c] as f64 * x[c] as f64).abs()).sum();
            assert!((got[r] as f64 - want).abs() <= tol * (1e-3 + scale), "row {r} (AVX-512: {vnni}): {} vs {want}", got[r]);
            // the portable path, whatever the CPU
            let portable = dot_q8_0(m.q8_0_row_in(r, &mut buffer), x) as f64;
            assert!((portable - want).abs() <= 1e-4 * (1.0 + scale), "row {r}, portable: {portable} vs {want}");
        }
    }

    /// `m · x` on the CPU's path, after checking that every split of the rows into two
    /// ranges gives the same numbers.
    fn product_checked_by_ranges(m: &QMatrix, x: &[f32], vnni: bool) -> Vec<f32> {
        let input = QMatrix::prepare_for(x, vnni);
        let mut whole = vec![0f32; m.rows()];
        m.mul_rows(&input, 0, &mut whole);
        for split in 1..m.rows() {
            let mut parts = vec![0f32; m.rows()];
            m.mul_rows(&input, 0, &mut parts[..split]);
            m.mul_rows(&input, split, &mut parts[split..]);
            assert_eq!(parts, whole, "rows split at {split}");
        }
        whole
    }

    /// Every kept block format: the product with the CPU's path (int8 activations with
    /// AVX2) and with the float path, against float64 over candle's dequantization of the
    /// same bytes; row ranges equal the whole.
    #[test]
    fn kept_blocks_match_float64_over_candles_dequantization() {
        use crate::kernels::blocks::tests::{random_blocks, ALL};
        for f in ALL {
            // the one-sub-block formats with an odd number of blocks a row: the two-block
            // steps and the last one alone
            let (rows, cols) = (7, if f.block_values() == SUB { 544 } else { 512 });
            let data = random_blocks(f, rows * cols / f.block_values(), 13);
            let m = QMatrix::new(QKind::Blocks(f), rows, cols, data.clone()).unwrap();
            let t = candle_core::quantized::ggml_file::qtensor_from_ggml(crate::kernels::blocks::tests::ggml(f), &data, vec![rows, cols], &candle_core::Device::Cpu).unwrap();
            let w = t.dequantize(&candle_core::Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(m.dequantize(), w, "{f:?}: dequantized rows");
            let x: Vec<f32> = (0..cols).map(|i| ((i * 37 % 17) as f32 - 8.0) / 4.0).collect();
            for vnni in levels() {
                let got = product_checked_by_ranges(&m, &x, vnni);
                // int8 activations (AVX2 / NEON path) cost about 1/254 of each block's largest value
                let tol = if simd() { 1e-2 } else { 1e-5 };
                for r in 0..rows {
                    let want: f64 = (0..cols).map(|c| w[r * cols + c] as f64 * x[c] as f64).sum();
                    let scale: f64 = (0..cols).map(|c| (w[r * cols + c] as f64 * x[c] as f64).abs()).sum();
                    assert!((got[r] as f64 - want).abs() <= tol * (1e-3 + scale), "{f:?} row {r} (AVX-512: {vnni}): {} vs {want}", got[r]);
                }
            }
            for r in 0..rows {
                let want: f64 = (0..cols).map(|c| w[r * cols + c] as f64 * x[c] as f64).sum();
                let scale: f64 = (0..cols).map(|c| (w[r * cols + c] as f64 * x[c] as f64).abs()).sum();
                let row = &m.stored_row(r);
                let exact_sums: Vec<f32> = x.chunks(BLOCK / 2).map(|b| b.iter().sum()).collect();
                let float = dot_blocks_float(f, row, &x, &exact_sums) as f64;
                assert!((float - want).abs() <= 1e-5 * (1e-3 + scale), "{f:?} row {r}, float path: {float} vs {want}");
            }
        }
    }

    /// Several inputs at once give, bit for bit, what each gives alone: every kept block
    /// format, Q8_0 and 16-bit rows, one to nine inputs (groups of four or eight and the
    /// rest), rows from 1 (groups of sixteen rows not aligned), on each integer kernel
    /// this CPU runs. Where it runs both, the VNNI build of the AVX2 kernels (Q5_0, Q5_1,
    /// the K-quants) gives the AVX2 build's numbers bit for bit.
    #[test]
    fn batched_rows_equal_single_rows_bit_for_bit() {
        use crate::kernels::blocks::tests::{random_blocks, ALL};
        let mut matrices: Vec<QMatrix> = ALL
            .iter()
            .map(|&f| {
                let (rows, cols) = (40, if f.block_values() == SUB { 544 } else { 512 });
                QMatrix::new(QKind::Blocks(f), rows, cols, random_blocks(f, rows * cols / f.block_values(), 5)).unwrap()
            })
            .collect();
        matrices.push(random_q8_0(40, 96, 3));
        matrices.push(random_q8_0(40, 19 * 32, 4));
        matrices.push(QMatrix::new(QKind::F16, 40, 40, (0..40 * 40).flat_map(|i| f16::from_f32(i as f32 / 97.0 - 1.5).to_bits().to_le_bytes()).collect()).unwrap());
        for m in &matrices {
            let xs: Vec<Vec<f32>> = (0..9).map(|k| (0..m.cols()).map(|i| (((i + 5 * k) * 37 % 23) as f32 - 11.0) / 3.0).collect()).collect();
            let mut by_level = Vec::new();
            for vnni in levels() {
                let inputs: Vec<QInput> = xs.iter().map(|x| QMatrix::prepare_for(x, vnni)).collect();
                let alone: Vec<Vec<f32>> = inputs.iter().map(|i| {
                    let mut out = vec![0f32; 38];
                    m.mul_rows(i, 1, &mut out);
                    out
                }).collect();
                for n in 1..=inputs.len() {
                    let refs: Vec<&QInput> = inputs[..n].iter().collect();
                    let mut outs = vec![vec![0f32; 38]; n];
                    let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
                    m.mul_rows_batch(&refs, 1, &mut views);
                    assert_eq!(outs[..], alone[..n], "{:?}, {n} inputs (AVX-512: {vnni})", m.kind);
                }
                by_level.push(alone);
            }
            // every kept block type gives the same bits at both levels: the VNNI build of
            // the AVX2 kernels, and the Q4 rows-in-lanes kernels (16 rows a register
            // against 8) with the same arithmetic per lane
            if let (QKind::Blocks(f), [avx2, vnni]) = (m.kind, &by_level[..]) {
                assert_eq!(avx2, vnni, "{f:?}: the AVX-512 kernels against the AVX2 ones");
            }
        }
    }

    /// 16-bit rows (half and bfloat16): the product against float64 over the same widened
    /// numbers, the dequantized rows equal to the `half` crate's widening, row ranges equal
    /// the whole.
    #[test]
    fn half_rows_match_float64() {
        let (rows, cols) = (5, 75); // a width that is not a multiple of 8: the tail too
        let x: Vec<f32> = (0..cols).map(|i| ((i * 37 % 17) as f32 - 8.0) / 4.0).collect();
        for kind in [QKind::F16, QKind::BF16] {
            let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 300.0).collect();
            let bits: Vec<u16> = match kind {
                QKind::F16 => w.iter().map(|&v| f16::from_f32(v).to_bits()).collect(),
                _ => w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect(),
            };
            let want_w: Vec<f32> = match kind {
                QKind::F16 => bits.iter().map(|&b| f16::from_bits(b).to_f32()).collect(),
                _ => bits.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect(),
            };
            let data: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
            let m = QMatrix::new(kind, rows, cols, data.clone()).unwrap();
            assert_eq!(m.dequantize(), want_w, "{kind:?}");
            assert_eq!(m.nbytes(), rows * cols * 2);
            let got = product_checked_by_ranges(&m, &x, false);
            for r in 0..rows {
                let want: f64 = (0..cols).map(|c| want_w[r * cols + c] as f64 * x[c] as f64).sum();
                let scale: f64 = (0..cols).map(|c| (want_w[r * cols + c] as f64 * x[c] as f64).abs()).sum();
                assert!((got[r] as f64 - want).abs() <= 1e-6 * (1.0 + scale), "{kind:?} row {r}: {} vs {want}", got[r]);
                let portable = if kind == QKind::BF16 { dot_half_body::<true>(&data[r * cols * 2..(r + 1) * cols * 2], &x) } else { dot_half_body::<false>(&data[r * cols * 2..(r + 1) * cols * 2], &x) };
                assert!((portable as f64 - want).abs() <= 1e-6 * (1.0 + scale), "{kind:?} row {r}, portable");
            }
        }
        assert!(QMatrix::new(QKind::F16, 2, 3, vec![0; 11]).is_err());
    }

    /// Parts of 40 (a last half group), 7 and 16 rows kept interleaved (`kept(rows, seed,
    /// true)`) stacked: still interleaved, every row read back (`row_of`) as the parts
    /// stored it. Returns the stack, the parts' bytes as stored, and the parts.
    #[allow(clippy::type_complexity)]
    fn stacked_parts(kept: impl Fn(usize, u64, bool) -> (QMatrix, Vec<u8>), row_of: impl Fn(&QMatrix, usize) -> Vec<u8>, what: &str) -> (QMatrix, Vec<u8>, Vec<(QMatrix, Vec<u8>)>) {
        let parts: Vec<(QMatrix, Vec<u8>)> = [(40, 1), (7, 2), (16, 3)].iter().map(|&(r, seed)| kept(r, seed, true)).collect();
        let stacked = QMatrix::stack(&parts.iter().map(|(m, _)| m).collect::<Vec<_>>()).unwrap();
        let data: Vec<u8> = parts.iter().flat_map(|(_, d)| d.iter().copied()).collect();
        let row_bytes = stacked.row_bytes();
        assert!(stacked.grouped && stacked.rows == 63);
        for r in 0..63 {
            assert_eq!(row_of(&stacked, r), data[r * row_bytes..(r + 1) * row_bytes], "{what} stacked row {r}");
        }
        (stacked, data, parts)
    }

    /// `grouped` (rows kept interleaved) against the same bytes kept row-major (`plain`;
    /// `data` those bytes as stored): interleaved only where a group is whole, every row
    /// read back as stored (`row_of`), the same dequantized rows, and products bit for bit
    /// for one to nine inputs on each integer kernel this CPU runs, over ranges of whole
    /// groups, halves of groups (the AVX2 Q4 kernel's eight rows) and ranges that start or
    /// end inside one; and one input alone as the batch's first.
    fn interleaved_equals_row_major(grouped: &QMatrix, plain: &QMatrix, data: &[u8], row_of: impl Fn(&QMatrix, usize) -> Vec<u8>, what: &str) {
        let (rows, cols, row_bytes) = (grouped.rows, grouped.cols, grouped.row_bytes());
        assert_eq!(grouped.qs.len(), data.len());
        assert_eq!(grouped.qs != data, rows >= GROUP, "{what}, {rows} rows: interleaved only where a group is whole");
        for r in 0..rows {
            assert_eq!(row_of(grouped, r), data[r * row_bytes..(r + 1) * row_bytes], "{what} row {r} of {rows}");
        }
        assert_eq!(grouped.dequantize(), plain.dequantize(), "{what}, {rows} rows");
        let xs: Vec<Vec<f32>> = (0..9).map(|k| (0..cols).map(|i| (((i + 5 * k) * 37 % 23) as f32 - 11.0) / 3.0).collect()).collect();
        for vnni in levels() {
            let inputs: Vec<QInput> = xs.iter().map(|x| QMatrix::prepare_for(x, vnni)).collect();
            let ranges = [(0, rows), (16, rows.saturating_sub(16)), (8, rows.saturating_sub(8).min(16)), (1, rows - 1), (3, 5.min(rows - 3)), (9, rows.saturating_sub(9))];
            for (first, n) in ranges.into_iter().filter(|&(first, n)| n > 0 && first + n <= rows) {
                for m in 1..=inputs.len() {
                    let refs: Vec<&QInput> = inputs[..m].iter().collect();
                    let run = |mat: &QMatrix| {
                        let mut outs = vec![vec![0f32; n]; m];
                        let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
                        mat.mul_rows_batch(&refs, first, &mut views);
                        outs
                    };
                    let got = run(grouped);
                    assert_eq!(got, run(plain), "{what}, {rows} rows from {first}, {m} inputs (AVX-512: {vnni})");
                    let mut alone = vec![0f32; n];
                    grouped.mul_rows(&inputs[0], first, &mut alone);
                    assert_eq!(alone, got[0], "{what}, {rows} rows from {first}, alone");
                }
            }
        }
    }

    /// Q4_0 and Q4_1 kept in interleaved groups of rows: every row rebuilt as stored, the
    /// same dequantized rows, and products bit-identical to the same bytes kept row-major,
    /// for one to nine inputs on each integer kernel this CPU runs, over row ranges that
    /// take whole groups, halves of groups (the AVX2 kernel's eight rows), and ranges that
    /// start or end inside one; stacks of parts whose last group is not whole.
    #[test]
    fn interleaved_groups_equal_the_stored_rows() {
        use crate::kernels::blocks::tests::random_blocks;
        for f in [Format::Q4_0, Format::Q4_1] {
            let cols = 17 * 32;
            let kept = |rows: usize, seed: u64, group: bool| {
                let data = random_blocks(f, rows * cols / 32, seed);
                (QMatrix::kept(f, rows, cols, data.clone(), group), data)
            };
            for rows in [40, 16, 7] {
                let ((grouped, data), (plain, _)) = (kept(rows, 9, true), kept(rows, 9, false));
                interleaved_equals_row_major(&grouped, &plain, &data, |m, r| m.stored_row(r).to_vec(), &format!("{f:?}"));
            }
            let (stacked, data, _) = stacked_parts(kept, |m, r| m.stored_row(r).to_vec(), &format!("{f:?}"));
            assert_eq!(stacked.dequantize(), QMatrix::kept(f, 63, cols, data, false).dequantize());
        }
    }

    /// Q8_0 rows interleaved by whole groups ([`interleave_q8_0`]) read back as the rows
    /// stored row-major, dequantize alike, and give products bit-identical to the same
    /// bytes kept row-major, for one to nine inputs on each integer kernel this CPU runs,
    /// over ranges of whole groups, ranges that start or end inside one and a last group
    /// of fewer rows; stacks of parts whose last group is not whole.
    #[test]
    fn q8_0_interleaved_groups_equal_the_stored_rows() {
        let cols = 9 * BLOCK;
        let kept = |rows: usize, seed: u64, group: bool| {
            let m = random_q8_0(rows, cols, seed);
            let (scales, qs) = (m.scales.clone(), (0..rows).flat_map(|r| m.q8_0_row_in(r, &mut Vec::new()).qs.to_vec()).collect::<Vec<u8>>());
            (QMatrix::q8_0(rows, cols, scales, qs.clone(), group), qs)
        };
        let row_of = |m: &QMatrix, r: usize| m.q8_0_row_in(r, &mut Vec::new()).qs.to_vec();
        for rows in [40, 16, 7] {
            let ((grouped, data), (plain, _)) = (kept(rows, 9, true), kept(rows, 9, false));
            interleaved_equals_row_major(&grouped, &plain, &data, row_of, "Q8_0");
        }
        let (stacked, data, parts) = stacked_parts(kept, row_of, "Q8_0");
        let scales: Vec<f32> = parts.iter().flat_map(|(m, _)| m.scales.iter().copied()).collect();
        assert_eq!(stacked.dequantize(), QMatrix::q8_0(63, cols, scales, data, false).dequantize());
    }

    #[test]
    fn nearest_rounds_half_to_even() {
        for (v, want) in [(0.5, 0), (1.5, 2), (-0.5, 0), (-1.5, -2), (126.7, 127), (-127.0, -127), (0.49, 0), (-3.2, -3)] {
            assert_eq!(nearest(v), want, "{v}");
        }
    }

    #[test]
    fn row_ranges_and_stacks_equal_the_whole() {
        let a = random_q8_0(9, 64, 3);
        let b = random_q8_0(4, 64, 4);
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) / 7.0).collect();
        let input = QMatrix::prepare(&x);
        let ab = QMatrix::stack(&[&a, &b]).unwrap();
        let mut whole = vec![0f32; 13];
        ab.mul_rows(&input, 0, &mut whole);
        let mut parts = vec![0f32; 13];
        a.mul_rows(&input, 0, &mut parts[..5]);
        a.mul_rows(&input, 5, &mut parts[5..9]);
        b.mul_rows(&input, 0, &mut parts[9..]);
        assert_eq!(whole, parts);
        let other = QMatrix::new(QKind::Blocks(Format::Q4_1), 2, 64, crate::kernels::blocks::tests::random_blocks(Format::Q4_1, 4, 5)).unwrap();
        assert!(QMatrix::stack(&[&a, &other]).is_none());
    }

    #[test]
    fn rejects_inconsistent_sizes() {
        assert!(QMatrix::new(QKind::Blocks(Format::Q4_1), 2, 30, vec![0; 40]).is_err());
        assert!(QMatrix::new(QKind::Q8_0, 2, 32, vec![0; 67]).is_err());
    }
}
