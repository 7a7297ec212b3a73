//! Float32 matrix-vector products for decode steps: `out[i] = W[rows.start + i] · x` for
//! a range of rows of a row-major matrix, so that a step's threads each take ranges of
//! one matrix ([`crate::kernels::team`]).
//!
//! A decode step reads every weight once, so these kernels are about streaming memory:
//! one accumulator and one horizontal sum per row; one input reads its rows one after the
//! other, a single sequential stream ([`ROWS_ENV`] selects eight side by side instead).
//! Several inputs (a batch of sequences, a short chunk) share each load of the weights,
//! three or four rows at a time: the same arithmetic per (row, input), so every result is
//! bit-identical to the one-input product's. The instruction set is chosen at run time:
//! AVX-512F, AVX2 + FMA, or a portable version written with eight-lane arrays that the
//! compiler vectorizes (NEON on aarch64, SSE2 on any x86-64). Each is tested against a
//! float64 reference.

/// The environment variable that forces the instruction set of kvcandle's own kernels
/// (`avx512`, `avx2` or `portable`), read once, when a kernel first runs: so that each
/// path can be measured and tested on one machine. Unset (or empty), the best the CPU
/// runs is used.
pub const SIMD_ENV: &str = "KVCANDLE_SIMD";

/// The environment variable that sets where the float32 products' software prefetches
/// put the weights they ask for ahead: `l1` (the first-level cache), `l2` (the second),
/// `l2-batch` or `l1+l2` ([`Prefetch`]), read once, when a kernel first runs, so that
/// each can be measured on any machine.
/// Unset (or empty), [`Prefetch::default_for_cpu`] decides. Results never depend on it.
pub const PREFETCH_ENV: &str = "KVCANDLE_PREFETCH";

/// The environment variable that sets how many weight rows the float32 product of one
/// input reads side by side: `1` (one row after the other, one sequential stream) or `8`
/// (eight rows, eight streams), each prefetched as [`PREFETCH_ENV`] says
/// ([`Prefetch::one_input`]), read once, when a kernel first runs, so that either can be
/// measured on any machine. Unset (or empty): `1` ([`ONE_INPUT_ROWS`]). Results never
/// depend on it: every row has the same arithmetic either way.
pub const ROWS_ENV: &str = "KVCANDLE_ROWS";

/// The values [`ROWS_ENV`] takes, the default first. One row at a time is the pattern a
/// hardware prefetcher follows best: on an AMD EPYC Zen 4 (2026-12-06) eight rows read
/// 19-23 GB/s on one thread where one row read 26-32, as fast as a plain sum of the same
/// bytes (`examples/f32_stream_probe.rs`, weights in 2 MiB pages), and the default model's
/// float32 decode on one thread went from 37.5-39.5 to 44-49 tok/s (AVX2 forced: 39.6-40.3
/// to 43-53). On the Intel Xeon (2026-12-06) the one stream needs software prefetches
/// (one thread: 12.7-12.8 GB/s without, 15.9-17.1 with, eight rows 14.7-14.8), which
/// [`Prefetch::one_input`] asks for where they helped. One multiply-add chain per row is
/// still faster than the memory (16 floats per 4 cycles with AVX-512), and consecutive
/// rows' chains overlap.
pub const ONE_INPUT_ROWS: [usize; 2] = [1, 8];

/// Which cache the float32 kernels' software prefetches fill, and which passes ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefetch {
    /// The first level, every pass but one input's eight rows with AVX-512.
    L1,
    /// The second level, every pass but one input's rows read one at a time.
    L2,
    /// The second level, only in passes of several inputs: one input's rows are left to
    /// the hardware prefetcher.
    L2Batch,
    /// As [`Prefetch::L1`], and passes of several inputs also ask for each line a second
    /// time, further ahead, into the second level (the figures: [`x86::FAR_FLOATS`]): on
    /// the Intel Xeon sixteen first-level miss buffers hold too few lines for the
    /// memory's latency, and requests into the second level take none of them until the
    /// first-level request comes. One input reading one row at a time gained in a probe
    /// but not in the model's decode step, so it keeps [`Prefetch::L1`]'s single request.
    L1L2,
}

impl Prefetch {
    /// The name [`PREFETCH_ENV`] takes.
    pub fn short_name(self) -> &'static str {
        match self {
            Prefetch::L1 => "l1",
            Prefetch::L2 => "l2",
            Prefetch::L2Batch => "l2-batch",
            Prefetch::L1L2 => "l1+l2",
        }
    }

    /// Every level, in [`PREFETCH_ENV`]'s names.
    const ALL: [Prefetch; 4] = [Prefetch::L1, Prefetch::L2, Prefetch::L2Batch, Prefetch::L1L2];

    /// Whether a pass of one input asks for its rows ahead. Read one row at a time
    /// (`one_row`, the default): at `l1` and `l1+l2` only. On the Intel Xeon (then at
    /// `l1`), the default model's float32 decode on one thread went from 21.9-23.1 tok/s
    /// without to 28.6-29.8 with them (AVX2 forced 24.5-24.6 -> 25.7-26.3), where the
    /// second level gave the same as the first; on the Zen 4 (`l2`) the second level gave
    /// the same as none with AVX-512 and less with AVX2 (43-53 -> 33-38 tok/s). Eight rows
    /// at a time: at `l2`, and at `l1` / `l1+l2` with the AVX2 kernel (the AVX-512 kernel,
    /// `avx512`, keeps up with the memory without first-level prefetches). The Q4
    /// kernels' one-input passes over interleaved groups of rows (one stream too) follow
    /// the one-row answer.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn one_input(self, one_row: bool, avx512: bool) -> bool {
        match self {
            Prefetch::L1 | Prefetch::L1L2 => one_row || !avx512,
            Prefetch::L2 => !one_row,
            Prefetch::L2Batch => false,
        }
    }

    /// By measurement (`examples/products_probe.rs`, weights read from memory; the
    /// model's decode steps): the second level on AMD CPUs of family 19h with AVX-512
    /// (Zen 4), the first on family 1Ah and later (Zen 5) and on family 17h (Zen 1 and
    /// Zen 2; measured on a Zen 1), the second level for batches only on other AMD CPUs
    /// (Zen 3, and families before 17h), both levels ([`Prefetch::L1L2`]) on other x86-64
    /// CPUs (Intel), the first elsewhere (where the kernels prefetch nothing).
    ///
    /// On an AMD EPYC Zen 1 (family 17h model 1, AVX2 only, 2 vCPUs, 2026-12-07), unlike
    /// the Zen 3, one input's rows need the requests: the default model's decode of one
    /// sequence, a process per level in turns, 16 tokens of context, medians of 5 rounds
    /// of 8 steps, three runs each: one thread float32 41.5-44.9 ms a step at `l2-batch`
    /// against 33.3-36.4 at `l1` (33.9-34.6 at `l1+l2`, 39.5-42.2 at `l2`), quantized
    /// 13.1-15.3 against 12.0-12.5; two threads float32 22.3-26.2 against 22.1-23.2,
    /// quantized 8.2-8.5 against 8.0-8.3; eight sequences' step the same within the
    /// machine's noise (one thread 66.0-72.1 against 63.6-65.1 ms, two threads 36.0-42.1
    /// against 36.8-40.5).
    ///
    /// On an AMD EPYC Zen 4, to the second level (2 threads): AVX-512, eight inputs
    /// 17.5-18.1 -> 23.7-24.1 GB/s, one input (which prefetches nothing into the first
    /// level) on one thread 14.7-16.3 -> 16.4-18.9 GB/s; AVX2 forced, one input 21.0-23.4
    /// -> 25.9-29.0 GB/s and eight 15.4-15.5 -> 17.5-21.9 GB/s: a first-level prefetch
    /// holds one of the first level's few miss buffers until the line arrives, so fewer
    /// lines are in flight. On an AMD EPYC Zen 3 (AVX2 only), one input without
    /// prefetches (in turns): one thread 12.2-15.1 -> 16.8-18.8 GB/s, 2 threads 23.6-27.4
    /// -> 27.6-32.3 GB/s; its hardware prefetcher alone follows the eight rows better.
    /// Checked again on a Zen 3 on 2026-12-07 with the kernels of then (one row at a time,
    /// interleaved Q4 groups), one thread, a process per level in turns, three rounds, one
    /// float32 sequence after 300 tokens: `l1` 35.6-40.2 ms a step, `l1+l2` 34.5-39.7,
    /// `l2-batch` 30.4-34.3 and `l2` 27.6-37.3 (the same path for one input: the spread is
    /// the machine's), so the Zen 3 keeps `l2-batch`; eight sequences' step 50.2-57.0 ms
    /// at `l2-batch`, 52.5-59.7 at `l1`, 50.7-66.2 at `l2`, 56.1-66.4 at `l1+l2`. On
    /// an AMD EPYC Zen 5 (family 1Ah, AVX-512) the same holds: the default model's
    /// float32 decode of one sequence, `l2` against `l2-batch` in turns, one thread
    /// 67.1-67.9 -> 73.8-75.7 tok/s, two threads 111.8-112.7 -> 121.2-127.3 (eight
    /// sequences the same within noise: 390-394 and 595-619 against 391-394 and 605-608).
    /// Once the batched kernels' loops no longer tested the level at each step, `l1` on
    /// the Zen 5 beat `l2-batch` for several inputs (one sequence is the same: neither
    /// prefetches for it at the AVX-512 level): one thread, in turns, three rounds, a
    /// chunk of 8 tokens 19.8-20.1 -> 18.6-19.4 ms, eight sequences' step 19.5-19.7 ->
    /// 18.2-18.6 ms; two threads the same within noise, and with the AVX2 kernels forced
    /// the same within noise.
    /// On the Intel Xeon, prefetching to the second level instead of the first was slower
    /// or the same; as well as the first, further ahead, faster ([`Prefetch::L1L2`]).
    /// The Zen 5 has not run `l1+l2`.
    pub fn default_for_cpu() -> Prefetch {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: CPUID leaves 0 and 1 exist on every x86-64 CPU
            #[allow(unused_unsafe)]
            let (id, signature) = unsafe { (std::arch::x86_64::__cpuid(0), std::arch::x86_64::__cpuid(1).eax) };
            let vendor: Vec<u8> = [id.ebx, id.edx, id.ecx].iter().flat_map(|r| r.to_le_bytes()).collect();
            Self::default_for(vendor == b"AuthenticAMD", cpu_family(signature), std::arch::is_x86_feature_detected!("avx512f"))
        }
        #[cfg(not(target_arch = "x86_64"))]
        Prefetch::L1
    }

    /// [`Prefetch::default_for_cpu`]'s rule, for an AMD CPU or not, of a CPU family, with
    /// AVX-512F or not.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn default_for(amd: bool, family: u32, avx512: bool) -> Prefetch {
        match (amd, family) {
            (false, _) => Prefetch::L1L2,
            (true, 0x19) if avx512 => Prefetch::L2,
            (true, f) if f >= 0x1A || f == 0x17 => Prefetch::L1,
            (true, _) => Prefetch::L2Batch,
        }
    }
}

/// The CPU family of an x86 CPUID signature (leaf 1, EAX): the base family, plus the
/// extended family when the base is 0Fh (AMD's Zen 1-4 are 17h and 19h, Zen 5 1Ah).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn cpu_family(signature: u32) -> u32 {
    let base = (signature >> 8) & 0xF;
    if base == 0xF {
        base + ((signature >> 20) & 0xFF)
    } else {
        base
    }
}

/// The prefetch level the float32 kernels use, chosen once: [`PREFETCH_ENV`] if set,
/// else [`Prefetch::default_for_cpu`].
pub fn prefetch() -> Prefetch {
    static P: std::sync::OnceLock<Prefetch> = std::sync::OnceLock::new();
    *P.get_or_init(|| forced_prefetch().ok().flatten().unwrap_or_else(Prefetch::default_for_cpu))
}

/// A kernel setting's environment variable: its value as set and that value trimmed and
/// lowercased, or None when it is unset or empty (the default then applies).
fn env_setting(var: &str) -> Option<(String, String)> {
    let value = std::env::var(var).ok()?;
    let wanted = value.trim().to_ascii_lowercase();
    (!wanted.is_empty()).then_some((value, wanted))
}

/// The level [`PREFETCH_ENV`] asks for: `Ok(None)` when it is unset or empty, an error
/// naming the value and the levels when it is none of them.
pub fn forced_prefetch() -> Result<Option<Prefetch>, String> {
    let Some((value, name)) = env_setting(PREFETCH_ENV) else { return Ok(None) };
    match Prefetch::ALL.into_iter().find(|p| p.short_name() == name) {
        Some(p) => Ok(Some(p)),
        None => {
            let names: Vec<&str> = Prefetch::ALL.iter().map(|p| p.short_name()).collect();
            Err(format!("{PREFETCH_ENV}={value:?} is not a prefetch level: use one of {}", names.join(", ")))
        }
    }
}

/// The rows the one-input float32 products read side by side, chosen once: [`ROWS_ENV`]
/// if set, else the first of [`ONE_INPUT_ROWS`].
pub fn one_input_rows() -> usize {
    static R: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *R.get_or_init(|| forced_rows().ok().flatten().unwrap_or(ONE_INPUT_ROWS[0]))
}

/// The rows [`ROWS_ENV`] asks for: `Ok(None)` when it is unset or empty, an error naming
/// the value and the choices when it is none of them.
pub fn forced_rows() -> Result<Option<usize>, String> {
    let Some((value, v)) = env_setting(ROWS_ENV) else { return Ok(None) };
    match v.parse::<usize>() {
        Ok(r) if ONE_INPUT_ROWS.contains(&r) => Ok(Some(r)),
        _ => {
            let choices: Vec<String> = ONE_INPUT_ROWS.iter().map(|r| r.to_string()).collect();
            Err(format!("{ROWS_ENV}={value:?} is not a number of rows: use one of {}", choices.join(", ")))
        }
    }
}

/// The environment variables of the kernels ([`SIMD_ENV`], [`PREFETCH_ENV`],
/// [`ROWS_ENV`]) checked: the first unusable one's message.
pub fn check_env() -> Result<(), String> {
    forced()?;
    forced_prefetch()?;
    forced_rows()?;
    Ok(())
}

/// The instruction set this CPU's kernels use (these, the decode attention's and the
/// quantized products'), chosen once: [`SIMD_ENV`] if it names one the CPU runs,
/// otherwise the best available (an unusable [`SIMD_ENV`] is refused earlier, by
/// [`forced`], when a model loads).
pub fn kernel() -> Kernel {
    static K: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
    *K.get_or_init(|| forced().ok().flatten().unwrap_or_else(best))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Avx512,
    Avx2,
    Portable,
}

fn best() -> Kernel {
    *Kernel::available().last().expect("the portable kernel is always available")
}

/// The level [`SIMD_ENV`] asks for: `Ok(None)` when it is unset or empty, an error naming
/// the value when it is not a level's name or the CPU cannot run that level.
pub fn forced() -> Result<Option<Kernel>, String> {
    let Some((value, wanted)) = env_setting(SIMD_ENV) else { return Ok(None) };
    let names: Vec<&str> = Kernel::available().iter().map(|k| k.short_name()).collect();
    let level = [Kernel::Avx512, Kernel::Avx2, Kernel::Portable]
        .into_iter()
        .find(|k| k.short_name() == wanted)
        .ok_or_else(|| format!("{SIMD_ENV}={value:?} is not a SIMD level: use one of avx512, avx2, portable (this CPU runs {})", names.join(", ")))?;
    if !Kernel::available().contains(&level) {
        return Err(format!("{SIMD_ENV}={value:?}: this CPU cannot run that level; it runs {}", names.join(", ")));
    }
    Ok(Some(level))
}

impl Kernel {
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Avx512 => "avx512f",
            Kernel::Avx2 => "avx2+fma",
            Kernel::Portable => if cfg!(target_arch = "aarch64") { "portable (neon)" } else { "portable" },
        }
    }

    /// The name [`SIMD_ENV`] takes.
    pub fn short_name(self) -> &'static str {
        match self {
            Kernel::Avx512 => "avx512",
            Kernel::Avx2 => "avx2",
            Kernel::Portable => "portable",
        }
    }

    /// The kernels this CPU can run, the best last (for tests: each is checked).
    pub fn available() -> Vec<Kernel> {
        #[allow(unused_mut)] // only x86-64 adds kernels
        let mut v = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            // the AVX2 kernels convert half floats too (F16C came before AVX2 on every x86 CPU)
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c") {
                v.push(Kernel::Avx2);
            }
            if std::is_x86_feature_detected!("avx512f") && v.contains(&Kernel::Avx2) {
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
            Kernel::Avx512 => unsafe { x86::rows_avx512(w, x, out, one_input_rows()) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { x86::rows_avx2(w, x, out, one_input_rows()) },
            _ => rows_portable(w, x, out),
        }
    }
}


/// Bytes of weight rows a batched product keeps in the core's cache while it multiplies
/// them with more inputs than one group ([`Kernel::batch_inputs`]), each pass over a tile
/// bringing in its share of the next ([`Ahead`]): small enough that a task's rows are
/// several tiles, so the weights come from memory during every pass, not only the first.
/// Measured on an AMD Zen 3 (AVX2, eight inputs: two passes of four), in turns:
/// `examples/products_probe.rs`, weights from memory, one thread, 128 KB tiles each pass
/// streaming its own rows 7.4-9.1 GB/s, these 8.2-10.8; the model's float32 chunk of 8
/// after 300 tokens, one thread, 56.1-59.3 -> 51.6-53.6 ms (2 threads: median 32.6 ->
/// 31.9). Tiles of 16 KB and 64 KB were the same as 32 KB.
const TILE_BYTES: usize = 32 * 1024;

impl Kernel {
    /// Inputs the batched kernel multiplies at once (their accumulators fill the
    /// registers: 32 with AVX-512, 16 with AVX2).
    fn batch_inputs(self) -> usize {
        match self {
            Kernel::Avx512 => 8,
            _ => 6,
        }
    }

    /// `outs[m][i] = w[first + i] · xs[m]` for several inputs at once: each weight row is
    /// loaded once for all of them (groups of rows and up to six inputs in registers), and
    /// each row's result is bit-identical to [`Kernel::mul_rows`]'s (the same
    /// accumulators, summed in the same order).
    pub fn mul_rows_batch(self, w: &[f32], xs: &[&[f32]], first: usize, outs: &mut [&mut [f32]]) {
        let Some(x0) = xs.first() else { return };
        let (cols, n) = (x0.len(), outs[0].len());
        debug_assert!(xs.iter().all(|x| x.len() == cols) && outs.iter().all(|o| o.len() == n) && xs.len() == outs.len());
        let w = &w[first * cols..(first + n) * cols];
        // More inputs than one group pass over the rows several times, in groups of even
        // size (eight inputs: two of four, not six and two), in tiles of rows that stay in
        // the core's cache meanwhile (a multiple of eight rows, the kernels' groups).
        let groups = xs.len().div_ceil(self.batch_inputs());
        let size = xs.len().div_ceil(groups);
        let tile = if groups > 1 { (TILE_BYTES / (4 * cols.max(1))).next_multiple_of(8) } else { n }.max(1);
        let tiles = n.div_ceil(tile);
        for (k, start) in (0..n).step_by(tile).enumerate() {
            let end = (start + tile).min(n);
            let w = &w[start * cols..end * cols];
            for (g, (xs, outs)) in xs.chunks(size).zip(outs.chunks_mut(size)).enumerate() {
                // the first pass over the first tile streams it in; each pass over a tile
                // that has a next one brings in its share of that one
                let plan = Ahead { stream: k == 0 && g == 0, next: (k + 1 < tiles).then_some((tile * cols, groups, g)) };
                let mut outs: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[start..end]).collect();
                if let ([x], [out]) = (xs, &mut outs[..]) {
                    // one input: the single-input kernel's groups of rows
                    self.mul_rows(w, x, 0, out);
                    continue;
                }
                match self {
                    // SAFETY: the instruction set was detected at run time (`detect`/`available`).
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Avx512 => unsafe { x86::batch_avx512(w, xs, &mut outs, plan) },
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Avx2 => unsafe { x86::batch_avx2(w, xs, &mut outs, plan) },
                    _ => {
                        let _ = plan; // the portable loop leaves prefetching to the hardware
                        batch_portable(w, xs, &mut outs)
                    }
                }
            }
        }
    }
}

/// Rows of `w` times up to eight inputs, row by row, with the portable row's arithmetic.
fn batch_portable(w: &[f32], xs: &[&[f32]], outs: &mut [&mut [f32]]) {
    let cols = xs[0].len();
    let body = cols / 8 * 8;
    for r in 0..outs[0].len() {
        let row = &w[r * cols..(r + 1) * cols];
        let mut acc = [[0f32; 8]; 8];
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

// Each kernel computes rows in groups and the remaining rows one by one with the
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

/// Which weights a pass of an x86 kernel asks for ahead of the rows it multiplies, one
/// cache line (16 floats) of each row per step: `stream`, the line [`x86::PREFETCH_FLOATS`]
/// on (and at [`Prefetch::L1L2`] also the line [`x86::FAR_FLOATS`] on); `next` = (`dist`,
/// `every`, `phase`), on steps `phase`, `phase + every`, ... of every row, the line `dist`
/// floats on (the same place in the next tile of rows), so that the passes over one tile,
/// each taking its share, bring in the next one while they compute. Never changes a
/// result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Ahead {
    stream: bool,
    next: Option<(usize, usize, usize)>,
}

impl Ahead {
    /// One pass over rows read from memory.
    #[cfg(target_arch = "x86_64")]
    const STREAM: Ahead = Ahead { stream: true, next: None };

    /// For a pass over tiles of `rows` rows (one: a single sequential stream, as the
    /// one-row kernel and a tile kernel's last rows read) and `inputs` inputs (`avx512`:
    /// by the AVX-512 kernel) at the process's [`prefetch`] level: whether it asks for its
    /// rows ahead, and into which cache ([`x86::FIRST`], [`x86::SECOND`], [`x86::BOTH`]).
    #[cfg(target_arch = "x86_64")]
    fn flags(self, rows: usize, inputs: usize, avx512: bool) -> (bool, u8) {
        let level = prefetch();
        let to = match level {
            Prefetch::L1 => x86::FIRST,
            Prefetch::L1L2 if inputs > 1 => x86::BOTH,
            Prefetch::L1L2 => x86::FIRST,
            Prefetch::L2 | Prefetch::L2Batch => x86::SECOND,
        };
        (self.stream && (inputs > 1 || level.one_input(rows == 1, avx512)), to)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Ahead;
    use std::arch::x86_64::*;

    /// How far ahead (in floats) of the columns being multiplied the batched kernels ask
    /// for a row's weights: they spend several instructions per weight, so the hardware
    /// prefetcher alone falls behind (rows are contiguous, so past a row's end this is
    /// the next rows' start).
    ///
    /// Measured (default model, a chunk of 8 tokens, 2 threads, Xeon): 256 floats ahead
    /// 1.81 decode steps, 1,024 1.82, 2,048 1.57, 4,096 1.64; none at all 2.19.
    pub(super) const PREFETCH_FLOATS: usize = 2048;

    /// How far ahead (in floats) passes of several inputs at [`super::Prefetch::L1L2`]
    /// also ask for a row's weights, into the second-level cache. Measured on the Intel
    /// Xeon (`examples/products_probe.rs`'s shapes, eight inputs from memory, GB/s, one
    /// thread / two): none 11.1-11.5 / 20.7-22.4, 4,096 12.1-12.6 / 23.4-23.8, 8,192
    /// 12.4-12.8 / 22.6-23.2; with the first-level requests 512 or 1,024 floats ahead
    /// instead of 2,048, the same or less. The default model on one thread, in turns
    /// (medians): a chunk of 8 tokens after 300, `l1` 45.7-47.2 ms, 8,192 42.2-43.5, 4,096
    /// 44.4-46.6; eight sequences' step at 2,000 tokens 69.4-69.9 ms, 65.5-65.6 and 66.2.
    /// On two threads neither changed beyond noise (the products are then nearer their
    /// arithmetic's pace than the memory's).
    pub(super) const FAR_FLOATS: usize = 8192;

    /// Where a pass's requests ahead go: the first-level cache, the second, or both (the
    /// first [`PREFETCH_FLOATS`] ahead and the second [`FAR_FLOATS`] ahead).
    pub(super) const FIRST: u8 = 0;
    pub(super) const SECOND: u8 = 1;
    pub(super) const BOTH: u8 = 2;

    /// Asks for the line at `p` (never faults), into the second-level cache with `l2`
    /// ([`super::prefetch`]), else into the first.
    #[inline(always)]
    fn ahead(p: *const f32, l2: bool) {
        // SAFETY: a prefetch never faults, whatever the address
        unsafe {
            if l2 {
                _mm_prefetch::<_MM_HINT_T1>(p as *const i8);
            } else {
                _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
            }
        }
    }

    /// `plan`'s share of the next tile at column `c` of rows `p`, the `step`-th line.
    #[inline(always)]
    fn next_tile<const R: usize>(p: &[*const f32; R], c: usize, plan: Ahead, step: &mut usize, l2: bool) {
        if let Some((dist, every, phase)) = plan.next {
            if *step == phase {
                for pj in p {
                    ahead(pj.wrapping_add(c + dist), l2);
                }
            }
            *step += 1;
            if *step == every {
                *step = 0;
            }
        }
    }

    /// The prefetches of one step of the batched loops at column `c` of rows `p`: with
    /// `STREAM` each row's line [`PREFETCH_FLOATS`] ahead (to the second level with `TO` =
    /// [`SECOND`]; with [`BOTH`], to the first and the line [`FAR_FLOATS`] ahead to the
    /// second), with `NEXT` the plan's share of the next tile. Which passes of one input
    /// ask is [`super::Prefetch::one_input`]'s rule (one row at a time on the Xeon needed them;
    /// eight rows at a time with AVX-512 kept up without first-level ones).
    #[inline(always)]
    fn prefetch_step<const R: usize, const STREAM: bool, const TO: u8, const NEXT: bool>(p: &[*const f32; R], c: usize, plan: Ahead, step: &mut usize) {
        if STREAM {
            for pj in p {
                ahead(pj.wrapping_add(c + PREFETCH_FLOATS), TO == SECOND);
                if TO == BOTH {
                    ahead(pj.wrapping_add(c + FAR_FLOATS), true);
                }
            }
        }
        if NEXT {
            next_tile(p, c, plan, step, TO == SECOND);
        }
    }

    /// `$columns::<R, M, STREAM, TO, NEXT>(args)` with the three flags (stream, which
    /// cache, the next tile) turned from values into constants: one loop compiled per way
    /// of prefetching, none of them testing a flag per step (without a stream, [`BOTH`]
    /// is [`FIRST`]: only the stream asks twice).
    macro_rules! by_flags {
        ($columns:ident::<$r:ident, $m:ident>($stream:expr, $to:expr, $next:expr; $($arg:expr),*)) => {
            match ($stream, $to, $next) {
                (false, _, false) => $columns::<$r, $m, false, FIRST, false>($($arg),*),
                (false, SECOND, true) => $columns::<$r, $m, false, SECOND, true>($($arg),*),
                (false, _, true) => $columns::<$r, $m, false, FIRST, true>($($arg),*),
                (true, SECOND, false) => $columns::<$r, $m, true, SECOND, false>($($arg),*),
                (true, BOTH, false) => $columns::<$r, $m, true, BOTH, false>($($arg),*),
                (true, _, false) => $columns::<$r, $m, true, FIRST, false>($($arg),*),
                (true, SECOND, true) => $columns::<$r, $m, true, SECOND, true>($($arg),*),
                (true, BOTH, true) => $columns::<$r, $m, true, BOTH, true>($($arg),*),
                (true, _, true) => $columns::<$r, $m, true, FIRST, true>($($arg),*),
            }
        };
    }

    /// Rows of `w` times one input: with `rows` = 1 one row after the other (one
    /// sequential stream, one chain of fused multiply-adds per row), with 8 eight rows at
    /// a time (eight streams and chains; each load of `x` serves eight rows), then one by
    /// one ([`super::ROWS_ENV`]).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn rows_avx512(w: &[f32], x: &[f32], out: &mut [f32], rows: usize) {
        match rows {
            8 => rows512::<8, 1>(w, &[x], &mut [out], Ahead::STREAM),
            _ => rows512::<1, 1>(w, &[x], &mut [out], Ahead::STREAM),
        }
    }

    /// Rows of `w` times up to eight inputs (groups of four rows, of three from seven
    /// inputs on: (rows + 1) * inputs registers).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn batch_avx512(w: &[f32], xs: &[&[f32]], outs: &mut [&mut [f32]], plan: Ahead) {
        match xs.len() {
            1 => rows512::<4, 1>(w, xs, outs, plan),
            2 => rows512::<4, 2>(w, xs, outs, plan),
            3 => rows512::<4, 3>(w, xs, outs, plan),
            4 => rows512::<4, 4>(w, xs, outs, plan),
            5 => rows512::<4, 5>(w, xs, outs, plan),
            6 => rows512::<4, 6>(w, xs, outs, plan),
            7 => rows512::<3, 7>(w, xs, outs, plan),
            _ => rows512::<3, 8>(w, xs, outs, plan),
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn rows512<const R: usize, const M: usize>(w: &[f32], xs: &[&[f32]], outs: &mut [&mut [f32]], plan: Ahead) {
        let rows = outs[0].len();
        let mut r = 0;
        while r + R <= rows {
            tile512::<R, M>(w, xs, r, outs, plan);
            r += R;
        }
        while r < rows {
            tile512::<1, M>(w, xs, r, outs, plan);
            r += 1;
        }
    }

    /// Rows `r..r + R` of `w` times `M` inputs: one accumulator per (row, input) over
    /// steps of 16 columns, one horizontal sum, the last columns added one by one. Every
    /// (row, input) pair gets this same arithmetic whatever R and M are, so a row's result
    /// depends neither on the rows nor on the inputs it was computed with.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)] // register arrays indexed by row and input
    unsafe fn tile512<const R: usize, const M: usize>(w: &[f32], xs: &[&[f32]], r: usize, outs: &mut [&mut [f32]], plan: Ahead) {
        let cols = xs[0].len();
        let body = cols / 16 * 16;
        let xp: [*const f32; M] = std::array::from_fn(|m| xs[m].as_ptr());
        let p: [*const f32; R] = std::array::from_fn(|j| w.as_ptr().add((r + j) * cols));
        let mut acc = [[_mm512_setzero_ps(); M]; R];
        let (stream, to) = plan.flags(R, M, true);
        // the loop compiled once per way of prefetching, none of them tested per step (the
        // tests and their flags' reloads were a third of the loop's instructions: eight
        // inputs over a matrix in the second-level cache, Zen 5, one thread, 80-81 -> 97
        // G multiply-adds/s; the same with the AVX2 kernel forced, 51-52)
        by_flags!(columns512::<R, M>(stream, to, plan.next.is_some(); &p, &xp, body, plan, &mut acc));
        for j in 0..R {
            for m in 0..M {
                let mut s = _mm512_reduce_add_ps(acc[j][m]);
                for k in body..cols {
                    s += *p[j].add(k) * *xp[m].add(k);
                }
                outs[m][r + j] = s;
            }
        }
    }

    /// [`tile512`]'s steps of 16 columns (the first `body`), each (row, input) pair's
    /// multiply-adds into its accumulator in column order, with [`prefetch_step`]'s
    /// prefetches.
    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::needless_range_loop)] // register arrays indexed by row and input
    unsafe fn columns512<const R: usize, const M: usize, const STREAM: bool, const TO: u8, const NEXT: bool>(
        p: &[*const f32; R],
        xp: &[*const f32; M],
        body: usize,
        plan: Ahead,
        acc: &mut [[__m512; M]; R],
    ) {
        let (mut c, mut step) = (0, 0);
        while c < body {
            prefetch_step::<R, STREAM, TO, NEXT>(p, c, plan, &mut step);
            let wv: [__m512; R] = std::array::from_fn(|j| _mm512_loadu_ps(p[j].add(c)));
            for m in 0..M {
                let x = _mm512_loadu_ps(xp[m].add(c));
                for j in 0..R {
                    acc[j][m] = _mm512_fmadd_ps(wv[j], x, acc[j][m]);
                }
            }
            c += 16;
        }
    }

    /// [`rows_avx512`] with AVX2 registers, over steps of 8 columns.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn rows_avx2(w: &[f32], x: &[f32], out: &mut [f32], rows: usize) {
        match rows {
            8 => rows256::<8, 1>(w, &[x], &mut [out], Ahead::STREAM),
            _ => rows256::<1, 1>(w, &[x], &mut [out], Ahead::STREAM),
        }
    }

    /// [`batch_avx512`] with AVX2's sixteen registers: groups of two rows, of four for two
    /// inputs (eight accumulators, as the one-input kernel has: two inputs' step of the
    /// default model on an AMD EPYC Zen 3, 2 threads, 4 pairs of wheels in turns, 21.0-22.0
    /// -> 20.6-21.2 ms; three rows for four inputs measured the same or slower).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn batch_avx2(w: &[f32], xs: &[&[f32]], outs: &mut [&mut [f32]], plan: Ahead) {
        match xs.len() {
            1 => rows256::<2, 1>(w, xs, outs, plan),
            2 => rows256::<4, 2>(w, xs, outs, plan),
            3 => rows256::<2, 3>(w, xs, outs, plan),
            4 => rows256::<2, 4>(w, xs, outs, plan),
            5 => rows256::<2, 5>(w, xs, outs, plan),
            _ => rows256::<2, 6>(w, xs, outs, plan),
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows256<const R: usize, const M: usize>(w: &[f32], xs: &[&[f32]], outs: &mut [&mut [f32]], plan: Ahead) {
        let rows = outs[0].len();
        let mut r = 0;
        while r + R <= rows {
            tile256::<R, M>(w, xs, r, outs, plan);
            r += R;
        }
        while r < rows {
            tile256::<1, M>(w, xs, r, outs, plan);
            r += 1;
        }
    }

    /// [`tile512`] with AVX2 registers.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)] // register arrays indexed by row and input
    unsafe fn tile256<const R: usize, const M: usize>(w: &[f32], xs: &[&[f32]], r: usize, outs: &mut [&mut [f32]], plan: Ahead) {
        let cols = xs[0].len();
        let body = cols / 8 * 8;
        let xp: [*const f32; M] = std::array::from_fn(|m| xs[m].as_ptr());
        let p: [*const f32; R] = std::array::from_fn(|j| w.as_ptr().add((r + j) * cols));
        let mut acc = [[_mm256_setzero_ps(); M]; R];
        // a cache line (16 floats) of each row per pass, asked for PREFETCH_FLOATS ahead:
        // eight rows are eight streams, more than the hardware prefetcher follows well
        // (measured: default model, Xeon with the AVX2 kernels forced, float32 decode 47.0-47.7 ->
        // 50.2-51.5 tok/s, the AVX-512 kernels 52.2; 4 inputs +3 %, 8 the same) on some
        // CPUs; on others (Zen 3) the hardware prefetcher follows one input's rows better
        // alone ([`super::Prefetch::L2Batch`])
        let (stream, to) = plan.flags(R, M, false);
        let lines = body / 16 * 16;
        by_flags!(columns256::<R, M>(stream, to, plan.next.is_some(); &p, &xp, lines, plan, &mut acc));
        let mut c = lines;
        while c < body {
            let wv: [__m256; R] = std::array::from_fn(|j| _mm256_loadu_ps(p[j].add(c)));
            for m in 0..M {
                let x = _mm256_loadu_ps(xp[m].add(c));
                for j in 0..R {
                    acc[j][m] = _mm256_fmadd_ps(wv[j], x, acc[j][m]);
                }
            }
            c += 8;
        }
        for j in 0..R {
            for m in 0..M {
                let mut s = hsum256(acc[j][m]);
                for k in body..cols {
                    s += *p[j].add(k) * *xp[m].add(k);
                }
                outs[m][r + j] = s;
            }
        }
    }

    /// [`columns512`] with AVX2 registers: steps of a cache line (two of 8 columns) up to
    /// `lines`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    #[allow(clippy::needless_range_loop)] // register arrays indexed by row and input
    unsafe fn columns256<const R: usize, const M: usize, const STREAM: bool, const TO: u8, const NEXT: bool>(
        p: &[*const f32; R],
        xp: &[*const f32; M],
        lines: usize,
        plan: Ahead,
        acc: &mut [[__m256; M]; R],
    ) {
        let (mut c, mut step) = (0, 0);
        while c < lines {
            prefetch_step::<R, STREAM, TO, NEXT>(p, c, plan, &mut step);
            for half in [c, c + 8] {
                let wv: [__m256; R] = std::array::from_fn(|j| _mm256_loadu_ps(p[j].add(half)));
                for m in 0..M {
                    let x = _mm256_loadu_ps(xp[m].add(half));
                    for j in 0..R {
                        acc[j][m] = _mm256_fmadd_ps(wv[j], x, acc[j][m]);
                    }
                }
            }
            c += 16;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_family_adds_the_extended_family_to_base_0f() {
        // CPUID signatures (leaf 1, EAX): AMD Zen 3 (19h), Zen 4 (19h), Zen 5 (1Ah), Zen 1
        // (17h), an Intel Xeon (6: no extended family)
        for (signature, family) in [(0x00A0_0F11, 0x19), (0x00A1_0F11, 0x19), (0x00B0_0F21, 0x1A), (0x0080_0F12, 0x17), (0x0008_06F8, 6)] {
            assert_eq!(cpu_family(signature), family, "{signature:#010x}");
        }
    }

    #[test]
    fn the_default_prefetch_level_by_cpu() {
        // (AMD, family, AVX-512F): Zen 3, Zen 4, Zen 5, an Intel Xeon, Zen 1 / Zen 2, a
        // future AMD family, an AMD family before Zen (15h, Excavator: AVX2)
        for (cpu, level) in [
            ((true, 0x19, false), Prefetch::L2Batch),
            ((true, 0x19, true), Prefetch::L2),
            ((true, 0x1A, true), Prefetch::L1),
            ((false, 6, true), Prefetch::L1L2),
            ((true, 0x17, false), Prefetch::L1),
            ((true, 0x15, false), Prefetch::L2Batch),
            ((true, 0x1B, false), Prefetch::L1),
        ] {
            assert_eq!(Prefetch::default_for(cpu.0, cpu.1, cpu.2), level, "{cpu:?}");
        }
    }

    /// Pseudo-random floats in [-1, 1), from `seed`.
    fn uniform(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    #[test]
    fn batched_rows_equal_single_rows_bit_for_bit() {
        let mut rnd = uniform(777);
        // 41 x 576 and 19 x 1536 span several tiles of rows ([`TILE_BYTES`]), the last partial
        const { assert!(41 * 576 * 4 > 2 * TILE_BYTES && 19 * 1536 * 4 > 2 * TILE_BYTES) };
        for (rows, cols) in [(13, 576), (8, 1536), (41, 576), (19, 1536), (7, 37), (5, 3), (1, 64), (6, 32)] {
            let w: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
            for inputs in [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17] {
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

    /// One row at a time and eight at a time ([`ROWS_ENV`]) give every row the same bits,
    /// on every x86 level the CPU runs (the float64 test checks the default's).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn one_input_row_counts_give_the_same_bits() {
        let mut rnd = uniform(4242);
        for (rows, cols) in [(13, 576), (17, 1536), (7, 37), (9, 3), (1, 64)] {
            let w: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
            let x: Vec<f32> = (0..cols).map(|_| rnd()).collect();
            for k in Kernel::available() {
                let by: Vec<Vec<f32>> = ONE_INPUT_ROWS
                    .iter()
                    .map(|&r| {
                        let mut out = vec![0f32; rows];
                        // SAFETY: each level is one this CPU runs (`Kernel::available`)
                        match k {
                            Kernel::Avx512 => unsafe { x86::rows_avx512(&w, &x, &mut out, r) },
                            Kernel::Avx2 => unsafe { x86::rows_avx2(&w, &x, &mut out, r) },
                            Kernel::Portable => k.mul_rows(&w, &x, 0, &mut out),
                        }
                        out
                    })
                    .collect();
                assert!(by.iter().all(|o| o.iter().zip(&by[0]).all(|(a, b)| a.to_bits() == b.to_bits())), "{k:?} {rows}x{cols}");
            }
        }
    }

    #[test]
    fn every_kernel_matches_float64() {
        let mut rnd = uniform(12345);
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
