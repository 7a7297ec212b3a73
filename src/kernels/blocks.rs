//! GGUF's quantized block formats, read as stored.
//!
//! Every format here describes 32 consecutive values (a "sub-block"; K-quant blocks hold
//! eight of them in 256 values) as integers `q` in 0..64 with a scale and a minimum per
//! half of 16: `value[i] = scale[i / 16] * q[i] - min[i / 16]` (a signed format's offset
//! is part of its minimum). [`Format::values`] (and [`values_avx2`]) give a sub-block's
//! integers and [`Format::scales`] a block's scales and minimums: all the kernels need to
//! know about a format. The integers go into an integer dot product with int8 activations
//! (or a float one), the scales and minimums are applied once per half. The layouts are
//! those of ggml's `ggml-common.h`, checked in the tests against candle's own
//! dequantization and gguf-py's (tests/test_block_types.py).

/// Values per sub-block, the unit of [`Format::values`].
pub const SUB: usize = 32;

/// The block types kept byte for byte (Q8_0 is repacked for its own kernel:
/// [`crate::kernels::qmatvec`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Format {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

/// The half-precision number at byte `at` of `b`, as float32.
#[inline(always)]
fn half_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Half to single precision in a few integer and one float operation, inlined where it is
/// used (a call into a conversion routine in the kernels' inner loop made the compiler
/// spill the SIMD registers around it). The exponent and mantissa are moved into
/// float32's positions and the result multiplied by 2^112, which re-biases the exponent
/// and makes subnormals exact; infinities and NaNs keep an all-ones exponent.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let bits = h as u32 & 0x7fff;
    let magnitude = if bits >= 0x7c00 { f32::from_bits((bits << 13) | 0x7f80_0000) } else { f32::from_bits(bits << 13) * f32::from_bits(0x7780_0000) };
    f32::from_bits(magnitude.to_bits() | ((h as u32 & 0x8000) << 16))
}

/// Q4_K / Q5_K: the 6-bit scale and minimum of sub-block `j` from the 12 packed bytes.
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Q3_K: the 16 signed 6-bit scales from the 12 packed bytes (low 4 bits in bytes 0..8,
/// high 2 bits in bytes 8..12), minus 32.
fn scales_q3k(s: &[u8]) -> [i8; 16] {
    std::array::from_fn(|i| {
        let low = if i < 8 { s[i] & 0x0F } else { s[i - 8] >> 4 };
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        ((low | (high << 4)) as i8) - 32
    })
}

impl Format {
    /// The format whose `as u8` is `id` (for kernels specialized by a const parameter).
    pub const fn from_id(id: u8) -> Format {
        match id {
            0 => Format::Q4_0,
            1 => Format::Q4_1,
            2 => Format::Q5_0,
            3 => Format::Q5_1,
            4 => Format::Q2K,
            5 => Format::Q3K,
            6 => Format::Q4K,
            7 => Format::Q5K,
            _ => Format::Q6K,
        }
    }

    pub fn from_ggml(t: candle_core::quantized::GgmlDType) -> Option<Self> {
        use candle_core::quantized::GgmlDType as G;
        Some(match t {
            G::Q4_0 => Format::Q4_0,
            G::Q4_1 => Format::Q4_1,
            G::Q5_0 => Format::Q5_0,
            G::Q5_1 => Format::Q5_1,
            G::Q2K => Format::Q2K,
            G::Q3K => Format::Q3K,
            G::Q4K => Format::Q4K,
            G::Q5K => Format::Q5K,
            G::Q6K => Format::Q6K,
            _ => return None,
        })
    }

    /// Values per block.
    pub fn block_values(self) -> usize {
        match self {
            Format::Q4_0 | Format::Q4_1 | Format::Q5_0 | Format::Q5_1 => 32,
            _ => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q5_0 => 22,
            Format::Q5_1 => 24,
            Format::Q2K => 84,
            Format::Q3K => 110,
            Format::Q4K => 144,
            Format::Q5K => 176,
            Format::Q6K => 210,
        }
    }

    /// The integers of sub-block `s`, each in 0..64.
    #[inline(always)]
    pub fn values(self, block: &[u8], s: usize) -> [u8; SUB] {
        let mut q = [0u8; SUB];
        match self {
            Format::Q4_0 | Format::Q4_1 => {
                // low nibbles are values 0..16, high nibbles 16..32
                let qs = &block[if self == Format::Q4_0 { 2 } else { 4 }..][..16];
                for l in 0..16 {
                    q[l] = qs[l] & 0x0F;
                    q[l + 16] = qs[l] >> 4;
                }
            }
            Format::Q5_0 | Format::Q5_1 => {
                // as Q4, with bit l of the 32-bit `qh` as value l's fifth bit
                let at = if self == Format::Q5_0 { 2 } else { 4 };
                let qh = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
                let qs = &block[at + 4..][..16];
                for l in 0..16 {
                    q[l] = (qs[l] & 0x0F) | ((((qh >> l) & 1) as u8) << 4);
                    q[l + 16] = (qs[l] >> 4) | ((((qh >> (l + 16)) & 1) as u8) << 4);
                }
            }
            Format::Q2K => {
                // scales[16], qs[64], d, dmin: sub-block s is bits 2 (s % 4) of bytes 32 (s / 4)..
                let (qs, shift) = (&block[16 + 32 * (s / 4)..][..32], 2 * (s % 4));
                for l in 0..SUB {
                    q[l] = (qs[l] >> shift) & 3;
                }
            }
            Format::Q3K => {
                // hmask[32], qs[64], scales[12], d: two bits as Q2_K, and bit s of hmask[l]
                // set means + 4 (ggml: clear means - 4; the minimum takes the 4)
                let (hmask, qs, shift) = (&block[..32], &block[32 + 32 * (s / 4)..][..32], 2 * (s % 4));
                for l in 0..SUB {
                    q[l] = ((qs[l] >> shift) & 3) | (((hmask[l] >> s) & 1) << 2);
                }
            }
            Format::Q4K | Format::Q5K => {
                // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]: sub-blocks 2p and 2p + 1 are
                // the low and high nibbles of bytes 32 p..32 p + 32; Q5_K's fifth bit is bit
                // s of qh[l]
                let five = self == Format::Q5K;
                let qs = &block[if five { 48 } else { 16 } + 32 * (s / 2)..][..32];
                let shift = 4 * (s % 2);
                for l in 0..SUB {
                    let high = if five { ((block[16 + l] >> s) & 1) << 4 } else { 0 };
                    q[l] = ((qs[l] >> shift) & 0x0F) | high;
                }
            }
            Format::Q6K => {
                // ql[128], qh[64], scales[16] (i8), d: in each half of 128 values, quarter k
                // takes nibble k / 2 of ql[l + 32 (k % 2)] and bits 2k of qh[l]
                let (half, k) = (s / 4, s % 4);
                let (ql, qh) = (&block[64 * half + 32 * (k % 2)..][..32], &block[128 + 32 * half..][..32]);
                let shift = 4 * (k / 2);
                for l in 0..SUB {
                    q[l] = ((ql[l] >> shift) & 0x0F) | (((qh[l] >> (2 * k)) & 3) << 4);
                }
            }
        }
        q
    }

    /// For the formats whose block is one 32-value sub-block (Q4_0, Q4_1, Q5_0, Q5_1): the
    /// block's minimum from its two leading half-precision numbers as float32, `d` (the
    /// scale) and `second` (the stored minimum `m` of Q4_1 and Q5_1: value = d·q + m; the
    /// start of the values for the others: value = d·(q - 8) or d·(q - 16)).
    #[inline(always)]
    pub fn small_min(self, d: f32, second: f32) -> f32 {
        match self {
            Format::Q4_0 => 8.0 * d,
            Format::Q5_0 => 16.0 * d,
            Format::Q4_1 | Format::Q5_1 => -second,
            _ => unreachable!("{self:?} has several sub-blocks per block"),
        }
    }

    /// The scales and minimums of every sub-block of `block`, each half-precision number
    /// and packed scale read once.
    #[inline(always)]
    pub fn scales(self, block: &[u8]) -> Scales {
        let mut out = Scales { scale: [[0.0; 2]; 8], min: [[0.0; 2]; 8] };
        let subs = self.block_values() / SUB;
        match self {
            Format::Q4_0 | Format::Q5_0 | Format::Q4_1 | Format::Q5_1 => {
                let d = half_at(block, 0);
                (out.scale[0], out.min[0]) = ([d; 2], [self.small_min(d, half_at(block, 2)); 2]);
            }
            Format::Q2K => {
                let (d, dmin) = (half_at(block, 80), half_at(block, 82));
                for s in 0..subs {
                    let sc = [block[2 * s], block[2 * s + 1]];
                    out.scale[s] = sc.map(|c| d * (c & 0x0F) as f32);
                    out.min[s] = sc.map(|c| dmin * (c >> 4) as f32);
                }
            }
            Format::Q3K => {
                let d = half_at(block, 108);
                let sc = scales_q3k(&block[96..108]);
                for s in 0..subs {
                    out.scale[s] = [d * sc[2 * s] as f32, d * sc[2 * s + 1] as f32];
                    out.min[s] = out.scale[s].map(|x| 4.0 * x);
                }
            }
            Format::Q4K | Format::Q5K => {
                let (d, dmin) = (half_at(block, 0), half_at(block, 2));
                for s in 0..subs {
                    let (sc, m) = scale_min_k4(s, &block[4..16]);
                    (out.scale[s], out.min[s]) = ([d * sc as f32; 2], [dmin * m as f32; 2]);
                }
            }
            Format::Q6K => {
                let d = half_at(block, 208);
                for s in 0..subs {
                    let sc = &block[192 + 8 * (s / 4) + 2 * (s % 4)..][..2];
                    out.scale[s] = [d * sc[0] as i8 as f32, d * sc[1] as i8 as f32];
                    out.min[s] = out.scale[s].map(|x| 32.0 * x);
                }
            }
        }
        out
    }

    /// `block` as float32 into `out` (block_values values).
    pub fn dequantize_block(self, block: &[u8], out: &mut [f32]) {
        let scales = self.scales(block);
        for (s, out) in out[..self.block_values()].chunks_exact_mut(SUB).enumerate() {
            let q = self.values(block, s);
            for (i, o) in out.iter_mut().enumerate() {
                *o = scales.scale[s][i / 16] * q[i] as f32 - scales.min[s][i / 16];
            }
        }
    }
}

/// The scales and minimums of a block's sub-blocks (the first `block_values / 32`
/// used), per half of 16 values.
#[derive(Debug, Clone, Copy)]
pub struct Scales {
    pub scale: [[f32; 2]; 8],
    pub min: [[f32; 2]; 8],
}

/// [`Format::values`] in one AVX2 register, by shifts and masks of whole rows of bytes.
///
/// # Safety
/// The CPU must have AVX2; `block` must be a whole block of format `f`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub unsafe fn values_avx2(f: Format, block: &[u8], s: usize) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    debug_assert_eq!(block.len(), f.block_bytes());
    let p = block.as_ptr();
    let low4 = _mm256_set1_epi8(0x0F);
    // bits `n..` of every byte (16-bit lanes shifted; the caller masks what crossed over)
    let shr = |v: __m256i, n: usize| _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32));
    let at = |offset: usize| _mm256_loadu_si256(p.add(offset) as *const __m256i);
    // 16 bytes of nibbles: low nibbles, then high nibbles
    let nibbles = |offset: usize| {
        let packed = _mm_loadu_si128(p.add(offset) as *const __m128i);
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed), low4)
    };
    match f {
        Format::Q4_0 => nibbles(2),
        Format::Q4_1 => nibbles(4),
        Format::Q5_0 | Format::Q5_1 => {
            let o = if f == Format::Q5_0 { 2 } else { 4 };
            let qh = u32::from_le_bytes([block[o], block[o + 1], block[o + 2], block[o + 3]]);
            // byte j: 0xFF where bit j of qh is set
            let bytes = _mm256_shuffle_epi8(
                _mm256_set1_epi32(qh as i32),
                _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
            );
            let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
            _mm256_or_si256(nibbles(o + 4), _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
        }
        Format::Q2K => _mm256_and_si256(shr(at(16 + 32 * (s / 4)), 2 * (s % 4)), _mm256_set1_epi8(3)),
        Format::Q3K => {
            let low = _mm256_and_si256(shr(at(32 + 32 * (s / 4)), 2 * (s % 4)), _mm256_set1_epi8(3));
            let high = _mm256_and_si256(shr(at(0), s), _mm256_set1_epi8(1));
            _mm256_or_si256(low, _mm256_slli_epi16::<2>(high))
        }
        Format::Q4K => _mm256_and_si256(shr(at(16 + 32 * (s / 2)), 4 * (s % 2)), low4),
        Format::Q5K => {
            let low = _mm256_and_si256(shr(at(48 + 32 * (s / 2)), 4 * (s % 2)), low4);
            let high = _mm256_and_si256(shr(at(16), s), _mm256_set1_epi8(1));
            _mm256_or_si256(low, _mm256_slli_epi16::<4>(high))
        }
        Format::Q6K => {
            let (half, k) = (s / 4, s % 4);
            let low = _mm256_and_si256(shr(at(64 * half + 32 * (k % 2)), 4 * (k / 2)), low4);
            let high = _mm256_and_si256(shr(at(128 + 32 * half), 2 * k), _mm256_set1_epi8(3));
            _mm256_or_si256(low, _mm256_slli_epi16::<4>(high))
        }
    }
}

/// [`Format::values`] in two NEON registers (values 0..16 and 16..32), by shifts and
/// masks of whole rows of bytes, as [`values_avx2`].
///
/// # Safety
/// `block` must be a whole block of format `f` (NEON is part of every aarch64 CPU).
#[cfg(target_arch = "aarch64")]
#[inline(always)]
pub unsafe fn values_neon(f: Format, block: &[u8], s: usize) -> [std::arch::aarch64::uint8x16_t; 2] {
    use std::arch::aarch64::*;
    debug_assert_eq!(block.len(), f.block_bytes());
    let p = block.as_ptr();
    let low4 = vdupq_n_u8(0x0F);
    let mask = |v: [uint8x16_t; 2], m: u8| [vandq_u8(v[0], vdupq_n_u8(m)), vandq_u8(v[1], vdupq_n_u8(m))];
    // bits `n..` of every byte
    let shr = |v: [uint8x16_t; 2], n: usize| {
        let by = vdupq_n_s8(-(n as i8));
        [vshlq_u8(v[0], by), vshlq_u8(v[1], by)]
    };
    let shl = |v: [uint8x16_t; 2], n: i8| [vshlq_u8(v[0], vdupq_n_s8(n)), vshlq_u8(v[1], vdupq_n_s8(n))];
    let or = |a: [uint8x16_t; 2], b: [uint8x16_t; 2]| [vorrq_u8(a[0], b[0]), vorrq_u8(a[1], b[1])];
    let at = |offset: usize| [vld1q_u8(p.add(offset)), vld1q_u8(p.add(offset + 16))];
    // 16 bytes of nibbles: low nibbles, then high nibbles
    let nibbles = |offset: usize| {
        let packed = vld1q_u8(p.add(offset));
        [vandq_u8(packed, low4), vshrq_n_u8::<4>(packed)]
    };
    match f {
        Format::Q4_0 => nibbles(2),
        Format::Q4_1 => nibbles(4),
        Format::Q5_0 | Format::Q5_1 => {
            let o = if f == Format::Q5_0 { 2 } else { 4 };
            // lane l: 0x10 where bit l of the 32-bit qh is set
            let bit: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
            let bit = vld1q_u8(bit.as_ptr());
            let bytes = |i: usize| vcombine_u8(vdup_n_u8(block[o + i]), vdup_n_u8(block[o + i + 1]));
            let fifth = [vtstq_u8(bytes(0), bit), vtstq_u8(bytes(2), bit)];
            or(nibbles(o + 4), mask(fifth, 0x10))
        }
        Format::Q2K => mask(shr(at(16 + 32 * (s / 4)), 2 * (s % 4)), 3),
        Format::Q3K => or(mask(shr(at(32 + 32 * (s / 4)), 2 * (s % 4)), 3), shl(mask(shr(at(0), s), 1), 2)),
        Format::Q4K => mask(shr(at(16 + 32 * (s / 2)), 4 * (s % 2)), 0x0F),
        Format::Q5K => or(mask(shr(at(48 + 32 * (s / 2)), 4 * (s % 2)), 0x0F), shl(mask(shr(at(16), s), 1), 4)),
        Format::Q6K => {
            let (half, k) = (s / 4, s % 4);
            let low = mask(shr(at(64 * half + 32 * (k % 2)), 4 * (k / 2)), 0x0F);
            or(low, shl(mask(shr(at(128 + 32 * half), 2 * k), 3), 4))
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use half::f16;

    pub(crate) const ALL: [Format; 9] =
        [Format::Q4_0, Format::Q4_1, Format::Q5_0, Format::Q5_1, Format::Q2K, Format::Q3K, Format::Q4K, Format::Q5K, Format::Q6K];

    pub(crate) fn ggml(f: Format) -> GgmlDType {
        match f {
            Format::Q4_0 => GgmlDType::Q4_0,
            Format::Q4_1 => GgmlDType::Q4_1,
            Format::Q5_0 => GgmlDType::Q5_0,
            Format::Q5_1 => GgmlDType::Q5_1,
            Format::Q2K => GgmlDType::Q2K,
            Format::Q3K => GgmlDType::Q3K,
            Format::Q4K => GgmlDType::Q4K,
            Format::Q5K => GgmlDType::Q5K,
            Format::Q6K => GgmlDType::Q6K,
        }
    }

    /// Random bytes as blocks (every bit pattern is a valid block), with the half-precision
    /// scales replaced by small finite ones.
    pub(crate) fn random_blocks(f: Format, blocks: usize, seed: u64) -> Vec<u8> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut data: Vec<u8> = (0..blocks * f.block_bytes()).map(|_| next() as u8).collect();
        let halves: &[usize] = match f {
            Format::Q4_0 | Format::Q5_0 => &[0],
            Format::Q4_1 | Format::Q5_1 | Format::Q4K | Format::Q5K => &[0, 2],
            Format::Q2K => &[80, 82],
            Format::Q3K => &[108],
            Format::Q6K => &[208],
        };
        for block in data.chunks_exact_mut(f.block_bytes()) {
            for &at in halves {
                let v = ((next() % 2001) as f32 - 1000.0) / 50_000.0;
                block[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        data
    }

    /// Each format's sub-blocks, dequantized, equal candle's dequantization of the same
    /// bytes (an independent reading of ggml's layouts), value for value.
    #[test]
    fn decode_matches_candles_dequantization() {
        for f in ALL {
            let blocks = 3;
            let data = random_blocks(f, blocks, 7);
            let n = blocks * f.block_values();
            let want = qtensor_from_ggml(ggml(f), &data, vec![n], &Device::Cpu).unwrap().dequantize(&Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
            let mut got = vec![0f32; n];
            for (block, out) in data.chunks_exact(f.block_bytes()).zip(got.chunks_exact_mut(f.block_values())) {
                f.dequantize_block(block, out);
            }
            for i in 0..n {
                assert!((got[i] - want[i]).abs() <= 1e-6 * (1.0 + want[i].abs()), "{f:?} value {i}: {} vs candle {}", got[i], want[i]);
            }
        }
    }

    #[test]
    fn half_conversion_is_exact_for_every_half() {
        for h in 0..=u16::MAX {
            let (got, want) = (f16_to_f32(h), f16::from_bits(h).to_f32());
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{h:#06x}: {got} vs {want}");
        }
    }

    /// The AVX2 unpacking equals the portable one on every sub-block of every format.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_values_equal_portable_values() {
        assert!(std::is_x86_feature_detected!("avx2"), "this test needs an x86-64 CPU with AVX2");
        for f in ALL {
            for block in random_blocks(f, 4, 3).chunks_exact(f.block_bytes()) {
                for s in 0..f.block_values() / SUB {
                    let mut got = [0u8; SUB];
                    // SAFETY: AVX2 checked above; a whole block
                    unsafe { std::arch::x86_64::_mm256_storeu_si256(got.as_mut_ptr() as *mut _, values_avx2(f, block, s)) };
                    assert_eq!(got, f.values(block, s), "{f:?} sub-block {s}");
                }
            }
        }
    }

    /// The NEON unpacking equals the portable one on every sub-block of every format.
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn neon_values_equal_portable_values() {
        for f in ALL {
            for block in random_blocks(f, 4, 3).chunks_exact(f.block_bytes()) {
                for s in 0..f.block_values() / SUB {
                    let mut got = [0u8; SUB];
                    // SAFETY: a whole block; NEON is part of aarch64
                    unsafe {
                        let [lo, hi] = values_neon(f, block, s);
                        std::arch::aarch64::vst1q_u8(got.as_mut_ptr(), lo);
                        std::arch::aarch64::vst1q_u8(got.as_mut_ptr().add(16), hi);
                    }
                    assert_eq!(got, f.values(block, s), "{f:?} sub-block {s}");
                }
            }
        }
    }

    /// Blocks candle quantizes from float dequantize close to the floats (a sanity check that
    /// real weights, not only random bytes, come back).
    #[test]
    fn quantized_floats_come_back() {
        let n = 512;
        let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0).collect();
        let t = Tensor::from_vec(x.clone(), (2, 256), &Device::Cpu).unwrap();
        for f in ALL {
            let q = QTensor::quantize(&t, ggml(f)).unwrap();
            let data = q.data().unwrap();
            let mut got = vec![0f32; n];
            for (block, out) in data.chunks_exact(f.block_bytes()).zip(got.chunks_exact_mut(f.block_values())) {
                f.dequantize_block(block, out);
            }
            let err = got.iter().zip(&x).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < 0.2, "{f:?}: max error {err}");
        }
    }
}
