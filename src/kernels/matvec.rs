//! Float32 matrix-vector products for decode steps: `out[i] = W[rows.start + i] · x` for
//! a range of rows of a row-major matrix, so that a step's threads each take ranges of
//! one matrix ([`crate::kernels::team`]).
//!
//! A decode step reads every weight once, so these kernels are about streaming memory:
//! four rows at a time (each load of `x` serves four rows), two accumulators per row
//! (eight independent chains of fused multiply-adds), one horizontal sum per row. The
//! instruction set is chosen at run time: AVX-512F, AVX2 + FMA, or a portable version
//! written with eight-lane arrays that the compiler vectorizes (NEON on aarch64, SSE2 on
//! any x86-64). Each is tested against a float64 reference.

/// The instruction set this CPU's kernels use (these and the decode attention's), chosen
/// once.
pub fn kernel() -> Kernel {
    static K: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
    *K.get_or_init(detect)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Avx512,
    Avx2,
    Portable,
}

fn detect() -> Kernel {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            return Kernel::Avx512;
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return Kernel::Avx2;
        }
    }
    Kernel::Portable
}

impl Kernel {
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Avx512 => "avx512f",
            Kernel::Avx2 => "avx2+fma",
            Kernel::Portable => if cfg!(target_arch = "aarch64") { "portable (neon)" } else { "portable" },
        }
    }

    /// The kernels this CPU can run (for tests: each is checked).
    pub fn available() -> Vec<Kernel> {
        #[allow(unused_mut)] // only x86-64 adds kernels
        let mut v = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                v.push(Kernel::Avx2);
            }
            if std::is_x86_feature_detected!("avx512f") {
                v.push(Kernel::Avx512);
            }
        }
        v
    }

    /// `out[i] = w[(first + i) * x.len() ..][.. x.len()] · x`.
    pub fn mul_rows(self, w: &[f32], x: &[f32], first: usize, out: &mut [f32]) {
        let cols = x.len();
        let w = &w[first * cols..(first + out.len()) * cols];
        match self {
            // SAFETY: the instruction set was detected at run time (`detect`/`available`).
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { x86::rows_avx512(w, x, out) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { x86::rows_avx2(w, x, out) },
            _ => rows_portable(w, x, out),
        }
    }
}

impl Kernel {
    /// `outs[m][i] = w[first + i] · xs[m]` for several inputs at once: each weight row is
    /// loaded once for all of them (groups of two rows and four inputs in registers), and
    /// each row's result is bit-identical to [`Kernel::mul_rows`]'s (the same
    /// accumulators, summed in the same order).
    pub fn mul_rows_batch(self, w: &[f32], xs: &[&[f32]], first: usize, outs: &mut [&mut [f32]]) {
        let Some(x0) = xs.first() else { return };
        let (cols, n) = (x0.len(), outs[0].len());
        debug_assert!(xs.iter().all(|x| x.len() == cols) && outs.iter().all(|o| o.len() == n) && xs.len() == outs.len());
        let w = &w[first * cols..(first + n) * cols];
        for (xs, outs) in xs.chunks(4).zip(outs.chunks_mut(4)) {
            if let ([x], [out]) = (xs, &mut *outs) {
                // one input: the single-input kernel's groups of four rows
                self.mul_rows(w, x, 0, out);
                continue;
            }
            match self {
                // SAFETY: the instruction set was detected at run time (`detect`/`available`).
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx512 => unsafe { x86::batch_avx512(w, xs, outs) },
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx2 => unsafe { x86::batch_avx2(w, xs, outs) },
                _ => batch_portable(w, xs, outs),
            }
        }
    }
}

/// Rows of `w` times up to four inputs, row by row, with the portable row's arithmetic.
fn batch_portable(w: &[f32], xs: &[&[f32]], outs: &mut [&mut [f32]]) {
    let cols = xs[0].len();
    let body = cols / 8 * 8;
    for r in 0..outs[0].len() {
        let row = &w[r * cols..(r + 1) * cols];
        let mut acc = [[0f32; 8]; 4];
        for c in (0..body).step_by(8) {
            let wc = &row[c..c + 8];
            for (a, x) in acc.iter_mut().zip(xs) {
                let xc = &x[c..c + 8];
                for k in 0..8 {
                    a[k] += wc[k] * xc[k];
                }
            }
        }
        for (m, (a, x)) in acc.iter().zip(xs).enumerate() {
            let mut s = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
            for c in body..cols {
                s += row[c] * x[c];
            }
            outs[m][r] = s;
        }
    }
}

// Each kernel computes rows in groups of four and the remaining rows one by one with the
// same code (`group::<N>`), so a row's result never depends on which rows it was
// computed with: the threads of a step may split a matrix anywhere.

fn rows_portable(w: &[f32], x: &[f32], out: &mut [f32]) {
    let mut r = 0;
    while r + 4 <= out.len() {
        group_portable::<4>(w, x, r, &mut out[r..r + 4]);
        r += 4;
    }
    while r < out.len() {
        group_portable::<1>(w, x, r, &mut out[r..r + 1]);
        r += 1;
    }
}

#[inline(always)]
fn group_portable<const N: usize>(w: &[f32], x: &[f32], r: usize, out: &mut [f32]) {
    let cols = x.len();
    let body = cols / 8 * 8;
    let mut acc = [[0f32; 8]; N];
    for c in (0..body).step_by(8) {
        let xc = &x[c..c + 8];
        for (j, a) in acc.iter_mut().enumerate() {
            let wc = &w[(r + j) * cols + c..][..8];
            for k in 0..8 {
                a[k] += wc[k] * xc[k];
            }
        }
    }
    for (j, a) in acc.iter().enumerate() {
        let mut s = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
        for c in body..cols {
            s += w[(r + j) * cols + c] * x[c];
        }
        out[j] = s;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn rows_avx512(w: &[f32], x: &[f32], out: &mut [f32]) {
        let mut r = 0;
        while r + 4 <= out.len() {
            group_avx512::<4>(w, x, r, &mut out[r..r + 4]);
            r += 4;
        }
        while r < out.len() {
            group_avx512::<1>(w, x, r, &mut out[r..r + 1]);
            r += 1;
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn group_avx512<const N: usize>(w: &[f32], x: &[f32], r: usize, out: &mut [f32]) {
        let cols = x.len();
        let body = cols / 32 * 32;
        let xp = x.as_ptr();
        let p: [*const f32; N] = std::array::from_fn(|j| w.as_ptr().add((r + j) * cols));
        let mut a = [_mm512_setzero_ps(); N];
        let mut b = [_mm512_setzero_ps(); N];
        let mut c = 0;
        while c < body {
            let x0 = _mm512_loadu_ps(xp.add(c));
            let x1 = _mm512_loadu_ps(xp.add(c + 16));
            for j in 0..N {
                a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(p[j].add(c)), x0, a[j]);
                b[j] = _mm512_fmadd_ps(_mm512_loadu_ps(p[j].add(c + 16)), x1, b[j]);
            }
            c += 32;
        }
        for j in 0..N {
            let mut s = _mm512_reduce_add_ps(_mm512_add_ps(a[j], b[j]));
            for (k, xk) in x.iter().enumerate().skip(body) {
                s += *p[j].add(k) * xk;
            }
            out[j] = s;
        }
    }

    /// Up to four inputs (`M` of them) over every row of `w`, two rows at a time: per
    /// step of 32 columns, each row's two weight vectors are loaded once and multiplied
    /// with every input's, into the same two accumulators per (row, input) as
    /// [`group_avx512`] keeps per row.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn batch_avx512(w: &[f32], xs: &[&[f32]], outs: &mut [&mut [f32]]) {
        match xs.len() {
            1 => batch512::<1>(w, xs, outs),
            2 => batch512::<2>(w, xs, outs),
            3 => batch512::<3>(w, xs, outs),
            _ => batch512::<4>(w, xs, outs),
        }
    }

    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)] // register arrays indexed by row and input
    unsafe fn batch512<const M: usize>(w: &[f32], xs: &[&[f32]], outs: &mut [&mut [f32]]) {
        let cols = xs[0].len();
        let body = cols / 32 * 32;
        let rows = outs[0].len();
        let xp: [*const f32; M] = std::array::from_fn(|m| xs[m].as_ptr());
        let mut r = 0;
        while r < rows {
            let n = (rows - r).min(2);
            let p: [*const f32; 2] = std::array::from_fn(|j| w.as_ptr().add((r + j.min(n - 1)) * cols));
            let mut a = [[_mm512_setzero_ps(); M]; 2];
            let mut b = [[_mm512_setzero_ps(); M]; 2];
            let mut c = 0;
            while c < body {
                let x0: [__m512; M] = std::array::from_fn(|m| _mm512_loadu_ps(xp[m].add(c)));
                let x1: [__m512; M] = std::array::from_fn(|m| _mm512_loadu_ps(xp[m].add(c + 16)));
                for j in 0..2 {
                    let (w0, w1) = (_mm512_loadu_ps(p[j].add(c)), _mm512_loadu_ps(p[j].add(c + 16)));
                    for m in 0..M {
                        a[j][m] = _mm512_fmadd_ps(w0, x0[m], a[j][m]);
                        b[j][m] = _mm512_fmadd_ps(w1, x1[m], b[j][m]);
                    }
                }
                c += 32;
            }
            for j in 0..n {
                for m in 0..M {
                    let mut s = _mm512_reduce_add_ps(_mm512_add_ps(a[j][m], b[j][m]));
                    for k in body..cols {
                        s += *p[j].add(k) * *xp[m].add(k);
                    }
                    outs[m][r + j] = s;
                }
            }
            r += n;
        }
    }

    /// [`batch_avx512`] with AVX2 registers, as [`group_avx2`] accumulates a row.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn batch_avx2(w: &[f32], xs: &[&[f32]], outs: &mut [&mut [f32]]) {
        match xs.len() {
            1 => batch256::<1>(w, xs, outs),
            2 => batch256::<2>(w, xs, outs),
            3 => batch256::<3>(w, xs, outs),
            _ => batch256::<4>(w, xs, outs),
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)] // register arrays indexed by row and input
    unsafe fn batch256<const M: usize>(w: &[f32], xs: &[&[f32]], outs: &mut [&mut [f32]]) {
        let cols = xs[0].len();
        let body = cols / 16 * 16;
        let rows = outs[0].len();
        let xp: [*const f32; M] = std::array::from_fn(|m| xs[m].as_ptr());
        let mut r = 0;
        while r < rows {
            let n = (rows - r).min(2);
            let p: [*const f32; 2] = std::array::from_fn(|j| w.as_ptr().add((r + j.min(n - 1)) * cols));
            let mut a = [[_mm256_setzero_ps(); M]; 2];
            let mut b = [[_mm256_setzero_ps(); M]; 2];
            let mut c = 0;
            while c < body {
                for j in 0..2 {
                    let (w0, w1) = (_mm256_loadu_ps(p[j].add(c)), _mm256_loadu_ps(p[j].add(c + 8)));
                    for m in 0..M {
                        a[j][m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp[m].add(c)), a[j][m]);
                        b[j][m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp[m].add(c + 8)), b[j][m]);
                    }
                }
                c += 16;
            }
            for j in 0..n {
                for m in 0..M {
                    let mut s = hsum256(_mm256_add_ps(a[j][m], b[j][m]));
                    for k in body..cols {
                        s += *p[j].add(k) * *xp[m].add(k);
                    }
                    outs[m][r + j] = s;
                }
            }
            r += n;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn rows_avx2(w: &[f32], x: &[f32], out: &mut [f32]) {
        let mut r = 0;
        while r + 4 <= out.len() {
            group_avx2::<4>(w, x, r, &mut out[r..r + 4]);
            r += 4;
        }
        while r < out.len() {
            group_avx2::<1>(w, x, r, &mut out[r..r + 1]);
            r += 1;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn group_avx2<const N: usize>(w: &[f32], x: &[f32], r: usize, out: &mut [f32]) {
        let cols = x.len();
        let body = cols / 16 * 16;
        let xp = x.as_ptr();
        let p: [*const f32; N] = std::array::from_fn(|j| w.as_ptr().add((r + j) * cols));
        let mut a = [_mm256_setzero_ps(); N];
        let mut b = [_mm256_setzero_ps(); N];
        let mut c = 0;
        while c < body {
            let x0 = _mm256_loadu_ps(xp.add(c));
            let x1 = _mm256_loadu_ps(xp.add(c + 8));
            for j in 0..N {
                a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(p[j].add(c)), x0, a[j]);
                b[j] = _mm256_fmadd_ps(_mm256_loadu_ps(p[j].add(c + 8)), x1, b[j]);
            }
            c += 16;
        }
        for j in 0..N {
            let mut s = hsum256(_mm256_add_ps(a[j], b[j]));
            for (k, xk) in x.iter().enumerate().skip(body) {
                s += *p[j].add(k) * xk;
            }
            out[j] = s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batched_rows_equal_single_rows_bit_for_bit() {
        let mut s = 777u64;
        let mut rnd = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        for (rows, cols) in [(13, 576), (8, 1536), (7, 37), (5, 3), (1, 64), (6, 32)] {
            let w: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
            for inputs in [1, 2, 3, 4, 5, 8, 9] {
                let xs: Vec<Vec<f32>> = (0..inputs).map(|_| (0..cols).map(|_| rnd()).collect()).collect();
                let refs: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
                for k in Kernel::available() {
                    for first in [0, 1] {
                        let n = rows - first;
                        let mut outs = vec![vec![0f32; n]; inputs];
                        let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
                        k.mul_rows_batch(&w, &refs, first, &mut views);
                        for (m, x) in xs.iter().enumerate() {
                            let mut one = vec![0f32; n];
                            k.mul_rows(&w, x, first, &mut one);
                            assert_eq!(outs[m], one, "{k:?} {rows}x{cols}, {inputs} inputs, input {m}, from row {first}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_kernel_matches_float64() {
        let mut s = 12345u64;
        let mut rnd = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        // column counts with and without a tail; row counts with and without a remainder of 4
        for (rows, cols) in [(13, 576), (8, 1536), (7, 37), (5, 3), (1, 64)] {
            let w: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
            let x: Vec<f32> = (0..cols).map(|_| rnd()).collect();
            for k in Kernel::available() {
                let mut whole = vec![0f32; rows];
                k.mul_rows(&w, &x, 0, &mut whole);
                for first in [0, 1] {
                    let n = rows - first;
                    let mut out = vec![0f32; n];
                    k.mul_rows(&w, &x, first, &mut out);
                    // a row's result does not depend on the rows computed with it
                    assert_eq!(out, whole[first..], "{k:?} {rows}x{cols} from row {first}");
                    for (i, got) in out.iter().enumerate() {
                        let r = first + i;
                        let want: f64 = (0..cols).map(|c| w[r * cols + c] as f64 * x[c] as f64).sum();
                        let mag: f64 = (0..cols).map(|c| (w[r * cols + c] as f64 * x[c] as f64).abs()).sum();
                        // float32 accumulation: a few ulps of the sum of magnitudes
                        assert!((*got as f64 - want).abs() <= 4.0 * f32::EPSILON as f64 * mag.max(1e-30) * (cols as f64).sqrt(),
                            "{k:?} {rows}x{cols} row {r}: {got} vs {want}");
                    }
                }
            }
        }
    }
}
