//! Attention of one new position (a decode step) over the cached keys and values, read
//! in place from the cache's buffers: no copy, no re-layout, no candle tensor per op.
//!
//! The positions of each KV head are split into chunks; a task takes one (KV head, chunk)
//! and, for the query heads that share that KV head, computes the scores, their maximum
//! and exponential sum and the weighted sum of the values: each key and value is read
//! once per step. The chunks of a head are then merged exactly as an online softmax does
//! (rescaled by the difference of their maxima), so tasks spread over every thread even
//! when a model has fewer KV heads than the machine has cores. Several rows at once
//! (sequences of a batch, tokens of a chunk) share each task: it goes through its chunk
//! block by block, every row scoring a block (and later adding its values) before the
//! next, so a block that forks of one prompt all read comes from memory once per step
//! and is read from the first-level cache by the other rows.
//!
//! The portable task's dot products and value accumulation are written with eight
//! independent lanes, which the compiler turns into SIMD (x86 builds carry an AVX2+FMA
//! version chosen at run time; aarch64's NEON is always there); with AVX-512 a task works
//! on blocks of 16 positions, scoring 16 keys into one register by a transposing
//! reduction; a block of float32 keys that three or more rows score is instead transposed
//! once (positions in lanes) and each row's scores are plain FMAs added in the same tree,
//! the same bits with no shuffles per row. A float16 cache is widened to float32 a block (or a chunk) at a time, in
//! a buffer of the thread, never as a whole. Keys of the 8-bit cache are instead
//! transposed as they are widened (positions in lanes, AVX-512 and AVX2), so that their
//! scores are plain FMAs with no horizontal sums: with many rows on one block (forks of
//! a long prompt) the sums were 40 % of the scoring instructions.
//!
//! Many new positions at once (a prefill chunk) take [`prefill_attention`]: a task takes
//! one KV head and a block of [`BLOCK`] consecutive query positions, computes the scores
//! of its query heads over only the positions they may see (the causal triangle's
//! masked part is never computed), the softmax in place with the same exponential, and
//! the weighted sum of the values: two matrix products by gemm, in a buffer each thread
//! keeps, with no score tensor for the whole chunk.

use std::cell::RefCell;
use std::sync::OnceLock;

use half::slice::HalfFloatSliceExt;
use half::f16;

use crate::kernels::activation::exp_with;
use crate::kernels::kv8::{self, Q8Block, QK};
use crate::kernels::matvec::kernel;
use crate::kernels::team::{Shards, Team};
#[cfg(target_arch = "x86_64")]
use crate::kernels::transpose::{dwords_16x8, dwords_8x8};

/// Positions per task: enough work to be worth a hand-off, few enough to spread a
/// 2,048-position cache of 3 KV heads over many threads.
const CHUNK: usize = 256;

/// The cached keys and values of one layer, in blocks of `block_len` positions: block `b`
/// holds positions `b * block_len..`, as (kv_heads, block_len, head_dim) keys and the
/// same values; the first `len` positions are used. Stored as float32, or as float16
/// (half the bytes read per step: each task widens its chunk to float32 in a buffer of
/// its thread, in the core's cache, and runs the float32 kernels on it). Several blocks
/// need a `block_len` that divides [`CHUNK`] and is a multiple of 16 (the AVX-512 task's
/// rows); one block may have any length.
pub struct LayerKv<'a, T = f32> {
    pub blocks: Vec<(&'a [T], &'a [T])>,
    pub block_len: usize,
    pub kv_heads: usize,
    pub len: usize,
    pub head_dim: usize,
}

impl<'a, T: Stored> LayerKv<'a, T> {
    /// One block of `capacity` positions (each head's positions contiguous).
    pub fn contiguous(keys: &'a [T], values: &'a [T], kv_heads: usize, capacity: usize, len: usize, head_dim: usize) -> Self {
        Self { blocks: vec![(keys, values)], block_len: capacity, kv_heads, len, head_dim }
    }

    /// The same, of which only the first `len` positions are used.
    #[cfg(test)]
    fn first(&self, len: usize) -> Self {
        Self { blocks: self.blocks.clone(), block_len: self.block_len, kv_heads: self.kv_heads, len, head_dim: self.head_dim }
    }

    /// Head `h`'s keys and values at `positions`, which lie in one block.
    #[inline]
    fn run(&self, h: usize, positions: std::ops::Range<usize>) -> (&'a [T], &'a [T]) {
        // a shift and a mask for the cache's blocks (a power of two), not a division: a
        // decode task asks once per row and block of 16 positions, twice
        let (b, at) = if self.block_len.is_power_of_two() {
            (positions.start >> self.block_len.trailing_zeros(), positions.start & (self.block_len - 1))
        } else {
            (positions.start / self.block_len, positions.start % self.block_len)
        };
        debug_assert!(at + positions.len() <= self.block_len);
        let (keys, values) = self.blocks[b];
        let row = self.head_dim / T::PER;
        let first = (h * self.block_len + at) * row;
        let n = positions.len() * row;
        (&keys[first..first + n], &values[first..first + n])
    }

    /// Head `h`'s keys and values at `positions`, a run per block they span.
    fn runs(&self, h: usize, positions: std::ops::Range<usize>) -> impl Iterator<Item = (&'a [T], &'a [T])> + '_ {
        let mut p = positions.start;
        std::iter::from_fn(move || {
            (p < positions.end).then(|| {
                let end = ((p / self.block_len + 1) * self.block_len).min(positions.end);
                let run = self.run(h, p..end);
                p = end;
                run
            })
        })
    }
}

thread_local! {
    /// Each thread's float32 copies of a float16 chunk: (keys, values).
    static WIDE: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// float16 to float32, 16 at a time with AVX-512F's conversion where the CPU has it (16
/// values per instruction); elsewhere the `half` crate's conversion (F16C or NEON where
/// there, chosen at run time).
fn widen_into(src: &[f16], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if kernel() == crate::kernels::matvec::Kernel::Avx512 {
        // SAFETY: the CPU has AVX-512F (checked at run time)
        unsafe { widen_avx512(src, dst) };
        return;
    }
    src.convert_to_f32_slice(dst);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_avx512(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len() / 16 * 16;
    for i in (0..n).step_by(16) {
        let h = _mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i);
        _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
    }
    src[n..].convert_to_f32_slice(&mut dst[n..]);
}

/// [`prefill_attention`] over a float16 or 8-bit cache: the positions the chunk sees are
/// widened to float32 once per layer (one task per KV head), then attended as float32.
pub fn prefill_attention_widened<T: Stored>(q: &[f32], seq: usize, kv: &LayerKv<'_, T>) -> Vec<f32> {
    let (d, len) = (kv.head_dim, kv.len);
    let mut keys = vec![0f32; kv.kv_heads * len * d];
    let mut values = vec![0f32; kv.kv_heads * len * d];
    {
        let (ks, vs) = (Shards::new(&mut keys), Shards::new(&mut values));
        Team::global().run(kv.kv_heads, &|h| {
            // SAFETY: each task writes its own head's rows
            let (kd, vd) = unsafe { (ks.part(h * len * d..(h + 1) * len * d), vs.part(h * len * d..(h + 1) * len * d)) };
            let mut at = 0;
            for (k, v) in kv.runs(h, 0..len) {
                let n = k.len() * T::PER;
                T::widen_into(k, &mut kd[at..at + n]);
                T::widen_into(v, &mut vd[at..at + n]);
                at += n;
            }
        });
    }
    prefill_attention(q, seq, &LayerKv::contiguous(&keys, &values, kv.kv_heads, len, len, d))
}

/// How the cache stores its numbers: float32 as is, float16 and the 8-bit blocks
/// ([`crate::kernels::kv8`]) widened to float32 where the kernels read them (a group of
/// positions at a time, in a buffer of the thread, in the core's cache).
pub trait Stored: Copy + Send + Sync + 'static {
    /// Values per stored element (a head's row of `head_dim` values is `head_dim / PER`
    /// elements).
    const PER: usize = 1;
    /// The same numbers as float32 without a copy, where they already are.
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    /// `src` as float32 into `dst` (`PER` values per element).
    fn widen_into(src: &[Self], dst: &mut [f32]);
    /// The same elements as the 8-bit cache's blocks, where they are (the AVX-512 and
    /// AVX2 tasks score those keys from a transposed block, [`Lanes::score_q8`]).
    fn as_q8(_: &[Self]) -> Option<&[Q8Block]> {
        None
    }
}

impl Stored for f32 {
    fn as_f32(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
    fn widen_into(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Stored for f16 {
    fn as_f32(_: &[f16]) -> Option<&[f32]> {
        None
    }
    fn widen_into(src: &[f16], dst: &mut [f32]) {
        widen_into(src, dst);
    }
}

/// What one task found for its rows' query heads over its chunk of positions, in one
/// buffer of three parts ([`Partials::parts`]; one allocation, which the caller frees
/// after the job: three per task were about 1 % of the calling thread's time in a step of
/// eight sequences): entry `i = r * n_rep + rep` is the task's row r's query head rep (of
/// the task's KV head), with `max[i]`, `sum[i]` and `acc[i * d..][..d]` = Σ exp(score -
/// max) · value. A row with no positions in the chunk has entries that are never read.
struct Partials {
    heads: usize,
    data: Vec<f32>,
}

impl Partials {
    /// `heads` entries of `d` values, zero.
    fn new(heads: usize, d: usize) -> Self {
        Self { heads, data: vec![0.0; heads * (d + 2)] }
    }

    /// `(max, sum, acc)`.
    fn parts(&self) -> (&[f32], &[f32], &[f32]) {
        let (max, rest) = self.data.split_at(self.heads);
        let (sum, acc) = rest.split_at(self.heads);
        (max, sum, acc)
    }

    /// `(max, sum, acc)` to write.
    fn parts_mut(&mut self) -> (&mut [f32], &mut [f32], &mut [f32]) {
        let (max, rest) = self.data.split_at_mut(self.heads);
        let (sum, acc) = rest.split_at_mut(self.heads);
        (max, sum, acc)
    }
}

/// `q`: the query heads of the new position, (heads, head_dim), after RoPE; the query
/// heads `h * n_rep .. (h + 1) * n_rep` share KV head `h`. Returns (heads, head_dim).
pub fn decode_attention<T: Stored>(q: &[f32], kv: &LayerKv<'_, T>) -> Vec<f32> {
    attend_with(q, kv, chunk::<T>)
}

/// [`decode_attention`] for several rows at once (row r: query `qs[r]` over `kvs[r]`), in
/// one job for the team: a task takes one (KV head, chunk of positions) for a group of
/// rows and goes through it block by block, every row in turn on each block, so rows
/// that read the same blocks (the tokens of one chunk, forks of one prompt) find them in
/// the core's cache. Each row's arithmetic is exactly [`decode_attention`]'s.
pub fn decode_attention_rows<T: Stored>(qs: &[&[f32]], kvs: &[&LayerKv<'_, T>]) -> Vec<Vec<f32>> {
    attend_rows_with(qs, kvs, chunk::<T>)
}

/// A task over a group of rows for one KV head: each row's query heads of that KV head,
/// its cache and its positions in the task's chunk (empty: none).
/// With 8-bit keys, also each row's query heads rounded for them ([`kv8::Queries`];
/// otherwise empty).
type ChunkFn<T> = fn(&[&[f32]], &[kv8::QueryHeads<'_>], &[&LayerKv<'_, T>], usize, &[std::ops::Range<usize>]) -> Partials;

/// [`decode_attention`] with a given chunk kernel (each instruction-set version is tested).
fn attend_with<T: Stored>(q: &[f32], kv: &LayerKv<'_, T>, chunk: ChunkFn<T>) -> Vec<f32> {
    attend_rows_with(&[q], &[kv], chunk).pop().expect("one row")
}

/// Tasks per thread the rows' attention is split into at least (rows are grouped so).
const TASKS_PER_THREAD: usize = 4;

/// [`decode_attention_rows`] with a given chunk kernel: every (row group, KV head, chunk)
/// task on the team, then each query head's chunks merged as an online softmax does.
fn attend_rows_with<T: Stored>(qs: &[&[f32]], kvs: &[&LayerKv<'_, T>], chunk: ChunkFn<T>) -> Vec<Vec<f32>> {
    let (rows, d, kv_heads) = (qs.len(), kvs[0].head_dim, kvs[0].kv_heads);
    debug_assert!(kvs.iter().all(|kv| kv.head_dim == d && kv.kv_heads == kv_heads) && kvs.len() == rows);
    let heads = qs[0].len() / d;
    let n_rep = heads / kv_heads;
    let chunks_of = |r: usize| kvs[r].len.div_ceil(CHUNK).max(1);
    let chunks = (0..rows).map(chunks_of).max().unwrap_or(1);
    let team = Team::global();
    let groups = (TASKS_PER_THREAD * team.threads()).div_ceil(kv_heads * chunks).clamp(1, rows.max(1));
    let per_group = rows.div_ceil(groups);
    let tasks: Vec<OnceLock<Partials>> = (0..groups * kv_heads * chunks).map(|_| OnceLock::new()).collect();
    // 8-bit keys are scored against the queries rounded to int16: each row's query heads
    // of a KV head by the first task that needs them (not by the caller alone before the
    // job); a task that finds them not yet set rounds them too rather than wait for
    // another's (`get_or_init` would put it to sleep on a futex until woken)
    let rounded: Vec<OnceLock<kv8::Queries>> = if T::as_q8(&[]).is_some() { (0..rows * kv_heads).map(|_| OnceLock::new()).collect() } else { Vec::new() };
    team.run(tasks.len(), &|t| {
        let (g, h, c) = (t / (kv_heads * chunks), t / chunks % kv_heads, t % chunks);
        let group = g * per_group..((g + 1) * per_group).min(rows);
        let q: Vec<&[f32]> = group.clone().map(|r| &qs[r][h * n_rep * d..(h + 1) * n_rep * d]).collect();
        let q8: Vec<kv8::QueryHeads<'_>> = if rounded.is_empty() {
            Vec::new()
        } else {
            group
                .clone()
                .map(|r| {
                    let slot = &rounded[r * kv_heads + h];
                    if slot.get().is_none() {
                        let _ = slot.set(kv8::Queries::new(q[r - group.start], d));
                    }
                    slot.get().expect("set above").heads(0, n_rep)
                })
                .collect()
        };
        let spans: Vec<std::ops::Range<usize>> =
            group.clone().map(|r| if c < chunks_of(r) { c * CHUNK..((c + 1) * CHUNK).min(kvs[r].len) } else { 0..0 }).collect();
        // (a last group may be empty: rows are split into groups of per_group)
        let _ = tasks[t].set(if group.is_empty() { Partials::new(0, d) } else { chunk(&q, &q8, &kvs[group], h, &spans) });
    });
    let tasks: Vec<Partials> = tasks.into_iter().map(|t| t.into_inner().expect("every task ran")).collect();
    // each row's chunks merged, one task a row (one row: on the caller)
    let merged: Vec<OnceLock<Vec<f32>>> = (0..rows).map(|_| OnceLock::new()).collect();
    team.run(rows, &|r| {
        let _ = merged[r].set({
            let (g, i) = (r / per_group, r % per_group);
            let mut out = vec![0.0f32; heads * d];
            for h in 0..kv_heads {
                for rep in 0..n_rep {
                    let e = i * n_rep + rep;
                    let parts = (0..chunks_of(r)).map(|c| &tasks[(g * kv_heads + h) * chunks + c]);
                    let max = parts.clone().fold(f32::NEG_INFINITY, |m, p| m.max(p.parts().0[e]));
                    let y = &mut out[(h * n_rep + rep) * d..][..d];
                    let mut sum = 0.0f32;
                    for p in parts {
                        let (p_max, p_sum, p_acc) = p.parts();
                        let w = (p_max[e] - max).exp();
                        sum += p_sum[e] * w;
                        for (o, a) in y.iter_mut().zip(&p_acc[e * d..][..d]) {
                            *o += w * a;
                        }
                    }
                    y.iter_mut().for_each(|o| *o /= sum);
                }
            }
            out
        });
    });
    merged.into_iter().map(|m| m.into_inner().expect("every row merged")).collect()
}

/// One (KV head, chunk of positions) task for a group of rows, on the best instruction set
/// the CPU has.
fn chunk<T: Stored>(qs: &[&[f32]], q8: &[kv8::QueryHeads<'_>], kvs: &[&LayerKv<'_, T>], h: usize, spans: &[std::ops::Range<usize>]) -> Partials {
    match kernel() {
        // SAFETY: the CPU has AVX-512F, BW and VNNI (checked at run time)
        #[cfg(target_arch = "x86_64")]
        crate::kernels::matvec::Kernel::Avx512 if avx512_bw() && std::is_x86_feature_detected!("avx512vnni") => unsafe { chunk_avx512_vnni(qs, q8, kvs, h, spans) },
        // SAFETY: the CPU has AVX-512F and BW (checked at run time)
        #[cfg(target_arch = "x86_64")]
        crate::kernels::matvec::Kernel::Avx512 if avx512_bw() => unsafe { chunk_avx512(qs, q8, kvs, h, spans) },
        // SAFETY: the CPU has AVX2 and FMA (checked at run time; the AVX-512 level implies
        // them: an AVX-512F CPU without BW takes the AVX2 task)
        #[cfg(target_arch = "x86_64")]
        crate::kernels::matvec::Kernel::Avx512 | crate::kernels::matvec::Kernel::Avx2 => unsafe { chunk_avx2(qs, q8, kvs, h, spans) },
        _ => chunk_portable(qs, q8, kvs, h, spans),
    }
}

/// Whether the CPU has AVX512-BW (16-bit lanes), which the AVX-512 task's 8-bit keys take.
#[cfg(target_arch = "x86_64")]
fn avx512_bw() -> bool {
    std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw")
}

/// Positions per block of the AVX-512 task: one register's worth of scores.
#[cfg(target_arch = "x86_64")]
const LANES: usize = 16;
/// Blocks ahead whose keys the AVX-512 task prefetches (while the current block's values
/// are prefetched for the value pass): one measured best of 1, 2 and 4 (a few per cent).
#[cfg(target_arch = "x86_64")]
const PF_K: usize = 1;

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Each thread's buffers for one decode task: (scores, one block of rows as float32,
    /// one block of float32 keys transposed).
    static DECODE: RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// A block's value rows as [`Lanes::accumulate`] reads them: `m` float32 rows of d, or
/// the 8-bit cache's blocks (m × d / 32), widened in registers as [`kv8::widen_into`]
/// widens them (each value its int8 times its block's scale, exact), so the same float32
/// values and the same sums. A block of 8-bit values that one row reads is read so, not
/// widened into a buffer and read back (one row over 2,000 positions of one layer, AMD
/// Zen 4, one thread: hot 109-113 -> 100-102 us, cold 152-155 -> 134-149 us; no change
/// with the AVX2 task forced there); a block that several rows read is widened once.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum Values<'a> {
    F32(*const f32),
    Q8(&'a [Q8Block]),
}

/// What an instruction-set version of the decode task supplies to [`rows_task`]: its
/// block of positions (one register of scores) and its two loops over a block.
#[cfg(target_arch = "x86_64")]
trait Lanes {
    /// Positions per block: one register's worth of scores.
    const LANES: usize;
    /// Blocks ahead whose keys are prefetched.
    const AHEAD: usize;
    /// The head sizes it takes are multiples of this (others take the portable task).
    const DIMS: usize;
    /// Each query head `r` of `q` (query heads × d) against the block's `m` keys (`k`:
    /// `LANES` rows of d, zero past m): the scaled scores into `out[r * stride..][..m]`.
    unsafe fn score(q: &[f32], k: *const f32, d: usize, m: usize, out: *mut f32, stride: usize);
    /// Adds the block's weighted values (`v`: its `m` rows of d) to each query head's
    /// accumulator (`acc[r * d..][..d]`, weights in `scores` row r of `n`, the block from
    /// `i0`).
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate(acc: &mut [f32], scores: &[f32], n: usize, i0: usize, m: usize, v: Values<'_>, d: usize);
    /// Whether [`Lanes::keys_t`] and [`Lanes::score_t`] are there: float32 keys that
    /// several rows score are transposed once (positions in lanes) and scored without
    /// the per-head reduction across lanes, the same bits as [`Lanes::score`].
    const TRANSPOSES: bool = false;
    /// A block of `LANES` float32 key rows of d (`k`, zero past the used rows) as d rows
    /// of `LANES` positions into `kt` (dimension j at `kt[j * LANES..]`).
    unsafe fn keys_t(_k: *const f32, _d: usize, _kt: &mut [f32]) {
        unreachable!("only where TRANSPOSES")
    }
    /// [`Lanes::score`] from the block as [`Lanes::keys_t`] wrote it: every score the
    /// same bits, since each position's products are added in the same order.
    unsafe fn score_t(_q: &[f32], _kt: *const f32, _d: usize, _m: usize, _out: *mut f32, _stride: usize) {
        unreachable!("only where TRANSPOSES")
    }
    /// Keys in 8-bit blocks are scored in integers from a transposed block, not from
    /// widened rows: the block's `m` key rows (`rows`: m × d / 32 blocks) into `block`
    /// as int16 pairs, pair j of the `LANES` positions ([`kv8::pair_dims`]'s order within
    /// each group of 32 dimensions, zero past m) in the 32-bit words
    /// `block[j * LANES..][..LANES]`, then each group's key scales (float32) at
    /// `block[d / 2 * LANES + g * LANES..]`.
    unsafe fn q8_keys(rows: &[Q8Block], m: usize, d: usize, block: &mut [f32]);
    /// [`Lanes::score`] over a block [`Lanes::q8_keys`] wrote, for the query heads `q`
    /// rounded as [`kv8::Queries`] (each score that struct's sum, divided by √d).
    unsafe fn score_q8(q: &kv8::QueryHeads<'_>, block: *const f32, d: usize, m: usize, out: *mut f32, stride: usize);
}

/// `$kernel::<G>` over the query heads `q` (rows of d) in groups of up to 3 (`G` of them a
/// group), each group's scores into `out` from its first head's row (rows of `stride`):
/// the grouping [`score16`] and [`Lanes::score_t`] share.
#[cfg(target_arch = "x86_64")]
macro_rules! in_head_groups {
    ($kernel:ident, $q:expr, $k:expr, $d:expr, $m:expr, $out:expr, $stride:expr) => {{
        let (q, d, out, stride): (&[f32], usize, *mut f32, usize) = ($q, $d, $out, $stride);
        for r0 in (0..q.len() / d).step_by(3) {
            let (qr, o) = (q.as_ptr().add(r0 * d), out.add(r0 * stride));
            match q.len() / d - r0 {
                1 => $kernel::<1>(qr, $k, d, $m, o, stride),
                2 => $kernel::<2>(qr, $k, d, $m, o, stride),
                _ => $kernel::<3>(qr, $k, d, $m, o, stride),
            }
        }
    }};
}

/// The AVX-512 task: blocks of 16 positions; head sizes that are a multiple of 64.
/// Scores: for each query head, the 16 keys' products with it stay in 16 registers, and
/// one transposing reduction (45 instructions) turns them into one register of 16
/// scores, where a horizontal sum per score would take about 8 each; up to 3 query
/// heads share each load of a key ([`score16_heads`]). Values: groups of
/// up to 4 query heads keep 4 × 64 dimensions of accumulators in registers over a block.
///
/// `VNNI`: 8-bit keys' int16 pairs multiplied and added in one instruction (AVX512-VNNI's
/// `vpdpwssd`), else in two (AVX512-BW's `vpmaddwd` and an add); the same sums either way.
#[cfg(target_arch = "x86_64")]
struct Avx512<const VNNI: bool>;

#[cfg(target_arch = "x86_64")]
impl<const VNNI: bool> Lanes for Avx512<VNNI> {
    const LANES: usize = LANES;
    const AHEAD: usize = PF_K;
    const DIMS: usize = 64;
    #[inline(always)]
    unsafe fn score(q: &[f32], k: *const f32, d: usize, m: usize, out: *mut f32, stride: usize) {
        score16(q, k, d, m, out, stride)
    }
    const TRANSPOSES: bool = true;
    #[inline(always)]
    unsafe fn keys_t(k: *const f32, d: usize, kt: &mut [f32]) {
        keys16_t(k, d, kt)
    }
    #[inline(always)]
    unsafe fn score_t(q: &[f32], kt: *const f32, d: usize, m: usize, out: *mut f32, stride: usize) {
        in_head_groups!(score16_t_heads, q, kt, d, m, out, stride)
    }
    #[inline(always)]
    unsafe fn q8_keys(rows: &[Q8Block], m: usize, d: usize, block: &mut [f32]) {
        q8_keys16(rows, m, d, block)
    }
    #[inline(always)]
    unsafe fn score_q8(q: &kv8::QueryHeads<'_>, block: *const f32, d: usize, m: usize, out: *mut f32, stride: usize) {
        let heads = q.scales.len() / (d / QK);
        for r0 in (0..heads).step_by(4) {
            let out = out.add(r0 * stride);
            match (heads - r0, VNNI) {
                (1, true) => score_q8_16_vnni::<1>(q, r0, block, d, m, out, stride),
                (2, true) => score_q8_16_vnni::<2>(q, r0, block, d, m, out, stride),
                (3, true) => score_q8_16_vnni::<3>(q, r0, block, d, m, out, stride),
                (_, true) => score_q8_16_vnni::<4>(q, r0, block, d, m, out, stride),
                (1, false) => score_q8_16_bw::<1>(q, r0, block, d, m, out, stride),
                (2, false) => score_q8_16_bw::<2>(q, r0, block, d, m, out, stride),
                (3, false) => score_q8_16_bw::<3>(q, r0, block, d, m, out, stride),
                (_, false) => score_q8_16_bw::<4>(q, r0, block, d, m, out, stride),
            }
        }
    }
    #[inline(always)]
    unsafe fn accumulate(acc: &mut [f32], scores: &[f32], n: usize, i0: usize, m: usize, v: Values<'_>, d: usize) {
        let heads = acc.len() / d;
        for r0 in (0..heads).step_by(4) {
            let a = &mut acc[r0 * d..];
            // each kind of rows its own instance (a branch per position cost eight rows
            // on one block of 8-bit values, widened once, 4-6 %)
            macro_rules! heads {
                ($g:literal) => {
                    match v {
                        Values::F32(_) => accumulate::<$g, false>(a, scores, n, r0, i0, m, v, d),
                        Values::Q8(_) => accumulate::<$g, true>(a, scores, n, r0, i0, m, v, d),
                    }
                };
            }
            match heads - r0 {
                1 => heads!(1),
                2 => heads!(2),
                3 => heads!(3),
                _ => heads!(4),
            }
        }
    }
}

/// [`Avx512`]'s scores of one block: query heads in groups of up to 3, each group's
/// keys loaded once for all of its heads ([`score16_heads`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn score16(q: &[f32], k: *const f32, d: usize, m: usize, out: *mut f32, stride: usize) {
    in_head_groups!(score16_heads, q, k, d, m, out, stride)
}

/// The scores of `G` query heads (`q`: G rows of d) against a block of 16 keys, the
/// block in two halves of 8 positions: for each 16 dimensions, the G heads' query
/// registers stay while each key's is loaded once for all of them (8 × G accumulators),
/// where one head at a time loads every key once per head (`examples/attention_probe.rs`,
/// Zen 5, one thread, 2,048 positions, in turns: one row 73-76 -> 68 us a layer, eight
/// rows over one prompt's blocks 392-395 -> 333-341 us). Each key's products with a
/// head are one register of 16 lanes, summed over the dimensions in order and then
/// across lanes by one fixed tree ([`reduce8_half`] on each half, [`pair_lanes`] on the
/// two): each score is the same bits whatever the grouping of heads.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)] // register arrays indexed by head and block row
unsafe fn score16_heads<const G: usize>(q: *const f32, k: *const f32, d: usize, m: usize, out: *mut f32, stride: usize) {
    use std::arch::x86_64::*;
    const HALF: usize = LANES / 2;
    let scale = _mm512_set1_ps(1.0 / (d as f32).sqrt());
    let mut halves = [[_mm512_setzero_ps(); 2]; G];
    for half in 0..2 {
        let k = k.add(half * HALF * d);
        let mut acc = [[_mm512_setzero_ps(); HALF]; G];
        for c in (0..d).step_by(16) {
            let qc: [__m512; G] = std::array::from_fn(|g| _mm512_loadu_ps(q.add(g * d + c)));
            for j in 0..HALF {
                let kj = _mm512_loadu_ps(k.add(j * d + c));
                for g in 0..G {
                    acc[g][j] = _mm512_fmadd_ps(kj, qc[g], acc[g][j]);
                }
            }
        }
        for g in 0..G {
            halves[g][half] = reduce8_half(&acc[g]);
        }
    }
    for g in 0..G {
        let s = _mm512_mul_ps(pair_lanes(halves[g][0], halves[g][1]), scale);
        let o = out.add(g * stride);
        if m == LANES {
            _mm512_storeu_ps(o, s);
        } else {
            _mm512_mask_storeu_ps(o, ((1u32 << m) - 1) as u16, s);
        }
    }
}

/// [`Avx512`]'s transposed float32 keys ([`Lanes::keys_t`]): each 16 x 16 tile of the
/// block (16 positions, 16 dimensions) as two [`dwords_16x8`], one register per
/// dimension holding the 16 positions' values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn keys16_t(k: *const f32, d: usize, kt: &mut [f32]) {
    use std::arch::x86_64::*;
    debug_assert!(kt.len() >= LANES * d && d.is_multiple_of(16));
    let out = kt.as_mut_ptr();
    for c in (0..d).step_by(8) {
        let rows: [__m256i; LANES] = std::array::from_fn(|p| _mm256_loadu_si256(k.add(p * d + c) as *const __m256i));
        for (j, x) in dwords_16x8(&rows).iter().enumerate() {
            _mm512_storeu_si512(out.add((c + j) * LANES) as *mut _, *x);
        }
    }
}

/// [`score16_heads`] over keys transposed by [`keys16_t`], the same bits: there, lane l
/// of a key's register sums the products of dimensions l, 16 + l, ... in order, and
/// [`reduce8_half`] and [`pair_lanes`] add the 16 lanes as ((l0 + l2) + (l1 + l3)) per
/// quarter l = 4i..4i + 4, then (quarters 0 + 1) + (quarters 2 + 3). Here each lane l is
/// one register of 16 positions (the same products in the same order, from a
/// broadcast query value and one row of the transposed block), added in that tree with
/// no shuffles, and each row of the block is loaded once for all `G` heads.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)] // register arrays indexed by head and lane
unsafe fn score16_t_heads<const G: usize>(q: *const f32, kt: *const f32, d: usize, m: usize, out: *mut f32, stride: usize) {
    use std::arch::x86_64::*;
    let scale = _mm512_set1_ps(1.0 / (d as f32).sqrt());
    let (mut low, mut high) = ([_mm512_setzero_ps(); G], [_mm512_setzero_ps(); G]);
    for quarter in 0..4 {
        let mut acc = [[_mm512_setzero_ps(); 4]; G];
        for c in (0..d).step_by(16) {
            for e in 0..4 {
                let j = c + 4 * quarter + e;
                let k = _mm512_loadu_ps(kt.add(j * LANES));
                for g in 0..G {
                    acc[g][e] = _mm512_fmadd_ps(k, _mm512_set1_ps(*q.add(g * d + j)), acc[g][e]);
                }
            }
        }
        for g in 0..G {
            let s = _mm512_add_ps(_mm512_add_ps(acc[g][0], acc[g][2]), _mm512_add_ps(acc[g][1], acc[g][3]));
            match quarter {
                0 => low[g] = s,
                1 => low[g] = _mm512_add_ps(low[g], s),
                2 => high[g] = s,
                _ => high[g] = _mm512_add_ps(high[g], s),
            }
        }
    }
    for g in 0..G {
        let s = _mm512_mul_ps(_mm512_add_ps(low[g], high[g]), scale);
        let o = out.add(g * stride);
        if m == LANES {
            _mm512_storeu_ps(o, s);
        } else {
            _mm512_mask_storeu_ps(o, ((1u32 << m) - 1) as u16, s);
        }
    }
}

/// [`Avx512`]'s transposed 8-bit keys ([`Lanes::q8_keys`]): for each group of 32
/// dimensions, the 16 rows' 32 int8 values are 16 × 8 dwords, transposed in registers
/// ([`dwords_16x8`]) into 8 registers of one dword (4 dimensions) per position, each
/// split by 16-bit shifts into its even bytes and its odd bytes as int16 (dimensions 4k,
/// 4k + 2 and 4k + 1, 4k + 3: [`kv8::pair_dims`]): 3 instructions per 32 values, once
/// for all the query heads and rows that score the block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn q8_keys16(rows: &[Q8Block], m: usize, d: usize, block: &mut [f32]) {
    use std::arch::x86_64::*;
    let groups = d / QK;
    debug_assert!(rows.len() == m * groups && m <= LANES && block.len() >= LANES * (d / 2 + groups));
    let out = block.as_mut_ptr();
    let pairs = out as *mut __m512i;
    for g in 0..groups {
        let r: [__m256i; 16] =
            std::array::from_fn(|j| if j < m { _mm256_loadu_si256(rows[j * groups + g].values().as_ptr() as *const __m256i) } else { _mm256_setzero_si256() });
        for (k, &x) in dwords_16x8(&r).iter().enumerate() {
            let at = pairs.add(g * QK / 2 + 2 * k);
            _mm512_storeu_si512(at as *mut _, _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(x)));
            _mm512_storeu_si512(at.add(1) as *mut _, _mm512_srai_epi16::<8>(x));
        }
        _mm512_storeu_ps(out.add(d / 2 * LANES + g * LANES), kv8::scales16(&rows[g..], groups, m));
    }
}

/// [`Avx512`]'s scores of `G` query heads (from `r0` of `q`) over a block of transposed
/// 8-bit keys: per group of 32 dimensions, each head's 16 integer sums in 2 registers of
/// pair products (a query pair broadcast against one pair of dimensions of 16 positions:
/// `$dot`), then converted and multiplied by the keys' and the query's scales.
#[cfg(target_arch = "x86_64")]
macro_rules! score_q8_16 {
    ($name:ident, $features:literal, $dot:ident) => {
        #[target_feature(enable = $features)]
        #[allow(clippy::needless_range_loop)] // register arrays indexed by head
        unsafe fn $name<const G: usize>(q: &kv8::QueryHeads<'_>, r0: usize, block: *const f32, d: usize, m: usize, out: *mut f32, stride: usize) {
            use std::arch::x86_64::*;
            let (groups, keys) = (d / QK, block as *const __m512i);
            let mut total = [_mm512_setzero_ps(); G];
            for g in 0..groups {
                let mut acc = [[_mm512_setzero_si512(); 4]; G];
                for j in (0..QK / 2).step_by(4) {
                    for b in 0..4 {
                        let k = _mm512_loadu_si512(keys.add(g * QK / 2 + j + b) as *const _);
                        for h in 0..G {
                            let pair: *const i32 = q.pairs.as_ptr().add((r0 + h) * d / 2 + g * QK / 2 + j + b);
                            acc[h][b] = $dot!(acc[h][b], k, pair);
                        }
                    }
                }
                let s = _mm512_loadu_ps(block.add(d / 2 * LANES + g * LANES));
                for h in 0..G {
                    let sum = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_add_epi32(acc[h][0], acc[h][1]), _mm512_add_epi32(acc[h][2], acc[h][3])));
                    let w = _mm512_mul_ps(s, _mm512_set1_ps(*q.scales.get_unchecked((r0 + h) * groups + g)));
                    total[h] = if g == 0 { _mm512_mul_ps(sum, w) } else { _mm512_fmadd_ps(sum, w, total[h]) };
                }
            }
            let scale = _mm512_set1_ps(1.0 / (d as f32).sqrt());
            for h in 0..G {
                let s = _mm512_mul_ps(total[h], scale);
                let o = out.add(h * stride);
                if m == LANES {
                    _mm512_storeu_ps(o, s);
                } else {
                    _mm512_mask_storeu_ps(o, ((1u32 << m) - 1) as u16, s);
                }
            }
        }
    };
}
/// One `vpdpwssd` of a key register and a query pair (`*$q`, an int16 pair) broadcast
/// from memory by the instruction itself (`{1to16}`), written as inline assembly rather
/// than `_mm512_dpwssd_epi32`: LLVM's machine combiner splits that intrinsic into
/// `vpmaddwd` + `vpaddd` (the same sums) unless the target CPU is tuned as having a fast
/// one, which the generic x86-64 target kvcandle is built for is not (llvm-project issue
/// 84182): two instructions where one runs at the same rate. The broadcast in the
/// instruction spares a `vpbroadcastd` per product, which the assembly with a register
/// operand needed (LLVM cannot fold a load into inline assembly): eight rows on one
/// layer's 2,000 8-bit positions, hot, AMD Zen 4, one thread, 472-481 -> 441-460 us.
#[cfg(target_arch = "x86_64")]
macro_rules! dot_vnni {
    ($acc:expr, $k:expr, $q:expr) => {{
        let mut acc = $acc;
        let q: *const i32 = $q;
        std::arch::asm!("vpdpwssd {acc}, {k}, dword ptr [{q}]{{1to16}}", acc = inout(zmm_reg) acc, k = in(zmm_reg) $k, q = in(reg) q, options(pure, readonly, nostack, preserves_flags));
        acc
    }};
}
#[cfg(target_arch = "x86_64")]
macro_rules! dot_bw {
    ($acc:expr, $k:expr, $q:expr) => {
        _mm512_add_epi32($acc, _mm512_madd_epi16($k, _mm512_set1_epi32(*$q)))
    };
}
#[cfg(target_arch = "x86_64")]
score_q8_16!(score_q8_16_vnni, "avx512f,avx512bw,avx512vnni", dot_vnni);
#[cfg(target_arch = "x86_64")]
score_q8_16!(score_q8_16_bw, "avx512f,avx512bw", dot_bw);

/// [`rows_task`] with AVX-512 (F and BW).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn chunk_avx512<T: Stored>(qs: &[&[f32]], q8: &[kv8::QueryHeads<'_>], kvs: &[&LayerKv<'_, T>], h: usize, spans: &[std::ops::Range<usize>]) -> Partials {
    rows_task::<Avx512<false>, T>(qs, q8, kvs, h, spans)
}

/// [`rows_task`] with AVX-512 and VNNI (8-bit keys' pairs in one instruction).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn chunk_avx512_vnni<T: Stored>(qs: &[&[f32]], q8: &[kv8::QueryHeads<'_>], kvs: &[&LayerKv<'_, T>], h: usize, spans: &[std::ops::Range<usize>]) -> Partials {
    rows_task::<Avx512<true>, T>(qs, q8, kvs, h, spans)
}

/// Rows that score one block of float32 keys from which it is transposed first
/// ([`Lanes::keys_t`]): the transpose (about 450 instructions a block of 16 positions and
/// a KV head) is paid once, and spares each row's query heads their reduction across
/// lanes (45 shuffles and adds a head). AMD Zen 4, one thread, rows over one layer's 2,048
/// positions in the core's cache, against scoring each row as stored, in turns: 2 rows
/// 3 % slower, 3 the same, 4 about 7 % and 8 about 15 % faster. The AVX2 task does not
/// transpose: there a reduction costs about 20 instructions a head, and a transposed
/// version (tried on the same CPU) was no faster.
#[cfg(target_arch = "x86_64")]
const SHARED_T: usize = 3;

/// One (KV head, chunk) task for a group of rows, block by block of `L::LANES` positions:
/// every row with positions in a block scores it, then (after each row's exponentials)
/// every row adds the block's weighted values, so a block that several rows read (forks
/// of one prompt, the tokens of one chunk) is loaded, widened and prefetched once and
/// read from the first-level cache after that. Each row's arithmetic is exactly what it
/// is alone (the same blocks in the same order).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows_task<L: Lanes, T: Stored>(qs: &[&[f32]], q8: &[kv8::QueryHeads<'_>], kvs: &[&LayerKv<'_, T>], h: usize, spans: &[std::ops::Range<usize>]) -> Partials {
    let d = kvs[0].head_dim;
    if !d.is_multiple_of(L::DIMS) {
        return chunk_portable(qs, q8, kvs, h, spans);
    }
    let lanes = L::LANES;
    let n_rep = qs[0].len() / d;
    // row r's scores: n_rep rows of its span's length, from offsets[r]
    let offsets: Vec<usize> = spans
        .iter()
        .scan(0, |at, s| {
            let o = *at;
            *at += n_rep * s.len();
            Some(o)
        })
        .collect();
    let total = offsets.last().map_or(0, |o| o + n_rep * spans[spans.len() - 1].len());
    let longest = spans.iter().map(|s| s.len()).max().unwrap_or(0);
    // row r's keys and values at positions i0.. of its span (one block: blocks are whole
    // groups of lanes)
    let group = |r: usize, i0: usize| {
        let s = &spans[r];
        kvs[r].run(h, s.start + i0..s.start + (i0 + lanes).min(s.len()))
    };
    // the thread's buffers taken out and put back, not borrowed in a closure: a closure
    // would be compiled without the caller's instruction set
    let (mut scores_buffer, mut block_buffer, mut kt) = DECODE.take();
    let parts = {
        let (scores, block) = (&mut scores_buffer, &mut block_buffer);
        scores.clear();
        scores.resize(total, 0.0);
        // 8-bit keys scored in integers from a transposed block (its scales after it),
        // against each row's queries rounded once
        let transposed = T::as_q8(&[]).is_some();
        block.resize(lanes * (d + d / QK), 0.0);
        kt.resize(lanes * d, 0.0);
        let mut ahead = Ahead::default();
        for i0 in (0..longest).step_by(lanes) {
            // the block whose rows `k` points at: (first stored element, rows), and whether
            // its float32 keys are transposed in `kt` for the rows that share it
            let (mut held, mut k, mut by_t) = (None, std::ptr::null(), false);
            // the block row r reads at i0, as `held` names it (rows that name it alike share it)
            let block_of = |r: usize| (group(r, i0).0.as_ptr(), lanes.min(spans[r].len() - i0));
            let mut rows_left = spans.iter().filter(|s| i0 < s.len()).count();
            for (r, s) in spans.iter().enumerate().filter(|(_, s)| i0 < s.len()) {
                let (n, m) = (s.len(), lanes.min(s.len() - i0));
                let (keys, values) = group(r, i0);
                let this = (keys.as_ptr(), m);
                if held != Some(this) {
                    k = match T::as_q8(keys) {
                        Some(rows) => {
                            L::q8_keys(rows, m, d, block);
                            block.as_ptr()
                        }
                        _ => block_rows(keys, m, lanes, d, &mut block[..lanes * d]),
                    };
                    let later = i0 + L::AHEAD * lanes;
                    if later < n {
                        ahead.queue(group(r, later).0, true);
                    }
                    ahead.queue(values, false);
                    held = Some(this);
                    by_t = L::TRANSPOSES && !transposed && {
                        let sharing = spans[r + 1..]
                            .iter()
                            .enumerate()
                            .filter(|(_, s)| i0 < s.len())
                            .take(SHARED_T - 1)
                            .take_while(|&(j, _)| block_of(r + 1 + j) == this)
                            .count();
                        sharing + 1 >= SHARED_T
                    };
                    if by_t {
                        L::keys_t(k, d, &mut kt);
                    }
                }
                ahead.issue(rows_left);
                rows_left -= 1;
                let out = scores.as_mut_ptr().add(offsets[r] + i0);
                if transposed {
                    L::score_q8(&q8[r], k, d, m, out, n);
                } else if by_t {
                    L::score_t(qs[r], kt.as_ptr(), d, m, out, n);
                } else {
                    L::score(qs[r], k, d, m, out, n);
                }
            }
        }
        let mut parts = Partials::new(spans.len() * n_rep, d);
        let (max, sum, acc) = parts.parts_mut();
        for (r, (s, &o)) in spans.iter().zip(&offsets).enumerate().filter(|(_, (s, _))| !s.is_empty()) {
            let e = r * n_rep..(r + 1) * n_rep;
            // (every instruction set the task is compiled for has FMA)
            exponentiate::<true>(&mut scores[o..o + n_rep * s.len()], s.len(), &mut max[e.clone()], &mut sum[e]);
        }
        for i0 in (0..longest).step_by(lanes) {
            let (mut held, mut v) = (None, std::ptr::null());
            // the value block row r reads at i0 (rows that name it alike share it)
            let block_of = |r: usize| (group(r, i0).1.as_ptr(), lanes.min(spans[r].len() - i0));
            for (r, s) in spans.iter().enumerate().filter(|(_, s)| i0 < s.len()) {
                let m = lanes.min(s.len() - i0);
                let values = group(r, i0).1;
                let this = (values.as_ptr(), m);
                let rows = match T::as_q8(values) {
                    // 8-bit values no later row reads: widened in registers as they are added
                    Some(rows) if held != Some(this) && !(r + 1..spans.len()).any(|j| i0 < spans[j].len() && block_of(j) == this) => Values::Q8(rows),
                    _ => {
                        if held != Some(this) {
                            // positions past m have zero rows (and their scores are never read)
                            v = block_rows(values, m, lanes, d, &mut block[..lanes * d]);
                            held = Some(this);
                        }
                        Values::F32(v)
                    }
                };
                L::accumulate(&mut acc[r * n_rep * d..(r + 1) * n_rep * d], &scores[offsets[r]..], s.len(), i0, m, rows, d);
            }
        }
        parts
    };
    DECODE.set((scores_buffer, block_buffer, kt));
    parts
}

/// `m` rows of a block of `lanes` positions as float32: in place when the block is whole
/// and already float32, otherwise copied or widened into `block` (zero rows past `m`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn block_rows<T: Stored>(src: &[T], m: usize, lanes: usize, d: usize, block: &mut [f32]) -> *const f32 {
    match T::as_f32(src) {
        Some(s) if m == lanes => s.as_ptr(),
        as_f32 => {
            match as_f32 {
                Some(s) => block[..m * d].copy_from_slice(s),
                None => T::widen_into(src, &mut block[..m * d]),
            }
            block[m * d..].fill(0.0);
            block.as_ptr()
        }
    }
}

/// The cache lines a block of the decode task asks for ahead: a later block's keys (to
/// the first-level cache) and this block's values (to the second level), while this
/// block's keys are scored. They are issued a share at a time, one share before each row
/// that scores the block, so that with many rows on one block the requests go out while
/// the rows compute instead of as one burst the line-fill buffers cannot take (one row:
/// every line at once).
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
struct Ahead {
    /// (first byte, bytes, to the first level) of each range still to ask for
    ranges: Vec<(*const u8, usize, bool)>,
    /// lines of `ranges` not yet asked for
    lines: usize,
}

#[cfg(target_arch = "x86_64")]
impl Ahead {
    /// Queues `range` (to the first-level cache with `t0`, else to the second).
    fn queue<T>(&mut self, range: &[T], t0: bool) {
        let bytes = std::mem::size_of_val(range);
        if bytes > 0 {
            self.ranges.push((range.as_ptr() as *const u8, bytes, t0));
            self.lines += bytes.div_ceil(64);
        }
    }

    /// Asks for a `1 / rows_left` share of the queued lines (all of them when one row is
    /// left).
    #[inline(always)]
    fn issue(&mut self, rows_left: usize) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let mut budget = self.lines.div_ceil(rows_left.max(1));
        self.lines -= budget.min(self.lines);
        while budget > 0 {
            let Some(&mut (ref mut ptr, ref mut bytes, t0)) = self.ranges.last_mut() else { break };
            let n = bytes.div_ceil(64).min(budget);
            // SAFETY: prefetching never faults; every address is inside a queued slice
            unsafe {
                for i in 0..n {
                    if t0 {
                        _mm_prefetch::<_MM_HINT_T0>((*ptr as *const i8).add(64 * i));
                    } else {
                        _mm_prefetch::<_MM_HINT_T1>((*ptr as *const i8).add(64 * i));
                    }
                }
            }
            budget -= n;
            if n * 64 >= *bytes {
                self.ranges.pop();
            } else {
                // SAFETY: still inside the slice (n * 64 < bytes)
                *ptr = unsafe { ptr.add(64 * n) };
                *bytes -= 64 * n;
            }
        }
    }
}

/// Adds Σ over the block's `m` positions of weight × value row to the accumulators of
/// `G` query heads (`sums[g * d..][..d]`, whose weights are scores rows `r0..r0 + G`), 64
/// dimensions at a time, held in registers over the block. `Q8`: the rows are 8-bit
/// ([`Values`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn accumulate<const G: usize, const Q8: bool>(sums: &mut [f32], scores: &[f32], n: usize, r0: usize, i0: usize, m: usize, v: Values<'_>, d: usize) {
    use std::arch::x86_64::*;
    let groups = d / QK;
    let (v, rows) = match v {
        Values::F32(v) => (v, &[][..]),
        Values::Q8(rows) => (std::ptr::null(), rows),
    };
    debug_assert!(Q8 == v.is_null() && rows.len() >= if Q8 { m * groups } else { 0 });
    for c0 in (0..d).step_by(64) {
        let mut acc = [[_mm512_setzero_ps(); 4]; G];
        for g in 0..G {
            for b in 0..4 {
                acc[g][b] = _mm512_loadu_ps(sums[g * d..][..d].as_ptr().add(c0 + 16 * b));
            }
        }
        for i in 0..m {
            let vb = if !Q8 {
                let row = v.add(i * d + c0);
                [_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(16)), _mm512_loadu_ps(row.add(32)), _mm512_loadu_ps(row.add(48))]
            } else {
                // the two groups of 32 at c0, each widened as kv8::widen_into widens it
                let mut vb = [_mm512_setzero_ps(); 4];
                for h in 0..2 {
                    let b = rows.get_unchecked(i * groups + c0 / QK + h);
                    let (q, s) = (b.values().as_ptr() as *const __m128i, _mm512_set1_ps(b.scale()));
                    for half in 0..2 {
                        vb[2 * h + half] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(half)))), s);
                    }
                }
                vb
            };
            for g in 0..G {
                let w = _mm512_set1_ps(*scores.get_unchecked((r0 + g) * n + i0 + i));
                for b in 0..4 {
                    acc[g][b] = _mm512_fmadd_ps(w, vb[b], acc[g][b]);
                }
            }
        }
        for g in 0..G {
            for b in 0..4 {
                _mm512_storeu_ps(sums[g * d..][..d].as_mut_ptr().add(c0 + 16 * b), acc[g][b]);
            }
        }
    }
}

/// The first three steps of a transposing reduction of 16 registers, on 8 of them: pairs
/// are interleaved and added, halving the registers at each step, which leaves each
/// register's sum in two pieces (its 128-bit lanes 0 + 1 and 2 + 3); [`pair_lanes`] of
/// the two halves' results is one register whose lane j is the sum of register j.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn reduce8_half(x: &[std::arch::x86_64::__m512; 8]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // 8 -> 4: within each 128-bit lane, [a, b, a, b] partial sums of x[2i], x[2i + 1]
    let t: [__m512; 4] = std::array::from_fn(|i| {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
    });
    // 4 -> 2: within each 128-bit lane, [a, b, c, d] partial sums of x[4i..4i + 4]
    let u: [__m512; 2] = std::array::from_fn(|i| {
        let (a, b) = (_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]));
        _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)))
    });
    pair_lanes(u[0], u[1])
}

/// Adds 128-bit lanes 0 + 1 and 2 + 3 of two registers side by side: [a01, a23, b01, b23].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn pair_lanes(a: std::arch::x86_64::__m512, b: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(a, b), _mm512_shuffle_f32x4::<0xDD>(a, b))
}

/// Positions per block of the AVX2 task: one register's worth of scores.
#[cfg(target_arch = "x86_64")]
const LANES8: usize = 8;

/// The AVX2 task, [`Avx512`] with AVX2's sixteen registers, for head sizes that are a
/// multiple of 32: blocks of 8 positions, the 8 keys' products with a query head in 8
/// registers turned into one register of 8 scores by three horizontal adds and a lane
/// swap; values accumulated for up to 3 query heads × 16 dimensions in registers over a
/// block.
#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx2 {
    const LANES: usize = LANES8;
    const AHEAD: usize = 2;
    const DIMS: usize = 32;
    #[inline(always)]
    unsafe fn score(q: &[f32], k: *const f32, d: usize, m: usize, out: *mut f32, stride: usize) {
        score8(q, k, d, m, out, stride)
    }
    #[inline(always)]
    unsafe fn q8_keys(rows: &[Q8Block], m: usize, d: usize, block: &mut [f32]) {
        q8_keys8(rows, m, d, block)
    }
    #[inline(always)]
    unsafe fn score_q8(q: &kv8::QueryHeads<'_>, block: *const f32, d: usize, m: usize, out: *mut f32, stride: usize) {
        let heads = q.scales.len() / (d / QK);
        for r0 in (0..heads).step_by(3) {
            let out = out.add(r0 * stride);
            match heads - r0 {
                1 => score_q8_8::<1>(q, r0, block, d, m, out, stride),
                2 => score_q8_8::<2>(q, r0, block, d, m, out, stride),
                _ => score_q8_8::<3>(q, r0, block, d, m, out, stride),
            }
        }
    }
    #[inline(always)]
    unsafe fn accumulate(acc: &mut [f32], scores: &[f32], n: usize, i0: usize, m: usize, v: Values<'_>, d: usize) {
        let heads = acc.len() / d;
        for r0 in (0..heads).step_by(3) {
            let a = &mut acc[r0 * d..];
            // each kind of rows its own instance, as the AVX-512 task's
            macro_rules! heads {
                ($g:literal) => {
                    match v {
                        Values::F32(_) => accumulate8::<$g, false>(a, scores, n, r0, i0, m, v, d),
                        Values::Q8(_) => accumulate8::<$g, true>(a, scores, n, r0, i0, m, v, d),
                    }
                };
            }
            match heads - r0 {
                1 => heads!(1),
                2 => heads!(2),
                _ => heads!(3),
            }
        }
    }
}

/// [`Avx2`]'s scores of one block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)] // register arrays indexed by block row
unsafe fn score8(q: &[f32], k: *const f32, d: usize, m: usize, out: *mut f32, stride: usize) {
    use std::arch::x86_64::*;
    let scale = _mm256_set1_ps(1.0 / (d as f32).sqrt());
    for r in 0..q.len() / d {
        let qr = q.as_ptr().add(r * d);
        let mut acc = [_mm256_setzero_ps(); LANES8];
        for c in (0..d).step_by(8) {
            let qc = _mm256_loadu_ps(qr.add(c));
            for j in 0..LANES8 {
                acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(k.add(j * d + c)), qc, acc[j]);
            }
        }
        let s = _mm256_mul_ps(reduce8(&acc), scale);
        let o = out.add(r * stride);
        if m == LANES8 {
            _mm256_storeu_ps(o, s);
        } else {
            let mut lanes = [0f32; LANES8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), s);
            std::ptr::copy_nonoverlapping(lanes.as_ptr(), o, m);
        }
    }
}

/// [`Avx2`]'s transposed 8-bit keys ([`Lanes::q8_keys`]): [`q8_keys16`] with 8 rows,
/// one 8 × 8 dword transpose ([`dwords_8x8`]) per group of 32 dimensions.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn q8_keys8(rows: &[Q8Block], m: usize, d: usize, block: &mut [f32]) {
    use std::arch::x86_64::*;
    let groups = d / QK;
    debug_assert!(rows.len() == m * groups && m <= LANES8 && block.len() >= LANES8 * (d / 2 + groups));
    let out = block.as_mut_ptr();
    let pairs = out as *mut __m256i;
    for g in 0..groups {
        let r: [__m256i; 8] =
            std::array::from_fn(|j| if j < m { _mm256_loadu_si256(rows[j * groups + g].values().as_ptr() as *const __m256i) } else { _mm256_setzero_si256() });
        for (k, &x) in dwords_8x8(&r).iter().enumerate() {
            let at = pairs.add(g * QK / 2 + 2 * k);
            _mm256_storeu_si256(at, _mm256_srai_epi16::<8>(_mm256_slli_epi16::<8>(x)));
            _mm256_storeu_si256(at.add(1), _mm256_srai_epi16::<8>(x));
        }
        _mm256_storeu_ps(out.add(d / 2 * LANES8 + g * LANES8), kv8::scales8(&rows[g..], groups, m));
    }
}

/// [`score_q8_16_bw`] with AVX2's registers: up to 3 query heads at a time (6 integer
/// accumulators of pair products: `vpmaddwd` and an add).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)] // register arrays indexed by head
unsafe fn score_q8_8<const G: usize>(q: &kv8::QueryHeads<'_>, r0: usize, block: *const f32, d: usize, m: usize, out: *mut f32, stride: usize) {
    use std::arch::x86_64::*;
    let (groups, keys) = (d / QK, block as *const __m256i);
    let mut total = [_mm256_setzero_ps(); G];
    for g in 0..groups {
        let mut acc = [[_mm256_setzero_si256(); 2]; G];
        for j in (0..QK / 2).step_by(2) {
            for b in 0..2 {
                let k = _mm256_loadu_si256(keys.add(g * QK / 2 + j + b));
                for h in 0..G {
                    let pair = _mm256_set1_epi32(*q.pairs.get_unchecked((r0 + h) * d / 2 + g * QK / 2 + j + b));
                    acc[h][b] = _mm256_add_epi32(acc[h][b], _mm256_madd_epi16(k, pair));
                }
            }
        }
        let s = _mm256_loadu_ps(block.add(d / 2 * LANES8 + g * LANES8));
        for h in 0..G {
            let sum = _mm256_cvtepi32_ps(_mm256_add_epi32(acc[h][0], acc[h][1]));
            let w = _mm256_mul_ps(s, _mm256_set1_ps(*q.scales.get_unchecked((r0 + h) * groups + g)));
            total[h] = if g == 0 { _mm256_mul_ps(sum, w) } else { _mm256_fmadd_ps(sum, w, total[h]) };
        }
    }
    let scale = _mm256_set1_ps(1.0 / (d as f32).sqrt());
    for h in 0..G {
        let s = _mm256_mul_ps(total[h], scale);
        let o = out.add(h * stride);
        if m == LANES8 {
            _mm256_storeu_ps(o, s);
        } else {
            let mut lanes = [0f32; LANES8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), s);
            std::ptr::copy_nonoverlapping(lanes.as_ptr(), o, m);
        }
    }
}

/// [`rows_task`] with AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chunk_avx2<T: Stored>(qs: &[&[f32]], q8: &[kv8::QueryHeads<'_>], kvs: &[&LayerKv<'_, T>], h: usize, spans: &[std::ops::Range<usize>]) -> Partials {
    rows_task::<Avx2, T>(qs, q8, kvs, h, spans)
}

/// [`accumulate`] with AVX2 registers: `G` query heads × 16 dimensions at a time, held in
/// registers over the block (`2 G` accumulators, two value registers and a weight). With
/// 32 dimensions at a time (for 3 heads 12 accumulators, four value registers and a
/// weight: one more than AVX2's sixteen registers) the accumulators spilled to the stack
/// inside the loop: `examples/attention_probe.rs` on an AMD EPYC Zen 3 (AVX2 only,
/// 2026-12-03, in turns), eight rows over one layer's float32 blocks hot, 2 threads
/// 680-764 -> 555-595 us, one thread 1472-1594 -> 1071-1199 us.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn accumulate8<const G: usize, const Q8: bool>(sums: &mut [f32], scores: &[f32], n: usize, r0: usize, i0: usize, m: usize, v: Values<'_>, d: usize) {
    use std::arch::x86_64::*;
    const W: usize = 2;
    let groups = d / QK;
    let (v, rows) = match v {
        Values::F32(v) => (v, &[][..]),
        Values::Q8(rows) => (std::ptr::null(), rows),
    };
    debug_assert!(Q8 == v.is_null() && rows.len() >= if Q8 { m * groups } else { 0 });
    for c0 in (0..d).step_by(8 * W) {
        let mut acc = [[_mm256_setzero_ps(); W]; G];
        for g in 0..G {
            for b in 0..W {
                acc[g][b] = _mm256_loadu_ps(sums[g * d..][..d].as_ptr().add(c0 + 8 * b));
            }
        }
        for i in 0..m {
            let vb: [__m256; W] = if !Q8 {
                let row = v.add(i * d + c0);
                std::array::from_fn(|b| _mm256_loadu_ps(row.add(8 * b)))
            } else {
                // the 16 of c0's group of 32, widened as kv8::widen_into widens them
                let b = rows.get_unchecked(i * groups + c0 / QK);
                let (q, s) = (b.values().as_ptr().add(c0 % QK), _mm256_set1_ps(b.scale()));
                std::array::from_fn(|b| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(q.add(8 * b) as *const __m128i))), s))
            };
            for g in 0..G {
                let w = _mm256_set1_ps(*scores.get_unchecked((r0 + g) * n + i0 + i));
                for b in 0..W {
                    acc[g][b] = _mm256_fmadd_ps(w, vb[b], acc[g][b]);
                }
            }
        }
        for g in 0..G {
            for b in 0..W {
                _mm256_storeu_ps(sums[g * d..][..d].as_mut_ptr().add(c0 + 8 * b), acc[g][b]);
            }
        }
    }
}

/// The sums of each of 8 registers' lanes, as one register (lane j: the sum of `x[j]`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn reduce8(x: &[std::arch::x86_64::__m256; 8]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // per 128-bit half: [x0 01, x0 23, x1 01, x1 23], then the four sums of x0..x3
    let t0 = _mm256_hadd_ps(x[0], x[1]);
    let t1 = _mm256_hadd_ps(x[2], x[3]);
    let t2 = _mm256_hadd_ps(x[4], x[5]);
    let t3 = _mm256_hadd_ps(x[6], x[7]);
    let u0 = _mm256_hadd_ps(t0, t1); // [x0..x3 low-half sums | x0..x3 high-half sums]
    let u1 = _mm256_hadd_ps(t2, t3); // the same for x4..x7
    let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
    let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
    _mm256_add_ps(lo, hi)
}

/// The portable task: row by row (inlined into each instruction-set version, which takes
/// it for head sizes its blocks do not fit).
#[inline(always)]
fn chunk_portable<T: Stored>(qs: &[&[f32]], q8: &[kv8::QueryHeads<'_>], kvs: &[&LayerKv<'_, T>], h: usize, spans: &[std::ops::Range<usize>]) -> Partials {
    let (d, n_rep) = (kvs[0].head_dim, qs[0].len() / kvs[0].head_dim);
    let mut parts = Partials::new(spans.len() * n_rep, d);
    for (r, ((q, kv), s)) in qs.iter().zip(kvs).zip(spans).enumerate() {
        if !s.is_empty() {
            let e = r * n_rep..(r + 1) * n_rep;
            let (max, sum, acc) = parts.parts_mut();
            let out = (&mut max[e.clone()], &mut sum[e], &mut acc[r * n_rep * d..(r + 1) * n_rep * d]);
            portable_row(q, q8.get(r), kv, h, s.clone(), out);
        }
    }
    parts
}

/// One row's part of [`Partials`]: its query heads' maxima, sums and accumulators.
type RowParts<'p> = (&'p mut [f32], &'p mut [f32], &'p mut [f32]);

/// One row of the portable task. A float16 or 8-bit chunk is widened into a buffer of the
/// thread first.
#[inline(always)]
fn portable_row<T: Stored>(q: &[f32], q8: Option<&kv8::QueryHeads<'_>>, kv: &LayerKv<'_, T>, h: usize, positions: std::ops::Range<usize>, out: RowParts<'_>) {
    let d = kv.head_dim;
    let n = positions.len();
    let runs: Vec<(&[T], &[T])> = kv.runs(h, positions).collect();
    let (n_rep, scale) = (q.len() / d, 1.0 / (d as f32).sqrt());
    match runs.iter().map(|&(k, v)| T::as_f32(k).zip(T::as_f32(v))).collect::<Option<Vec<_>>>() {
        Some(runs) => {
            let scores = f32_scores(q, runs.iter().flat_map(|&(k, _)| k.chunks_exact(d)), n, d);
            weigh(scores, runs.iter().flat_map(|&(_, v)| v.chunks_exact(d)), n, d, out)
        }
        None => WIDE.with(|w| {
            let (wk, wv) = &mut *w.borrow_mut();
            wk.resize(n * d, 0.0);
            wv.resize(n * d, 0.0);
            let mut at = 0;
            for &(k, v) in &runs {
                let m = k.len() * T::PER;
                if q8.is_none() {
                    T::widen_into(k, &mut wk[at..at + m]);
                }
                T::widen_into(v, &mut wv[at..at + m]);
                at += m;
            }
            let scores = if let Some(queries) = q8 {
                // 8-bit keys scored in integers from their blocks, as the SIMD paths do
                let mut scores = vec![0.0f32; n_rep * n];
                let keys = runs.iter().flat_map(|&(k, _)| T::as_q8(k).expect("8-bit keys").chunks_exact(d / QK));
                for (i, key) in keys.enumerate() {
                    for r in 0..n_rep {
                        scores[r * n + i] = queries.score(r, key) * scale;
                    }
                }
                scores
            } else {
                f32_scores(q, wk.chunks_exact(d), n, d)
            };
            weigh(scores, wv.chunks_exact(d), n, d, out)
        }),
    }
}

/// The portable task's scaled scores of each query head of `q` against `n` float32 keys of
/// `d` values: (heads, n).
#[inline(always)]
fn f32_scores<'k>(q: &[f32], keys: impl Iterator<Item = &'k [f32]>, n: usize, d: usize) -> Vec<f32> {
    let n_rep = q.len() / d;
    let scale = 1.0 / (d as f32).sqrt();
    let mut scores = vec![0.0f32; n_rep * n];
    for (i, k) in keys.enumerate() {
        for r in 0..n_rep {
            scores[r * n + i] = dot(&q[r * d..][..d], k) * scale;
        }
    }
    scores
}

/// The portable task's end over `n` positions: each query head's scores (heads, n)
/// exponentiated, and its values (float32 rows of `d`) added up with those weights.
#[inline(always)]
fn weigh<'v>(mut scores: Vec<f32>, values: impl Iterator<Item = &'v [f32]>, n: usize, d: usize, (max, sum, acc): RowParts<'_>) {
    exponentiate::<false>(&mut scores, n, max, sum);
    for (i, v) in values.enumerate() {
        for (r, acc) in acc.chunks_exact_mut(d).enumerate() {
            axpy(acc, scores[r * n + i], v);
        }
    }
}

/// Query positions per prefill task: with 3 query heads per KV head, 48 rows per product,
/// and a 2,048-position score block of 384 KB that stays in a core's cache.
const BLOCK: usize = 16;

thread_local! {
    /// Each thread's buffer for one prefill task: (queries, scores, outputs).
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Causal attention of the last `seq` positions held in `kv` (whose keys and values are
/// already written) over every position up to their own. `q`: (heads, seq, head_dim)
/// after RoPE. Returns (seq, heads * head_dim), ready for the output projection.
pub fn prefill_attention(q: &[f32], seq: usize, kv: &LayerKv<'_>) -> Vec<f32> {
    let d = kv.head_dim;
    let heads = q.len() / (seq * d);
    let blocks = seq.div_ceil(BLOCK);
    let mut out = vec![0f32; seq * heads * d];
    let shards = Shards::new(&mut out);
    Team::global().run(kv.kv_heads * blocks, &|t| {
        // the last blocks (the longest rows) first, so the short ones fill in at the end
        let (h, b) = (t % kv.kv_heads, blocks - 1 - t / kv.kv_heads);
        let rows = b * BLOCK..((b + 1) * BLOCK).min(seq);
        SCRATCH.with(|s| causal_block(q, seq, kv, h, rows, &mut s.borrow_mut(), &shards));
    });
    out
}

/// One task of [`prefill_attention`]: KV head `h`, query positions `rows` of the chunk.
fn causal_block(
    q: &[f32],
    seq: usize,
    kv: &LayerKv<'_>,
    h: usize,
    rows: std::ops::Range<usize>,
    scratch: &mut (Vec<f32>, Vec<f32>, Vec<f32>),
    out: &Shards<'_, f32>,
) {
    let d = kv.head_dim;
    let heads = q.len() / (seq * d);
    let n_rep = heads / kv.kv_heads;
    let offset = kv.len - seq;
    let b = rows.len();
    let m = n_rep * b; // product rows: query head r's position i is row r * b + i
    // the keys the block's last position sees; earlier rows see fewer (masked below)
    let n = offset + rows.end;
    let (a, scores, y) = scratch;
    a.clear();
    for r in 0..n_rep {
        let first = ((h * n_rep + r) * seq + rows.start) * d;
        a.extend_from_slice(&q[first..first + b * d]);
    }
    scores.resize(m * n, 0.0);
    y.resize(m * d, 0.0);
    // one product per block of positions: columns `at..at + keys.len() / d` of the scores
    let mut at = 0;
    for (keys, _) in kv.runs(h, 0..n) {
        let cols = keys.len() / d;
        // SAFETY: every pointer and stride describes memory inside the slices: a (m, d),
        // keys (cols, d) row-major, scores (m, n) from column `at`
        unsafe {
            gemm::gemm(
                m, cols, d,
                scores.as_mut_ptr().add(at), 1, n as isize, false,
                a.as_ptr(), 1, d as isize,
                keys.as_ptr(), d as isize, 1,
                0.0, 1.0 / (d as f32).sqrt(), false, false, false,
                gemm::Parallelism::None,
            );
        }
        at += cols;
    }
    let mut sums = [0f32; BLOCK * 8];
    let sums = if m <= sums.len() { &mut sums[..m] } else { &mut vec![0f32; m][..] };
    for (row, s) in scores.chunks_exact_mut(n).enumerate() {
        let visible = offset + rows.start + row % b + 1;
        sums[row] = softmax_prefix(s, visible);
    }
    // the weighted values, summed over the blocks in order
    let mut at = 0;
    for (_, values) in kv.runs(h, 0..n) {
        let rows = values.len() / d;
        // SAFETY: y (m, d), the scores' columns `at..at + rows` (row stride n), values
        // (rows, d) row-major
        unsafe {
            gemm::gemm(
                m, d, rows,
                y.as_mut_ptr(), 1, d as isize, at > 0,
                scores.as_ptr().add(at), 1, n as isize,
                values.as_ptr(), 1, d as isize,
                1.0, 1.0, false, false, false,
                gemm::Parallelism::None,
            );
        }
        at += rows;
    }
    for (row, (yr, sum)) in y.chunks_exact(d).zip(sums.iter()).enumerate() {
        let (r, i) = (row / b, rows.start + row % b);
        let first = i * heads * d + (h * n_rep + r) * d;
        // SAFETY: a task writes only its own query heads' columns of its own positions
        let dst = unsafe { out.part(first..first + d) };
        for (o, v) in dst.iter_mut().zip(yr) {
            *o = v / sum;
        }
    }
}

/// One row of scores: the first `visible` become e^(score - max), the rest (masked
/// positions) 0; returns the sum. On the best instruction set the CPU has.
fn softmax_prefix(s: &mut [f32], visible: usize) -> f32 {
    #[inline(always)]
    fn body<const FUSED: bool>(s: &mut [f32], visible: usize) -> f32 {
        let (seen, masked) = s.split_at_mut(visible);
        masked.fill(0.0);
        let max = max8(seen);
        for x in seen.iter_mut() {
            *x = exp_with::<FUSED>(*x - max);
        }
        sum8(seen)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn avx512(s: &mut [f32], visible: usize) -> f32 {
        body::<true>(s, visible)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2(s: &mut [f32], visible: usize) -> f32 {
        body::<true>(s, visible)
    }
    match kernel() {
        // SAFETY: the CPU has the instruction set (checked at run time)
        #[cfg(target_arch = "x86_64")]
        crate::kernels::matvec::Kernel::Avx512 => unsafe { avx512(s, visible) },
        #[cfg(target_arch = "x86_64")]
        crate::kernels::matvec::Kernel::Avx2 => unsafe { avx2(s, visible) },
        _ => body::<false>(s, visible),
    }
}

/// Turns each query head's `n` scores into e^(score - max) in place; each head's maximum
/// and sum into `maxima` and `sums`. `FUSED`: [`exp_with`]'s, for code compiled with FMA.
#[inline(always)]
fn exponentiate<const FUSED: bool>(scores: &mut [f32], n: usize, maxima: &mut [f32], sums: &mut [f32]) {
    // plain loops: a closure (an iterator adapter's) would be compiled apart from the
    // instruction-set version this is inlined into, without its SIMD
    for ((s, max), sum) in scores.chunks_exact_mut(n).zip(maxima.iter_mut()).zip(sums.iter_mut()) {
        let m = max8(s);
        for x in s.iter_mut() {
            *x = exp_with::<FUSED>(*x - m);
        }
        (*max, *sum) = (m, sum8(s));
    }
}

/// The largest of `x` (-inf when empty), with eight independent lanes.
#[inline(always)]
fn max8(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    for c in chunks {
        for l in 0..8 {
            lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
        }
    }
    lanes.iter().fold(tail, |m, &v| if v > m { v } else { m })
}

/// Σ x with eight independent partial sums.
#[inline(always)]
fn sum8(x: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for l in 0..8 {
            lanes[l] += c[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// Σ a·b with eight independent partial sums (a SIMD register's worth).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// y += w·x
#[inline(always)]
fn axpy(y: &mut [f32], w: f32, x: &[f32]) {
    for (o, v) in y.iter_mut().zip(x) {
        *o += w * v;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::kv8::as_blocks;
    use crate::kernels::matvec::Kernel;

    /// Softmax attention in float64, the plain way.
    fn reference(q: &[f32], kv: &LayerKv<'_>) -> Vec<f64> {
        let d = kv.head_dim;
        let heads = q.len() / d;
        let n_rep = heads / kv.kv_heads;
        let mut out = vec![0.0f64; heads * d];
        for head in 0..heads {
            let h = head / n_rep;
            let qh = &q[head * d..][..d];
            let scores: Vec<f64> = (0..kv.len)
                .map(|p| {
                    let k = kv.run(h, p..p + 1).0;
                    qh.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() / (d as f64).sqrt()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = w.iter().sum();
            for (p, wp) in w.iter().enumerate() {
                let v = kv.run(h, p..p + 1).1;
                for j in 0..d {
                    out[head * d + j] += wp / total * v[j] as f64;
                }
            }
        }
        out
    }

    /// A prefill's `seq` rows `got` (queries `qs`, (heads, seq, head_dim)), the last `seq`
    /// of `kv`'s positions, each against float64 attention of that position alone over
    /// the positions up to it.
    fn assert_prefill_matches(qs: &[f32], seq: usize, got: &[f32], kv: &LayerKv<'_>, what: &str) {
        let d = kv.head_dim;
        let heads = qs.len() / (seq * d);
        for i in 0..seq {
            let qi: Vec<f32> = (0..heads).flat_map(|hh| qs[(hh * seq + i) * d..][..d].to_vec()).collect();
            let want = reference(&qi, &kv.first(kv.len - seq + i + 1));
            let err = got[i * heads * d..][..heads * d].iter().zip(&want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max);
            assert!(err < 1e-5, "{what}, position {i}: max error {err}");
        }
    }

    /// Numbers in [-1, 1) from a seed (xorshift).
    pub(crate) fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    #[test]
    fn prefill_matches_float64_causal_attention() {
        // (kv_heads, n_rep, head_dim, offset, seq, capacity): a first chunk, a chunk after
        // cached positions, a chunk that is not a multiple of the block, one position
        for (case, &(kv_heads, n_rep, d, offset, seq, capacity)) in
            [(3, 3, 64, 0, 40, 64), (2, 4, 32, 300, 37, 400), (1, 5, 12, 3, BLOCK + 1, 30), (3, 1, 16, 10, 1, 16), (2, 3, 128, 100, 2 * BLOCK, 200)]
                .iter()
                .enumerate()
        {
            let heads = kv_heads * n_rep;
            let keys = random(kv_heads * capacity * d, 10 + case as u64);
            let values = random(kv_heads * capacity * d, 110 + case as u64);
            let q: Vec<f32> = random(heads * seq * d, 210 + case as u64).iter().map(|x| 4.0 * x).collect();
            let kv = LayerKv::contiguous(&keys, &values, kv_heads, capacity, offset + seq, d);
            let got = prefill_attention(&q, seq, &kv);
            assert_eq!(got.len(), seq * heads * d);
            assert_prefill_matches(&q, seq, &got, &kv, &format!("case {case}"));
        }
    }

    #[test]
    fn half_caches_match_float64_attention_over_their_rounded_values() {
        // the kernels over float16 keys and values, against float64 attention over the same
        // (rounded) numbers: what is left is float32 rounding, as for a float32 cache
        for (case, &(kv_heads, n_rep, d, len, capacity, seq)) in
            [(3, 3, 64, 2 * CHUNK + 37, 700, 40), (2, 4, 32, 100, 128, 1), (1, 5, 12, 5, 5, 5)].iter().enumerate()
        {
            let round = |v: Vec<f32>| -> (Vec<f16>, Vec<f32>) {
                let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
                let f = h.iter().map(|x| x.to_f32()).collect();
                (h, f)
            };
            let (k16, k32) = round(random(kv_heads * capacity * d, 20 + case as u64));
            let (v16, v32) = round(random(kv_heads * capacity * d, 120 + case as u64));
            let heads = kv_heads * n_rep;
            let q: Vec<f32> = random(heads * d, 220 + case as u64).iter().map(|x| 4.0 * x).collect();
            let half = LayerKv::contiguous(&k16, &v16, kv_heads, capacity, len, d);
            let wide = LayerKv::contiguous(&k32, &v32, kv_heads, capacity, len, d);
            let want = reference(&q, &wide);
            let got = decode_attention(&q, &half);
            let err = got.iter().zip(&want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max);
            assert!(err < 1e-5, "decode case {case}: max error {err}");
            // prefill: the last `seq` positions, each over the positions up to its own
            let qs: Vec<f32> = random(heads * seq * d, 320 + case as u64).iter().map(|x| 4.0 * x).collect();
            let got = prefill_attention_widened(&qs, seq, &half);
            assert_prefill_matches(&qs, seq, &got, &wide, &format!("prefill case {case}"));
        }
    }

    #[test]
    fn matches_float64_softmax_attention_on_every_path() {
        // (kv_heads, n_rep, head_dim, len, capacity): one chunk, several chunks with a
        // partial last one, a head dim that is not a multiple of 8, a single position; head
        // dims of 64 and 128 with 1, 2, 3, 5 and 8 query heads per KV head (the AVX-512
        // kernel's groups of up to 4) and lengths below, at and past a block of 16
        for (case, &(kv_heads, n_rep, d, len, capacity)) in [
            (3, 3, 64, 100, 128),
            (2, 4, 32, 2 * CHUNK + 37, 700),
            (1, 5, 12, 5, 5),
            (4, 1, 16, 1, 64),
            (3, 3, 64, 2 * CHUNK + 37, 700),
            (2, 5, 128, CHUNK + 3, 300),
            (1, 8, 64, 16, 16),
            (2, 2, 64, 17, 20),
            (1, 1, 64, 3, 8),
        ]
                .iter()
                .enumerate()
        {
            let keys = random(kv_heads * capacity * d, 1 + case as u64);
            let values = random(kv_heads * capacity * d, 100 + case as u64);
            let q: Vec<f32> = random(kv_heads * n_rep * d, 200 + case as u64).iter().map(|x| 4.0 * x).collect();
            let kv = LayerKv::contiguous(&keys, &values, kv_heads, capacity, len, d);
            let want = reference(&q, &kv);
            check_every_path(&q, &kv, &want, &format!("case {case}, float32"));
            // the same numbers rounded to float16, against float64 over the rounded values
            let (k16, k32) = rounded(&keys);
            let (v16, v32) = rounded(&values);
            let half = LayerKv::contiguous(&k16, &v16, kv_heads, capacity, len, d);
            let want = reference(&q, &LayerKv::contiguous(&k32, &v32, kv_heads, capacity, len, d));
            check_every_path(&q, &half, &want, &format!("case {case}, float16"));
            // and rounded to the 8-bit cache's blocks (head sizes that are whole blocks)
            if d % crate::kernels::kv8::QK == 0 {
                let (k8, k8f) = eight_bit(&keys);
                let (v8, v8f) = eight_bit(&values);
                let kv8 = LayerKv::contiguous(as_blocks(&k8), as_blocks(&v8), kv_heads, capacity, len, d);
                // decode scores the 8-bit keys against the queries rounded to int16
                // (kv8::Queries): float64 over those numbers leaves float32 rounding
                let rounded_q = kv8::Queries::new(&q, d).rounded();
                let want = reference(&rounded_q, &LayerKv::contiguous(&k8f, &v8f, kv_heads, capacity, len, d));
                check_every_path(&q, &kv8, &want, &format!("case {case}, 8-bit"));
                // and the rounding of the queries moves the result by little: within 1e-4
                // of float64 over the queries as given (worst seen 2e-5)
                let exact = reference(&q, &LayerKv::contiguous(&k8f, &v8f, kv_heads, capacity, len, d));
                let moved = want.iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                assert!(moved < 1e-4, "case {case}: rounding the queries moved the result by {moved}");
                // prefill over the same blocks: the last positions, each over those up to it
                let seq = len.min(5);
                let qs: Vec<f32> = random(kv_heads * n_rep * seq * d, 400 + case as u64).iter().map(|x| 4.0 * x).collect();
                let got = prefill_attention_widened(&qs, seq, &kv8);
                let wide = LayerKv::contiguous(&k8f, &v8f, kv_heads, capacity, len, d);
                assert_prefill_matches(&qs, seq, &got, &wide, &format!("8-bit prefill case {case}"));
            }
        }
    }

    /// Head-major numbers rounded to the 8-bit cache's blocks: (bytes, the stored values).
    fn eight_bit(v: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let mut bytes = vec![0u8; crate::kernels::kv8::row_bytes(v.len())];
        crate::kernels::kv8::quantize_into(v, &mut bytes);
        let mut wide = vec![0f32; v.len()];
        crate::kernels::kv8::widen_into(as_blocks(&bytes), &mut wide);
        (bytes, wide)
    }

    /// Head-major (kv_heads, capacity, d) numbers cut into blocks of `block_len` positions,
    /// each (kv_heads, block_len, d), the positions past `capacity` zero.
    fn blocks_of<T: Copy + Default>(x: &[T], kv_heads: usize, capacity: usize, d: usize, block_len: usize) -> Vec<Vec<T>> {
        (0..capacity.div_ceil(block_len))
            .map(|b| {
                let mut block = vec![T::default(); kv_heads * block_len * d];
                for h in 0..kv_heads {
                    for i in 0..block_len.min(capacity - b * block_len) {
                        let p = b * block_len + i;
                        block[(h * block_len + i) * d..][..d].copy_from_slice(&x[(h * capacity + p) * d..][..d]);
                    }
                }
                block
            })
            .collect()
    }

    #[test]
    fn blocks_read_as_one_buffer() {
        // decode over blocks of 16 and 64 positions gives, bit for bit, what it gives over
        // one buffer, on every path; prefill over blocks matches float64
        for (case, &(kv_heads, n_rep, d, len, seq)) in [(3, 3, 64, 2 * CHUNK + 37, 40), (2, 4, 32, 100, 1), (1, 2, 64, 64, 17), (3, 3, 64, CHUNK, 2 * BLOCK)].iter().enumerate() {
            let keys = random(kv_heads * len * d, 50 + case as u64);
            let values = random(kv_heads * len * d, 150 + case as u64);
            let q: Vec<f32> = random(kv_heads * n_rep * d, 250 + case as u64).iter().map(|x| 4.0 * x).collect();
            let whole = LayerKv::contiguous(&keys, &values, kv_heads, len, len, d);
            let (k16, _) = rounded(&keys);
            let (v16, _) = rounded(&values);
            let whole16 = LayerKv::contiguous(&k16, &v16, kv_heads, len, len, d);
            for block_len in [16, 64] {
                let (kb, vb) = (blocks_of(&keys, kv_heads, len, d, block_len), blocks_of(&values, kv_heads, len, d, block_len));
                let kv = LayerKv { blocks: kb.iter().zip(&vb).map(|(k, v)| (&k[..], &v[..])).collect(), block_len, kv_heads, len, head_dim: d };
                let (kb16, vb16) = (blocks_of(&k16, kv_heads, len, d, block_len), blocks_of(&v16, kv_heads, len, d, block_len));
                let kv16 = LayerKv { blocks: kb16.iter().zip(&vb16).map(|(k, v)| (&k[..], &v[..])).collect(), block_len, kv_heads, len, head_dim: d };
                for (k, f) in paths() {
                    assert_eq!(attend_with(&q, &kv, f), attend_with(&q, &whole, f), "case {case}, blocks of {block_len}, {k}");
                }
                assert_eq!(decode_attention(&q, &kv16), decode_attention(&q, &whole16), "case {case}, float16 blocks of {block_len}");
                // 8-bit blocks: each block's rows of blocks of 32 values, read through the table
                let row = crate::kernels::kv8::row_bytes(d);
                let (k8, v8) = (eight_bit(&keys).0, eight_bit(&values).0);
                let (kb8, vb8) = (blocks_of(&k8, kv_heads, len, row, block_len), blocks_of(&v8, kv_heads, len, row, block_len));
                let kv8 = LayerKv { blocks: kb8.iter().zip(&vb8).map(|(k, v)| (as_blocks(k), as_blocks(v))).collect(), block_len, kv_heads, len, head_dim: d };
                let whole8 = LayerKv::contiguous(as_blocks(&k8), as_blocks(&v8), kv_heads, len, len, d);
                for (k, f) in paths() {
                    assert_eq!(attend_with(&q, &kv8, f), attend_with(&q, &whole8, f), "case {case}, 8-bit blocks of {block_len}, {k}");
                }
                assert_eq!(prefill_attention_widened(&q, 1, &kv8), prefill_attention_widened(&q, 1, &whole8), "case {case}: 8-bit prefill");
                let qs: Vec<f32> = random(kv_heads * n_rep * seq * d, 350 + case as u64).iter().map(|x| 4.0 * x).collect();
                let got = prefill_attention(&qs, seq, &kv);
                let got16 = prefill_attention_widened(&qs, seq, &kv16);
                assert_eq!(got16, prefill_attention_widened(&qs, seq, &whole16), "case {case}: float16 prefill widens the same numbers");
                assert_prefill_matches(&qs, seq, &got, &whole, &format!("prefill case {case}, blocks of {block_len}"));
            }
        }
    }

    #[test]
    fn rows_together_equal_each_row_alone() {
        // rows over one set of blocks with different lengths (a chunk's tokens, forks of
        // one prompt) and over other blocks, many rows and few: each row bit for bit what
        // it gives alone, on every path, for each storage type (a shared block is widened
        // once for the rows that read it)
        let (kv_heads, n_rep, d, block_len) = (3, 3, 64, 64);
        let len = 2 * CHUNK + 37;
        let keys = random(kv_heads * len * d, 7);
        let values = random(kv_heads * len * d, 8);
        let other_keys = random(kv_heads * 40 * d, 9);
        let other_values = random(kv_heads * 40 * d, 10);
        let lens = [1, len - 7, len, CHUNK, CHUNK + 1, 300, len - 1, 65, 2];
        let qs: Vec<Vec<f32>> = (0..lens.len() + 1).map(|r| random(kv_heads * n_rep * d, 20 + r as u64)).collect();
        // rows of one storage type: `shared` and `other` as that type's (blocks, row length)
        fn layer<'a, T: Stored>(k: &'a [Vec<T>], v: &'a [Vec<T>], n: usize) -> LayerKv<'a, T> {
            let (kv_heads, d, block_len) = (3, 64, 64);
            LayerKv { blocks: k.iter().zip(v).map(|(k, v)| (&k[..], &v[..])).take(n.div_ceil(block_len)).collect(), block_len, kv_heads, len: n, head_dim: d }
        }
        fn check<T: Stored>(shared: &[Vec<T>], shared_v: &[Vec<T>], other: &[Vec<T>], other_v: &[Vec<T>], lens: &[usize], qs: &[Vec<f32>], what: &str) {
            let mut kvs: Vec<LayerKv<'_, T>> = lens.iter().map(|&n| layer(shared, shared_v, n)).collect();
            kvs.insert(3, layer(other, other_v, 40));
            for (k, f) in paths::<T>() {
                for rows in [1, 2, 4, kvs.len()] {
                    let q_refs: Vec<&[f32]> = qs[..rows].iter().map(|q| &q[..]).collect();
                    let kv_refs: Vec<&LayerKv<'_, T>> = kvs[..rows].iter().collect();
                    let together = attend_rows_with(&q_refs, &kv_refs, f);
                    for r in 0..rows {
                        assert_eq!(together[r], attend_with(&qs[r], &kvs[r], f), "{what}, {k}, {rows} rows, row {r}");
                    }
                }
            }
        }
        let blocks = |x: &[f32], n: usize| blocks_of(x, kv_heads, n, d, block_len);
        check(&blocks(&keys, len), &blocks(&values, len), &blocks(&other_keys, 40), &blocks(&other_values, 40), &lens, &qs, "float32");
        let half = |x: &[f32], n: usize| blocks_of(&rounded(x).0, kv_heads, n, d, block_len);
        check(&half(&keys, len), &half(&values, len), &half(&other_keys, 40), &half(&other_values, 40), &lens, &qs, "float16");
        let row = crate::kernels::kv8::row_bytes(d);
        let eight = |x: &[f32], n: usize| -> Vec<Vec<crate::kernels::kv8::Q8Block>> {
            blocks_of(&eight_bit(x).0, kv_heads, n, row, block_len).iter().map(|b| as_blocks(b).to_vec()).collect()
        };
        check(&eight(&keys, len), &eight(&values, len), &eight(&other_keys, 40), &eight(&other_values, 40), &lens, &qs, "8-bit");
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn transposed_keys_score_the_same_bits() {
        // the scores of a block scored from its transposed keys (as rows that share a
        // block are, with AVX-512) against those of the block as stored (as a row alone),
        // bit for bit: 1-9 query heads, whole and partial blocks, two head sizes
        if !std::is_x86_feature_detected!("avx512f") {
            // (the AVX2 task does not transpose: measured, its reductions cost about what
            // a transposed block's broadcasts do)
            eprintln!("transposed_keys_score_the_same_bits: SKIPPED, no AVX-512F on this CPU");
            return;
        }
        type L = Avx512<false>;
        for d in [64, 128] {
            for m in [1, 9, 15, 16] {
                let mut keys = random(LANES * d, d as u64 + m as u64);
                keys[m * d..].fill(0.0);
                let mut kt = vec![f32::NAN; LANES * d];
                // SAFETY: the CPU has AVX-512F (checked above); `keys` is LANES rows of d
                unsafe { L::keys_t(keys.as_ptr(), d, &mut kt) };
                for p in 0..LANES {
                    for j in 0..d {
                        assert_eq!(kt[j * LANES + p].to_bits(), keys[p * d + j].to_bits(), "d {d}, position {p}, dimension {j}");
                    }
                }
                for heads in 1..=9 {
                    let q = random(heads * d, 100 + heads as u64);
                    let (mut stored, mut transposed) = (vec![f32::NAN; heads * LANES], vec![f32::NAN; heads * LANES]);
                    // SAFETY: as above; each output holds `heads` rows of LANES, m <= LANES
                    unsafe {
                        L::score(&q, keys.as_ptr(), d, m, stored.as_mut_ptr(), LANES);
                        L::score_t(&q, kt.as_ptr(), d, m, transposed.as_mut_ptr(), LANES);
                    }
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&transposed), bits(&stored), "d {d}, {m} positions, {heads} heads");
                }
            }
        }
    }

    fn rounded(v: &[f32]) -> (Vec<f16>, Vec<f32>) {
        let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
        let f = h.iter().map(|x| x.to_f32()).collect();
        (h, f)
    }

    /// Every chunk kernel this CPU runs, named: one per SIMD level, and at the AVX-512
    /// level both forms of the 8-bit keys' products (with and without VNNI).
    fn paths<T: Stored>() -> Vec<(String, ChunkFn<T>)> {
        let mut paths: Vec<(String, ChunkFn<T>)> = Vec::new();
        for k in Kernel::available() {
            match k {
                // SAFETY: `available` lists the levels this CPU runs; BW and VNNI checked
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx512 => {
                    if avx512_bw() {
                        paths.push(("Avx512 (BW)".into(), |q, q8, kv, h, s| unsafe { chunk_avx512(q, q8, kv, h, s) }));
                    }
                    if avx512_bw() && std::is_x86_feature_detected!("avx512vnni") {
                        paths.push(("Avx512 (VNNI)".into(), |q, q8, kv, h, s| unsafe { chunk_avx512_vnni(q, q8, kv, h, s) }));
                    }
                }
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx2 => paths.push(("Avx2".into(), |q, q8, kv, h, s| unsafe { chunk_avx2(q, q8, kv, h, s) })),
                _ => paths.push((format!("{k:?}"), chunk_portable)),
            }
        }
        paths
    }

    #[test]
    fn query_heads_together_equal_each_head_alone() {
        // a KV head's query heads are scored in groups (of up to 3 with AVX-512: 7 heads
        // are 3 + 3 + 1, 5 are 3 + 2) and their values added in groups of up to 4: each
        // head's result is bit for bit what it gives as the only query head, on every path
        let (d, len) = (64, 2 * CHUNK + 37);
        let keys = random(len * d, 31);
        let values = random(len * d, 32);
        let kv = LayerKv::contiguous(&keys, &values, 1, len, len, d);
        for n_rep in [2, 5, 7] {
            let q: Vec<f32> = random(n_rep * d, 33 + n_rep as u64).iter().map(|x| 4.0 * x).collect();
            for (k, f) in paths::<f32>() {
                let together = attend_with(&q, &kv, f);
                for h in 0..n_rep {
                    let alone = attend_with(&q[h * d..(h + 1) * d], &kv, f);
                    assert_eq!(together[h * d..(h + 1) * d], alone[..], "{k}, {n_rep} query heads, head {h}");
                }
            }
        }
    }

    /// Each chunk kernel the CPU can run, and the dispatched one, against `want`.
    fn check_every_path<T: Stored>(q: &[f32], kv: &LayerKv<'_, T>, want: &[f64], what: &str) {
        let mut paths: Vec<(String, Vec<f32>)> = paths().into_iter().map(|(name, f)| (name, attend_with(q, kv, f))).collect();
        paths.push((format!("dispatched {:?}", kernel()), decode_attention(q, kv)));
        for (path, got) in paths {
            let err = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max);
            assert!(err < 1e-5, "{what} on {path:?}: max error {err}");
        }
    }
}
