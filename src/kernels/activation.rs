//! The element-wise functions of a step: e^x without libm (so that loops of it vectorize)
//! and the MLP's `silu(gate) * up`, with AVX-512, AVX2 and portable versions chosen at
//! run time ([`crate::kernels::matvec::kernel`]). Each version runs the same arithmetic
//! per element, so a row's result does not depend on the level's register width.

use crate::kernels::matvec::kernel;

/// e^x for x in [-87, 88] (outside, the value at the nearer end: about 1e-38 below, about
/// 1.65e38 above), without a call to libm, so that a loop of them vectorizes: x = n ln2 +
/// r with |r| <= ln2 / 2, e^r by its Taylor polynomial to degree 6 (relative error below
/// 3e-7, two float32 ulps), 2^n put in the exponent bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    exp_with::<false>(x)
}

/// [`exp`]'s steps with each multiply-add fused (`FUSED`, one rounding instead of two) or
/// not. Fused, for code compiled with FMA only (elsewhere `mul_add` is a library call):
/// the loop is 14 instructions a vector instead of 22 (the softmax of the attention).
#[inline(always)]
pub fn exp_with<const FUSED: bool>(x: f32) -> f32 {
    #[inline(always)]
    fn madd<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
        if FUSED {
            a.mul_add(b, c)
        } else {
            a * b + c
        }
    }
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    const LN2_HI: f32 = 0.693_145_75; // ln 2 split so that n * LN2_HI is exact
    const LN2_LO: f32 = 1.428_606_8e-6;
    // max and min, not clamp: a NaN becomes -87 (as f32::max takes the number), never
    // a NaN exponent
    #[allow(clippy::manual_clamp)]
    let x = x.max(-87.0).min(88.0);
    let t = madd::<FUSED>(x, std::f32::consts::LOG2_E, MAGIC);
    let n = t - MAGIC;
    let r = madd::<FUSED>(-n, LN2_LO, madd::<FUSED>(-n, LN2_HI, x));
    let mut p = 1.0 / 720.0;
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = madd::<FUSED>(r, p, c);
    }
    // n (-126..=127) sits in t's low mantissa bits: integer arithmetic on the bits gives
    // 2^n without a float-to-int conversion (which would not vectorize)
    let exponent = t.to_bits().wrapping_sub(MAGIC.to_bits()).wrapping_add(127) << 23;
    p * f32::from_bits(exponent)
}

/// `out[i] = silu(gate[i]) * up[i]`, silu(g) = g / (1 + e^-g).
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    match kernel() {
        // SAFETY: the CPU has AVX-512F (checked at run time)
        #[cfg(target_arch = "x86_64")]
        crate::kernels::matvec::Kernel::Avx512 => unsafe { silu_mul_avx512(gate, up, out) },
        // SAFETY: the CPU has AVX2 and FMA (checked at run time)
        #[cfg(target_arch = "x86_64")]
        crate::kernels::matvec::Kernel::Avx2 => unsafe { silu_mul_avx2(gate, up, out) },
        _ => silu_mul_body(gate, up, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
    silu_mul_body(gate, up, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    silu_mul_body(gate, up, out)
}

/// A plain loop (an iterator adapter's closure would be compiled apart from the
/// instruction-set version this is inlined into, without its SIMD).
#[inline(always)]
fn silu_mul_body(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for i in 0..out.len() {
        let g = gate[i];
        out[i] = g / (1.0 + exp(-g)) * up[i];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_float64() {
        check_exp(exp);
    }

    /// The fused steps (here `mul_add` is libm's, correctly rounded as an FMA
    /// instruction is, so the same numbers) to the same bound.
    #[test]
    fn fused_exp_matches_float64() {
        check_exp(exp_with::<true>);
    }

    fn check_exp(exp: fn(f32) -> f32) {
        let mut worst = 0f64;
        for i in 0..=400_000 {
            let x = -90.0 + i as f32 * 180.0 / 400_000.0;
            let got = exp(x) as f64;
            if x < -87.0 {
                assert!(got <= 2e-38, "{x}: {got}");
            } else if x > 88.0 {
                assert!(got.is_finite() && got >= (88f64).exp() * (1.0 - 3e-7), "{x}: {got}");
            } else {
                let want = (x as f64).exp();
                worst = worst.max((got - want).abs() / want);
            }
        }
        assert!(worst < 3e-7, "relative error {worst}");
    }

    /// Every level this CPU runs gives the same bits, within two float32 ulps of float64
    /// (relative 3e-7 of the exponential, carried through one division and product),
    /// including gates far beyond the exponential's range.
    #[test]
    fn silu_mul_matches_float64_on_every_level() {
        let n = 1003; // not a multiple of any register width: the tails too
        let gate: Vec<f32> = (0..n).map(|i| (i as f32 - 500.0) * 0.25).collect();
        let up: Vec<f32> = (0..n).map(|i| ((i * 37 % 23) as f32 - 11.0) / 3.0).collect();
        let mut portable = vec![0f32; n];
        silu_mul_body(&gate, &up, &mut portable);
        let mut levels: Vec<(&str, Vec<f32>)> = vec![("dispatched", vec![0f32; n])];
        silu_mul(&gate, &up, &mut levels[0].1);
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                let mut out = vec![0f32; n];
                // SAFETY: the CPU has AVX-512F
                unsafe { silu_mul_avx512(&gate, &up, &mut out) };
                levels.push(("avx512", out));
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                let mut out = vec![0f32; n];
                // SAFETY: the CPU has AVX2 and FMA
                unsafe { silu_mul_avx2(&gate, &up, &mut out) };
                levels.push(("avx2", out));
            }
        }
        for (name, out) in &levels {
            assert_eq!(out, &portable, "{name} against the portable loop");
        }
        for i in 0..n {
            let (g, u) = (gate[i] as f64, up[i] as f64);
            let want = g / (1.0 + (-g).exp()) * u;
            let err = (portable[i] as f64 - want).abs();
            assert!(err <= 1e-6 * want.abs() + 1e-30, "gate {g}, up {u}: {} vs {want}", portable[i]);
        }
    }
}
