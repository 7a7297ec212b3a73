//! The 8-bit cache's numbers: each (position, KV head) row of keys or values in blocks of
//! [`QK`] dimensions, each block 32 int8 values and one float16 scale (34 bytes for 32
//! values: the layout of GGUF's Q8_0, 0.27 of float32's bytes and 0.53 of float16's).
//!
//! A block's scale is its largest magnitude over 127, rounded to float16; each value is
//! then rounded to the nearest multiple of that stored scale, so a stored value is off by
//! at most half a scale step (max |x| / 254 of its block, plus the float16 rounding of the
//! scale). Attention reads the blocks where they are: each task widens a group of
//! positions into float32 in a buffer of its thread, in the core's cache, as it does for
//! float16 ([`crate::kernels::attention::Stored`]).

use half::f16;

use crate::kernels::attention::Stored;
use crate::kernels::qmatvec::nearest;
#[cfg(target_arch = "x86_64")]
use crate::kernels::qmatvec::{block_amax_avx2, bytes_avx2};

/// Values per block.
pub const QK: usize = 32;

/// One block of 32 values: the scale (float16, little-endian bytes) and the int8 values.
/// Byte-aligned, so a cache block's bytes are read as blocks in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct Q8Block {
    scale: [u8; 2],
    qs: [i8; QK],
}

/// Bytes of one block.
pub const BLOCK_BYTES: usize = std::mem::size_of::<Q8Block>();
const _: () = assert!(BLOCK_BYTES == 34 && std::mem::align_of::<Q8Block>() == 1);

impl Q8Block {
    /// 32 values rounded as the module says.
    pub fn quantize(x: &[f32]) -> Self {
        debug_assert_eq!(x.len(), QK);
        let (scale, step) = Self::scale_for(x.iter().fold(0f32, |m, v| m.max(v.abs())));
        let mut qs = [0i8; QK];
        if let Some(step) = step {
            for (q, &v) in qs.iter_mut().zip(x) {
                // a float16 scale rounded down can put amax a hair past 127 steps
                *q = (v / step).round().clamp(-127.0, 127.0) as i8;
            }
        }
        Self { scale: scale.to_le_bytes(), qs }
    }

    /// The stored scale of a block whose largest magnitude is `amax`, and the step its
    /// values are rounded to (None: they are all stored as 0).
    fn scale_for(amax: f32) -> (f16, Option<f32>) {
        let scale = f16::from_f32(amax / 127.0);
        let step = scale.to_f32();
        (scale, (step > 0.0 && step.is_finite()).then_some(step))
    }

    /// The scale as float32, exactly, without the `half` crate's run-time dispatch (a call
    /// per block: 3 % of a decode step at 4,096 positions): a float16's magnitude bits
    /// shifted into a float32's place are the same number times 2^-112 (for subnormals
    /// too), so one multiplication by 2^112 restores it. Scales are finite (the largest
    /// float16 is 65,504, a block's largest magnitude would be 127 times that).
    #[inline(always)]
    pub fn scale(&self) -> f32 {
        let h = u16::from_le_bytes(self.scale);
        let magnitude = f32::from_bits(((h & 0x7fff) as u32) << 13) * f32::from_bits(0x7780_0000); // 2^112
        if h & 0x8000 != 0 {
            -magnitude
        } else {
            magnitude
        }
    }

    /// The int8 values (each times [`Q8Block::scale`] is a stored value).
    #[inline(always)]
    pub fn values(&self) -> &[i8; QK] {
        &self.qs
    }

    /// The stored values as float32 (exact: an int8 times a float16 fits float32).
    fn widen(&self, dst: &mut [f32]) {
        let s = self.scale();
        for (d, &q) in dst.iter_mut().zip(&self.qs) {
            *d = q as f32 * s;
        }
    }
}

/// Storage bytes of one row of `head_dim` values (a multiple of [`QK`]).
pub fn row_bytes(head_dim: usize) -> usize {
    head_dim / QK * BLOCK_BYTES
}

/// Rounds `src` (a multiple of [`QK`] values) into blocks, written as bytes to `dst`
/// (`row_bytes(src.len())` of them).
/// AVX2 where the CPU has it (the same bytes: [`quantize_avx2`]).
pub fn quantize_into(src: &[f32], dst: &mut [u8]) {
    quantize_with(crate::kernels::matvec::kernel(), src, dst)
}

/// [`quantize_into`] on a level the CPU runs.
fn quantize_with(level: crate::kernels::matvec::Kernel, src: &[f32], dst: &mut [u8]) {
    assert!(src.len().is_multiple_of(QK) && dst.len() == row_bytes(src.len()));
    #[cfg(target_arch = "x86_64")]
    if level != crate::kernels::matvec::Kernel::Portable {
        // SAFETY: the CPU has AVX2 and FMA (every level but the portable one is checked
        // at run time); the lengths were checked
        return unsafe { quantize_avx2(src, dst) };
    }
    let _ = level;
    quantize_portable(src, dst);
}

fn quantize_portable(src: &[f32], dst: &mut [u8]) {
    for (x, out) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BLOCK_BYTES)) {
        let b = Q8Block::quantize(x);
        out[..2].copy_from_slice(&b.scale);
        for (o, q) in out[2..].iter_mut().zip(b.qs) {
            *o = q as u8;
        }
    }
}

/// [`Q8Block::quantize`] with AVX2, 32 values a block: the largest magnitude as there
/// ([`block_amax_avx2`]), the same scale and step, each value divided by the step (the
/// same single rounding), rounded half away from zero as `f32::round` does (the
/// magnitude's integer part plus one where its fraction, exact, is at least a half) and
/// clamped: the same bytes. The scalar loop divided and called libm's `roundf` per value.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_avx2(src: &[f32], dst: &mut [u8]) {
    use std::arch::x86_64::*;
    let (sign, one, halfway, limit) = (_mm256_set1_ps(-0.0), _mm256_set1_ps(1.0), _mm256_set1_ps(0.5), _mm256_set1_ps(127.0));
    for (x, out) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BLOCK_BYTES)) {
        let v: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(x.as_ptr().add(8 * k)));
        let (scale, step) = Q8Block::scale_for(block_amax_avx2(&v));
        out[..2].copy_from_slice(&scale.to_le_bytes());
        let Some(step) = step else {
            out[2..].fill(0);
            continue;
        };
        let step = _mm256_set1_ps(step);
        let ints: [__m256i; 4] = std::array::from_fn(|k| {
            let q = _mm256_div_ps(v[k], step);
            let magnitude = _mm256_andnot_ps(sign, q);
            let whole = _mm256_round_ps(magnitude, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            let up = _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(magnitude, whole), halfway, _CMP_GE_OQ), one);
            // a NaN (of a NaN value) is stored as 0, as `as i8` makes it
            let rounded = _mm256_and_ps(_mm256_min_ps(_mm256_add_ps(whole, up), limit), _mm256_cmp_ps(q, q, _CMP_ORD_Q));
            _mm256_cvttps_epi32(_mm256_or_ps(rounded, _mm256_and_ps(q, sign)))
        });
        _mm256_storeu_si256(out[2..].as_mut_ptr() as *mut __m256i, bytes_avx2(ints));
    }
}

/// Bytes (a whole number of blocks) read as blocks, in place.
pub fn as_blocks(bytes: &[u8]) -> &[Q8Block] {
    assert!(bytes.len().is_multiple_of(BLOCK_BYTES), "{} bytes are not a whole number of 8-bit cache blocks", bytes.len());
    // SAFETY: Q8Block is repr(C) of byte arrays (size 34, alignment 1, every bit pattern
    // valid), so any 34 bytes are one; the length was checked
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const Q8Block, bytes.len() / BLOCK_BYTES) }
}

/// The stored values of `src` as float32 into `dst` (32 per block), on the best
/// instruction set the CPU has; each path gives the same numbers (the products are exact).
pub fn widen_into(src: &[Q8Block], dst: &mut [f32]) {
    debug_assert_eq!(src.len() * QK, dst.len());
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernels::matvec::{kernel, Kernel};
        match kernel() {
            // SAFETY: the CPU has AVX-512F (checked at run time)
            Kernel::Avx512 => return unsafe { widen_avx512(src, dst) },
            // SAFETY: the CPU has AVX2 (checked at run time)
            Kernel::Avx2 => return unsafe { widen_avx2(src, dst) },
            Kernel::Portable => {}
        }
    }
    widen_portable(src, dst);
}

fn widen_portable(src: &[Q8Block], dst: &mut [f32]) {
    for (b, d) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        b.widen(d);
    }
}

/// The scales of blocks `0, stride, 2 * stride, ..` of `blocks`, the first `m` of them
/// (at most 16; lanes past `m` are 0), as float32 lanes: [`Q8Block::scale`]'s conversion
/// lane for lane (each block's first dword gathered, its scale's magnitude bits shifted
/// into place and multiplied by 2^112, the sign put back), so the same numbers. For the
/// transposed keys' scales, where an array of scalar conversions built on the stack and
/// reloaded as one register waited for its 16 stores: one row's attention over 2,000
/// positions of one layer, hot, 116-118 -> 109-113 us (AMD Zen 4, one thread). (Where
/// a block's scale is used alone, the scalar conversion is as fast.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn scales16(blocks: &[Q8Block], stride: usize, m: usize) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    assert!(m <= 16 && (m == 0 || (m - 1) * stride < blocks.len()) && stride * BLOCK_BYTES * 16 <= i32::MAX as usize);
    let offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32((stride * BLOCK_BYTES) as i32));
    let mask = ((1u32 << m) - 1) as __mmask16;
    // the dword at each block's start: its scale's two bytes (little-endian, low half),
    // then two of its values (inside the block: it has 34 bytes)
    let h = _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), mask, offsets, blocks.as_ptr() as *const _);
    let magnitude = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32::<13>(_mm512_and_si512(h, _mm512_set1_epi32(0x7fff)))), _mm512_set1_ps(f32::from_bits(0x7780_0000)));
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), _mm512_slli_epi32::<16>(_mm512_and_si512(h, _mm512_set1_epi32(0x8000)))))
}

/// [`scales16`] for eight blocks with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn scales8(blocks: &[Q8Block], stride: usize, m: usize) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    assert!(m <= 8 && (m == 0 || (m - 1) * stride < blocks.len()) && stride * BLOCK_BYTES * 8 <= i32::MAX as usize);
    let offsets = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((stride * BLOCK_BYTES) as i32));
    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(m as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    let h = _mm256_mask_i32gather_epi32::<1>(_mm256_setzero_si256(), blocks.as_ptr() as *const _, offsets, mask);
    let magnitude = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32::<13>(_mm256_and_si256(h, _mm256_set1_epi32(0x7fff)))), _mm256_set1_ps(f32::from_bits(0x7780_0000)));
    _mm256_or_ps(magnitude, _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)))))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_avx512(src: &[Q8Block], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    for (i, b) in src.iter().enumerate() {
        let s = _mm512_set1_ps(b.scale());
        let q = b.qs.as_ptr() as *const __m128i;
        let out = dst.as_mut_ptr().add(i * QK);
        for half in 0..2 {
            let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(half))));
            _mm512_storeu_ps(out.add(16 * half), _mm512_mul_ps(v, s));
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_avx2(src: &[Q8Block], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    for (i, b) in src.iter().enumerate() {
        let s = _mm256_set1_ps(b.scale());
        let out = dst.as_mut_ptr().add(i * QK);
        for part in 0..4 {
            let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(b.qs.as_ptr().add(8 * part) as *const __m128i)));
            _mm256_storeu_ps(out.add(8 * part), _mm256_mul_ps(v, s));
        }
    }
}

/// Largest int16 a query value is rounded to ([`Queries`]).
const Q16_MAX: f64 = 32767.0;

/// Queries scored against 8-bit keys, rounded to int16 so that a block's score is one
/// integer sum: per query head and block of [`QK`] dimensions, each value to the nearest
/// multiple of the block's largest magnitude / 32,767 (off by at most 2^-16 of that
/// magnitude: about 1/260 of the 8-bit keys' own rounding, which is 1/254 of their
/// block's largest value). A block's 32 products of int16 and int8 values sum exactly in
/// 32 bits (at most 32 · 32,767 · 127 < 2^31), so the score of a key is, over its blocks
/// g, Σ_g sum_g × (key scale_g × query scale_g), whatever the instruction set: where the
/// float32 path widened each key value and made 32 multiply-adds per query head, the
/// integer path makes 16 multiply-adds of pairs (or 32 of AVX2's) per block of positions.
/// Rounded from float64, so every finite query is rounded to a finite scale and int16
/// values; a non-finite block has a non-finite scale and zero values, and so a
/// non-finite score, as the float path gives.
pub struct Queries {
    /// heads × d: the int16 values in their dimensions' order
    values: Vec<i16>,
    /// heads × d / 2: the values in pairs, two int16 in each 32-bit word, per block in
    /// the order of [`pair_dims`] (the order the SIMD paths' transposed keys come in)
    pairs: Vec<i32>,
    /// heads × d / [`QK`]: each block's step (one int16 unit as a float32 number)
    scales: Vec<f32>,
    d: usize,
}

/// Some consecutive heads of [`Queries`] (those of one KV head), as the scoring reads them.
#[derive(Clone, Copy)]
pub struct QueryHeads<'a> {
    values: &'a [i16],
    /// heads × d / 2 pairs ([`pair_dims`])
    pub pairs: &'a [i32],
    /// heads × d / [`QK`] steps
    pub scales: &'a [f32],
}

/// The two dimensions (within a block of [`QK`]) of pair `j` of [`Queries::pairs`]: pair
/// 2k holds dimensions 4k and 4k + 2, pair 2k + 1 dimensions 4k + 1 and 4k + 3 (one
/// 32-bit word of 4 int8 key values split by 16-bit shifts into its even and odd bytes).
pub fn pair_dims(j: usize) -> (usize, usize) {
    let first = j / 2 * 4 + j % 2;
    (first, first + 2)
}

impl Queries {
    /// `q`: query heads × `d` (a multiple of [`QK`]).
    pub fn new(q: &[f32], d: usize) -> Self {
        debug_assert!(d.is_multiple_of(QK) && q.len().is_multiple_of(d));
        let mut values = vec![0i16; q.len()];
        let mut scales = Vec::with_capacity(q.len() / QK);
        for (x, v) in q.chunks_exact(QK).zip(values.chunks_exact_mut(QK)) {
            // (a NaN is not a maximum: `max` passes over it)
            let finite = x.iter().all(|a| a.is_finite());
            let amax = x.iter().fold(0f64, |m, &a| m.max((a as f64).abs()));
            if finite && amax > 0.0 {
                let inv = Q16_MAX / amax;
                for (v, &a) in v.iter_mut().zip(x) {
                    // without a call to a library `round` (one per value was 2 % of a
                    // decode task)
                    *v = nearest((a as f64 * inv) as f32).clamp(-(Q16_MAX as i32), Q16_MAX as i32) as i16;
                }
            }
            // a non-finite block: a NaN step (its values stay zero)
            scales.push(if finite { (amax / Q16_MAX) as f32 } else { f32::NAN });
        }
        let mut pairs = vec![0i32; q.len() / 2];
        for (v, p) in values.chunks_exact(QK).zip(pairs.chunks_exact_mut(QK / 2)) {
            for (j, p) in p.iter_mut().enumerate() {
                let (a, b) = pair_dims(j);
                *p = (v[a] as u16 as u32 | (v[b] as u16 as u32) << 16) as i32;
            }
        }
        Self { values, pairs, scales, d }
    }

    /// Heads `first..first + count`.
    pub fn heads(&self, first: usize, count: usize) -> QueryHeads<'_> {
        let (d, groups) = (self.d, self.d / QK);
        QueryHeads {
            values: &self.values[first * d..(first + count) * d],
            pairs: &self.pairs[first * d / 2..(first + count) * d / 2],
            scales: &self.scales[first * groups..(first + count) * groups],
        }
    }

    /// The rounded queries as float32 numbers (what the scores are exact products of).
    #[cfg(test)]
    pub fn rounded(&self) -> Vec<f32> {
        self.values.iter().enumerate().map(|(i, &v)| v as f32 * self.scales[i / QK]).collect()
    }
}

impl QueryHeads<'_> {
    /// Head `head`'s score of one key (its `d / QK` blocks), not yet divided by √d: the
    /// portable path, and the reference the SIMD paths are tested against.
    pub fn score(&self, head: usize, key: &[Q8Block]) -> f32 {
        let groups = key.len();
        let mut total = 0f32;
        for (g, b) in key.iter().enumerate() {
            let q = &self.values[(head * groups + g) * QK..][..QK];
            let sum: i32 = q.iter().zip(&b.qs).map(|(&a, &k)| a as i32 * k as i32).sum();
            total += sum as f32 * (b.scale() * self.scales[head * groups + g]);
        }
        total
    }
}

impl Stored for Q8Block {
    const PER: usize = QK;
    fn as_f32(_: &[Q8Block]) -> Option<&[f32]> {
        None
    }
    fn widen_into(src: &[Q8Block], dst: &mut [f32]) {
        widen_into(src, dst);
    }
    fn as_q8(s: &[Q8Block]) -> Option<&[Q8Block]> {
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attention::tests::random;

    /// Every level's rounding stores the scalar blocks' bytes: mixed magnitudes, zeros,
    /// values on a step's half (ties away from zero), past 127 steps (a scale rounded
    /// down), tiny and huge magnitudes (float16 scales that underflow and overflow), NaNs
    /// and infinities.
    #[test]
    fn every_level_rounds_to_the_same_bytes() {
        let blocks = 12;
        let mut x: Vec<f32> = random(blocks * QK, 11).iter().enumerate().map(|(i, v)| v * [1.0, 5.0, 1e-9, 1e9, 300.0, 1e-3][i / QK % 6]).collect();
        x[QK..2 * QK].fill(0.0);
        // amax 127 with a step of 1 (float16 holds it): values on halves, of both signs
        x[6 * QK..7 * QK].iter_mut().enumerate().for_each(|(i, v)| *v = (i as f32 - 16.0) + 0.5);
        x[6 * QK] = -127.0;
        // a largest magnitude whose scale float16 rounds down: it lands past 127 steps
        x[7 * QK] = 127.0 * 1.0004;
        x[8 * QK + 5] = f32::NAN;
        x[9 * QK + 2] = f32::INFINITY;
        x[10 * QK + 7] = f32::NEG_INFINITY;
        x[10 * QK + 8] = f32::NAN;
        let mut want = vec![0u8; row_bytes(x.len())];
        quantize_portable(&x, &mut want);
        let ties = &as_blocks(&want)[6];
        assert_eq!(ties.scale(), 1.0);
        assert_eq!(&ties.values()[1..4], &[-15, -14, -13], "-14.5, -13.5 and -12.5 not rounded away from zero");
        assert_eq!(as_blocks(&want)[7].values()[0], 127);
        for level in crate::kernels::matvec::Kernel::available() {
            let mut got = vec![0u8; row_bytes(x.len())];
            quantize_with(level, &x, &mut got);
            for (b, (w, g)) in want.chunks(BLOCK_BYTES).zip(got.chunks(BLOCK_BYTES)).enumerate() {
                assert_eq!(w, g, "{}, block {b}", level.name());
            }
        }
    }

    #[test]
    fn queries_round_within_half_a_step_and_score_exactly() {
        // a head of 64: a block of mixed magnitudes and a block of zeros; then blocks with
        // an infinity and a NaN
        let d = 2 * QK;
        let mut q: Vec<f32> = random(3 * d, 5).iter().enumerate().map(|(i, v)| v * [3.0, 1e-30, 700.0][i / d]).collect();
        q[QK..2 * QK].fill(0.0);
        q[2 * d + 3] = 1e5;
        let queries = Queries::new(&q, d);
        let rounded = queries.rounded();
        for (b, (x, r)) in q.chunks_exact(QK).zip(rounded.chunks_exact(QK)).enumerate() {
            let amax = x.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
            assert_eq!(queries.scales[b] as f64, (amax / Q16_MAX) as f32 as f64, "block {b}");
            for (&v, &w) in x.iter().zip(r) {
                // half a step, plus the float32 rounding of the step and of the product
                let bound = amax / Q16_MAX * (0.5 + 1e-6) + (w as f64).abs() * f32::EPSILON as f64;
                assert!((v as f64 - w as f64).abs() <= bound, "block {b}: {v} rounded to {w} (step {})", queries.scales[b]);
            }
        }
        assert!(rounded[QK..2 * QK].iter().all(|&w| w == 0.0) && queries.scales[1] == 0.0);
        // pairs hold the values in pair_dims' order
        for (j, &p) in queries.pairs[..QK / 2].iter().enumerate() {
            let (a, b) = pair_dims(j);
            assert_eq!((p as u32 as u16 as i16, (p as u32 >> 16) as u16 as i16), (queries.values[a], queries.values[b]), "pair {j}");
        }
        // a score is the float64 sum over the rounded numbers, to float32 rounding
        let keys: Vec<f32> = random(d, 6).iter().map(|v| v * 2.0).collect();
        let mut bytes = vec![0u8; row_bytes(d)];
        quantize_into(&keys, &mut bytes);
        let mut wide = vec![0f32; d];
        widen_portable(as_blocks(&bytes), &mut wide);
        for head in 0..3 {
            let want: f64 = rounded[head * d..][..d].iter().zip(&wide).map(|(&a, &b)| a as f64 * b as f64).sum();
            let got = queries.heads(0, 3).score(head, as_blocks(&bytes)) as f64;
            assert!((got - want).abs() <= 1e-5 * want.abs().max(1e-30), "head {head}: {got} against {want}");
        }
        // a non-finite query gives a non-finite score
        for bad in [f32::INFINITY, f32::NAN] {
            let mut q = q.clone();
            q[d + 7] = bad;
            let queries = Queries::new(&q, d);
            assert!(queries.scales[2].is_nan() && !queries.heads(0, 3).score(1, as_blocks(&bytes)).is_finite(), "{bad}");
        }
    }

    #[test]
    fn rounding_is_within_half_a_step_and_widening_is_exact_on_every_path() {
        // magnitudes from tiny to large, one outlier per block, zeros, a block of zeros
        let mut x: Vec<f32> = random(64 * QK, 3).iter().enumerate().map(|(i, v)| v * [1e-3, 1.0, 30.0, 500.0][i / QK % 4]).collect();
        x[5] = 40.0;
        x[QK..2 * QK].fill(0.0);
        let mut bytes = vec![0u8; row_bytes(x.len())];
        quantize_into(&x, &mut bytes);
        let blocks = as_blocks(&bytes);
        let mut want = vec![0f32; x.len()];
        widen_portable(blocks, &mut want);
        for (b, (xs, ws)) in blocks.iter().zip(x.chunks_exact(QK).zip(want.chunks_exact(QK))) {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
            let step = b.scale() as f64;
            // normal float16 scales are within 2^-11 of amax / 127 (subnormal ones, of
            // blocks below 0.008, within 6e-8)
            assert!((step - amax / 127.0).abs() <= (amax / 127.0 / 2048.0).max(3e-8), "scale {step} for max {amax}");
            // half a step, or what clamping to 127 steps cut off
            let bound = (step / 2.0).max(amax - 127.0 * step) * (1.0 + 1e-6) + 1e-12;
            for (&v, &w) in xs.iter().zip(ws) {
                assert!(((v as f64) - (w as f64)).abs() <= bound, "{v} stored as {w} (scale {})", b.scale());
            }
        }
        assert!(want[QK..2 * QK].iter().all(|&w| w == 0.0));
        // the scale's conversion is the half crate's, for every finite float16
        for h in (0..0x7c00u16).chain(0x8000..0xfc00) {
            let b = Q8Block { scale: h.to_le_bytes(), qs: [0; QK] };
            assert_eq!(b.scale().to_bits(), f16::from_bits(h).to_f32().to_bits(), "{h:#06x}");
        }
        for level in crate::kernels::matvec::Kernel::available() {
            let mut got = vec![0f32; x.len()];
            match level {
                // SAFETY: `available` lists the levels this CPU runs
                #[cfg(target_arch = "x86_64")]
                crate::kernels::matvec::Kernel::Avx512 => unsafe { widen_avx512(blocks, &mut got) },
                #[cfg(target_arch = "x86_64")]
                crate::kernels::matvec::Kernel::Avx2 => unsafe { widen_avx2(blocks, &mut got) },
                _ => widen_portable(blocks, &mut got),
            }
            assert_eq!(got, want, "{level:?}");
        }
        // rounding what is stored stores it again, bit for bit (blocks of normal scales)
        let normal: Vec<f32> = x.chunks_exact(QK).zip(want.chunks_exact(QK)).filter(|(xs, _)| xs.iter().any(|v| v.abs() > 0.01)).flat_map(|(_, w)| w.to_vec()).collect();
        let (mut once, mut twice) = (vec![0u8; row_bytes(normal.len())], vec![0u8; row_bytes(normal.len())]);
        quantize_into(&normal, &mut once);
        let mut back = vec![0f32; normal.len()];
        widen_portable(as_blocks(&once), &mut back);
        assert_eq!(back, normal);
        quantize_into(&back, &mut twice);
        assert_eq!(once, twice);
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn vector_scales_equal_the_scalar_conversion() {
        // every finite float16 as a scale, read 16 (AVX-512) or 8 (AVX2) at a time at strides
        // of 1-3 blocks and for every count of blocks, lanes past the count zero
        let every: Vec<Q8Block> = (0..0x7c00u16).chain(0x8000..0xfc00).map(|h| Q8Block { scale: h.to_le_bytes(), qs: [7; QK] }).collect();
        for level in crate::kernels::matvec::Kernel::available() {
            let lanes = match level {
                crate::kernels::matvec::Kernel::Avx512 => 16,
                crate::kernels::matvec::Kernel::Avx2 => 8,
                _ => continue,
            };
            for stride in 1..=3 {
                for (at, m) in (0..every.len() - lanes * stride).step_by(lanes * stride / 2 + 1).zip((0..=lanes).cycle()) {
                    let mut got = [0f32; 16];
                    // SAFETY: `available` lists the levels this CPU runs; m blocks at `stride` from `at` exist
                    unsafe {
                        match lanes {
                            16 => std::arch::x86_64::_mm512_storeu_ps(got.as_mut_ptr(), scales16(&every[at..], stride, m)),
                            _ => std::arch::x86_64::_mm256_storeu_ps(got.as_mut_ptr(), scales8(&every[at..], stride, m)),
                        }
                    }
                    let want: Vec<u32> = (0..lanes).map(|j| if j < m { every[at + j * stride].scale().to_bits() } else { 0 }).collect();
                    assert_eq!(got[..lanes].iter().map(|g| g.to_bits()).collect::<Vec<_>>(), want, "{level:?}, stride {stride}, {m} from block {at}");
                }
            }
        }
    }
}
