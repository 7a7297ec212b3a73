//! Rows of eight 32-bit words turned into words of rows, in registers: the layout the
//! rows-in-lanes kernels work in (lane r holds row r), from plain loads of each row
//! instead of gathers. Used for the 8-bit cache's keys (positions in lanes) and the Q8_0
//! VNNI product's blocks (on an Intel Xeon the loads measured the same as eight gathers
//! per block; on an AMD EPYC Zen 4, whose gathers are slow, a third of their time).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Sixteen rows of 8 dwords (`rows[r]`) as 8 registers, register t holding dword t of
/// rows 0..16 in lane order: rows i and i + 8 side by side in one register, an 8 × 8
/// transpose in each 256-bit half (two rounds of interleaving), then each output's four
/// 128-bit lanes picked from two registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn dwords_16x8(rows: &[__m256i; 16]) -> [__m512i; 8] {
    let z: [__m512i; 8] = std::array::from_fn(|i| _mm512_inserti64x4::<1>(_mm512_castsi256_si512(rows[i]), rows[i + 8]));
    // per 128-bit lane: dwords [a0 b0 a1 b1] and [a2 b2 a3 b3] of rows a, b
    let t: [__m512i; 8] = std::array::from_fn(|i| {
        let (a, b) = (z[i & !1], z[i | 1]);
        if i % 2 == 0 { _mm512_unpacklo_epi32(a, b) } else { _mm512_unpackhi_epi32(a, b) }
    });
    // u[k] (k < 4): dword k of rows 0-3 of each half in its first 128-bit lane, dword
    // k + 4 in its second; u[4 + k] the same of rows 4-7
    let u: [__m512i; 8] = std::array::from_fn(|i| {
        let (a, b) = (t[(i / 4) * 4 + (i % 4) / 2], t[(i / 4) * 4 + (i % 4) / 2 + 2]);
        if i % 2 == 0 { _mm512_unpacklo_epi64(a, b) } else { _mm512_unpackhi_epi64(a, b) }
    });
    std::array::from_fn(|k| {
        let (a, b) = (u[k % 4], u[4 + k % 4]);
        let idx = if k < 4 { _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13) } else { _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15) };
        _mm512_permutex2var_epi64(a, idx, b)
    })
}

/// Eight rows of 8 dwords as 8 registers, register t holding dword t of rows 0..8: the
/// 8 × 8 transpose of [`dwords_16x8`] with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) unsafe fn dwords_8x8(rows: &[__m256i; 8]) -> [__m256i; 8] {
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (a, b) = (rows[i & !1], rows[i | 1]);
        if i % 2 == 0 { _mm256_unpacklo_epi32(a, b) } else { _mm256_unpackhi_epi32(a, b) }
    });
    let u: [__m256i; 8] = std::array::from_fn(|i| {
        let (a, b) = (t[(i / 4) * 4 + (i % 4) / 2], t[(i / 4) * 4 + (i % 4) / 2 + 2]);
        if i % 2 == 0 { _mm256_unpacklo_epi64(a, b) } else { _mm256_unpackhi_epi64(a, b) }
    });
    std::array::from_fn(|k| {
        let (a, b) = (u[k % 4], u[4 + k % 4]);
        if k < 4 { _mm256_permute2x128_si256::<0x20>(a, b) } else { _mm256_permute2x128_si256::<0x31>(a, b) }
    })
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn rows_become_words_of_rows() {
        let words: Vec<i32> = (0..16 * 8).map(|i| i * 7 + 3).collect();
        let row = |r: usize| unsafe { _mm256_loadu_si256(words[r * 8..].as_ptr() as *const __m256i) };
        if is_x86_feature_detected!("avx512f") {
            let rows: [__m256i; 16] = std::array::from_fn(row);
            // SAFETY: the CPU has AVX-512F (checked above)
            for (t, x) in unsafe { dwords_16x8(&rows) }.iter().enumerate() {
                let mut got = [0i32; 16];
                unsafe { _mm512_storeu_si512(got.as_mut_ptr() as *mut _, *x) };
                assert_eq!(got, std::array::from_fn(|r| words[r * 8 + t]), "dword {t} of 16 rows");
            }
        }
        if is_x86_feature_detected!("avx2") {
            let rows: [__m256i; 8] = std::array::from_fn(row);
            // SAFETY: the CPU has AVX2 (checked above)
            for (t, x) in unsafe { dwords_8x8(&rows) }.iter().enumerate() {
                let mut got = [0i32; 8];
                unsafe { _mm256_storeu_si256(got.as_mut_ptr() as *mut _, *x) };
                assert_eq!(got, std::array::from_fn(|r| words[r * 8 + t]), "dword {t} of 8 rows");
            }
        }
    }
}
