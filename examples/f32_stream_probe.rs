//! How fast one input's float32 product reads its weights from memory, by how many rows
//! it reads side by side (kvcandle's one-input kernels: `KVCANDLE_ROWS` = 1 or 8), against
//! a plain sum of the same bytes. The default model's shapes (30 layers, 424 MB), in one
//! buffer of 2 MiB pages as the model's weights are (`src/memory.rs`; `SMALL_PAGES=1` for
//! 4 KiB pages), each thread (`THREADS`, default 1) taking its share of every matrix's
//! rows. One accumulator per row, as the kernels have. Prints GB/s, median of `ROUNDS`.
//!
//! What it showed on an AMD EPYC Zen 4 (AVX-512, 2026-12-06), one thread, three runs:
//! the sum 26.5-30.8 GB/s; eight rows (second-level prefetches 2,048 floats ahead, the
//! old default there) 18.5-23.1; one row 23.9-32.6, with a second-level prefetch 1,024
//! floats ahead 24.6-32.2; AVX2: eight rows 15.9-20.4, one row 26.9-28.6 (with a
//! prefetch 20.8-22.8). Two threads: every variant 28-33 GB/s, the sum 32.9. With 4 KiB
//! pages the sum read 20.5-22.1 GB/s.
//!
//! On an Intel Xeon (AVX-512, AMX; 2026-12-06), one thread, two runs: the sum 14.4-14.5
//! GB/s; eight rows 14.7-14.8 (with `l2` prefetches 14.0-14.1); one row 12.7-12.8, with
//! a prefetch into either level 512 to 2,048 floats ahead 15.9-17.1; AVX2: eight rows
//! 13.8, one row 14.4-14.7, with a prefetch 15.6-16.6. Two threads: one row 24.5, with a
//! prefetch 32.1-32.4, eight rows 28.9, the sum 27.9.
//!
//!     cargo run --release --example f32_stream_probe
#[cfg(target_arch = "x86_64")]
mod x {
    use std::arch::x86_64::*;
    use std::time::Instant;
    const SHAPES: [(usize, usize); 4] = [(960, 576), (576, 576), (3072, 576), (576, 1536)];

    /// A prefetch of the line at `p`, to the second level with `L2`, else to the first.
    #[inline(always)]
    unsafe fn ahead<const L2: bool>(p: *const f32) {
        if L2 {
            _mm_prefetch::<_MM_HINT_T1>(p as *const i8)
        } else {
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
        }
    }

    /// Rows of `w` times `x`, `R` rows at a time, each row's line `PF` floats ahead
    /// prefetched (none for 0), to the second level with `L2`.
    #[target_feature(enable = "avx512f")]
    unsafe fn rows512<const R: usize, const PF: usize, const L2: bool>(w: &[f32], x: &[f32], out: &mut [f32]) {
        let cols = x.len();
        for (r, o) in (0..out.len() / R * R).step_by(R).zip(out.chunks_exact_mut(R)) {
            let p: [*const f32; R] = std::array::from_fn(|j| w.as_ptr().add((r + j) * cols));
            let mut acc = [_mm512_setzero_ps(); R];
            for c in (0..cols).step_by(16) {
                if PF > 0 {
                    p.iter().for_each(|pj| ahead::<L2>(pj.wrapping_add(c + PF)));
                }
                let xv = _mm512_loadu_ps(x.as_ptr().add(c));
                for (a, pj) in acc.iter_mut().zip(&p) {
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(pj.add(c)), xv, *a);
                }
            }
            for (o, a) in o.iter_mut().zip(acc) {
                *o = _mm512_reduce_add_ps(a);
            }
        }
    }

    /// [`rows512`] with AVX2 registers (prefetches once per line).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows256<const R: usize, const PF: usize, const L2: bool>(w: &[f32], x: &[f32], out: &mut [f32]) {
        let cols = x.len();
        for (r, o) in (0..out.len() / R * R).step_by(R).zip(out.chunks_exact_mut(R)) {
            let p: [*const f32; R] = std::array::from_fn(|j| w.as_ptr().add((r + j) * cols));
            let mut acc = [_mm256_setzero_ps(); R];
            for c in (0..cols).step_by(8) {
                if PF > 0 && c % 16 == 0 {
                    p.iter().for_each(|pj| ahead::<L2>(pj.wrapping_add(c + PF)));
                }
                let xv = _mm256_loadu_ps(x.as_ptr().add(c));
                for (a, pj) in acc.iter_mut().zip(&p) {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(pj.add(c)), xv, *a);
                }
            }
            for (o, a) in o.iter_mut().zip(acc) {
                let lanes: [f32; 8] = std::mem::transmute(a);
                *o = lanes.iter().sum();
            }
        }
    }

    /// Every float of `w` added up, four accumulators (the fastest plain read).
    #[target_feature(enable = "avx512f")]
    unsafe fn sum(w: &[f32], _x: &[f32], out: &mut [f32]) {
        let mut a = [_mm512_setzero_ps(); 4];
        for c in (0..w.len() / 64 * 64).step_by(64) {
            for (j, aj) in a.iter_mut().enumerate() {
                *aj = _mm512_add_ps(*aj, _mm512_loadu_ps(w.as_ptr().add(c + 16 * j)));
            }
        }
        out[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
    }

    type Pass = unsafe fn(&[f32], &[f32], &mut [f32]);

    fn env(name: &str, default: usize) -> usize {
        std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
    }

    pub fn main() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            println!("this probe needs AVX-512F, AVX2 and FMA");
            return;
        }
        let (threads, rounds) = (env("THREADS", 1), env("ROUNDS", 5));
        let total: usize = 30 * SHAPES.iter().map(|&(r, c)| r * c).sum::<usize>();
        // one buffer on a 2 MiB boundary, advised into huge pages before it is written
        let mut buf = vec![0f32; total + (2 << 20) / 4];
        let at = buf.as_ptr().align_offset(2 << 20);
        let all = &mut buf[at..at + total];
        #[cfg(target_os = "linux")]
        if std::env::var_os("SMALL_PAGES").is_none() {
            // SAFETY: advice on a live allocation's whole huge pages; contents unchanged
            unsafe { libc::madvise(all.as_mut_ptr() as *mut libc::c_void, total * 4 / (2 << 20) * (2 << 20), libc::MADV_HUGEPAGE) };
        }
        let mut mats: Vec<(&[f32], usize)> = Vec::new();
        let mut rest = &mut all[..];
        for l in 0..30 {
            for &(r, c) in &SHAPES {
                let (m, tail) = std::mem::take(&mut rest).split_at_mut(r * c);
                m.iter_mut().enumerate().for_each(|(i, v)| *v = ((i + l) % 13) as f32 * 0.01);
                mats.push((m, c));
                rest = tail;
            }
        }
        let huge = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default().lines().find(|l| l.starts_with("AnonHugePages")).map(|l| l.to_string());
        println!("{} MB, {threads} thread(s), {}", total * 4 / 1_000_000, huge.unwrap_or_else(|| "huge pages unknown".into()));
        let xs: Vec<Vec<f32>> = [576usize, 1536].iter().map(|&c| (0..c).map(|i| (i % 7) as f32).collect()).collect();
        // the variants both widths are measured in
        macro_rules! widths {
            ($width:literal, $rows:ident) => {
                [
                    (concat!($width, ", 8 rows"), $rows::<8, 0, false> as Pass),
                    (concat!($width, ", 1 row"), $rows::<1, 0, false>),
                    (concat!($width, ", 1 row, l2 1,024 ahead"), $rows::<1, 1024, true>),
                    (concat!($width, ", 1 row, l2 2,048 ahead"), $rows::<1, 2048, true>),
                    (concat!($width, ", 1 row, l1 1,024 ahead"), $rows::<1, 1024, false>),
                ]
            };
        }
        let mut passes: Vec<(&str, Pass)> = vec![
            ("sum of every float", sum),
            ("AVX-512, 8 rows, l2 2,048 ahead", rows512::<8, 2048, true>),
            ("AVX-512, 1 row, l2 512 ahead", rows512::<1, 512, true>),
        ];
        passes.extend(widths!("AVX-512", rows512));
        passes.extend(widths!("AVX2", rows256));
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); passes.len()];
        for _ in 0..rounds {
            for (&(_, pass), rate) in passes.iter().zip(&mut rates) {
                let t = Instant::now();
                std::thread::scope(|s| {
                    for th in 0..threads {
                        let (mats, xs) = (&mats, &xs);
                        s.spawn(move || {
                            for &(w, c) in mats {
                                let x = if c == 576 { &xs[0] } else { &xs[1] };
                                let n = w.len() / c;
                                let (a, b) = (n * th / threads / 16 * 16, n * (th + 1) / threads / 16 * 16);
                                let mut out = vec![0f32; b - a];
                                // SAFETY: the CPU's features were checked above
                                unsafe { pass(&w[a * c..b * c], x, &mut out) };
                                std::hint::black_box(&out);
                            }
                        });
                    }
                });
                rate.push(total as f64 * 4.0 / t.elapsed().as_secs_f64() / 1e9);
            }
        }
        for ((name, _), mut v) in passes.iter().zip(rates) {
            v.sort_by(f64::total_cmp);
            println!("{name:40} {:.1} GB/s ({:.1}-{:.1})", v[v.len() / 2], v[0], v[v.len() - 1]);
        }
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    x::main();
}
