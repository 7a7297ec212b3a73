//! The Q4_1 matrix-vector products of a quantized decode step for 1 and for 8 inputs
//! (SmolLM2-135M's shapes: q/k/v stacked, o, gate/up stacked, down; 30 layers, 66 MB of
//! blocks), on one thread and on the process's team, cold (every layer's matrices in turn,
//! read from memory) and hot (one o matrix again and again: 207 KB, the second-level
//! cache). On the team, the tasks' row ranges are multiples of 4 rows (as the decode step
//! split them before) or of 16 (the AVX-512 kernels' row group, as it splits them now),
//! in turns. Printed as medians of nanoseconds per block of 16 rows x 32 values per
//! thread, so the 8-input cost can be set against the 1-input cost on any CPU.
//!
//! What it showed on an AMD EPYC Zen 4 (AVX-512 with VNNI, 2 threads, 2026-12-02, 9
//! rounds): tasks of multiples of 16 rows against 4, cold 55.6 against 66.0 ns (1 input)
//! and 79.6 against 90.2 (8 inputs); the o matrix hot, 29.0 against 53.2 and 60.6
//! against 104.3. One thread, one call: cold 35.7 (1 input) and 55.5 (8 inputs), hot
//! 23.1 and 48.5: eight inputs cost twice one even from the second-level cache, so on
//! this CPU the 8-input products are bound by the integer dot products, not by memory.
//!
//!     RAYON_NUM_THREADS=2 cargo run --release --example qproducts_probe
use kvcandle::kernels::blocks::Format;
use kvcandle::kernels::qmatvec::{QKind, QMatrix};
use kvcandle::kernels::team::{Shards, Team};
use std::time::Instant;

const SHAPES: [(usize, usize); 4] = [(960, 576), (576, 576), (3072, 576), (576, 1536)];
const LAYERS: usize = 30;

/// A Q4_1 matrix of pseudo-random blocks (scales about 0.01, minimums about -0.08).
fn matrix(rows: usize, cols: usize, seed: usize) -> QMatrix {
    let f = Format::Q4_1;
    let blocks = rows * cols / f.block_values();
    let mut data = Vec::with_capacity(blocks * f.block_bytes());
    let mut s = seed as u64 * 0x9E37_79B9_7F4A_7C15 + 1;
    for _ in 0..blocks {
        data.extend_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        data.extend_from_slice(&half::f16::from_f32(-0.08).to_le_bytes());
        for _ in 0..16 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            data.push(s as u8);
        }
    }
    QMatrix::new(QKind::Blocks(f), rows, cols, data).unwrap_or_else(|_| panic!("Q4_1 block bytes"))
}

fn main() {
    let mats: Vec<QMatrix> = (0..LAYERS).flat_map(|l| SHAPES.iter().enumerate().map(move |(i, &(r, c))| matrix(r, c, l * 4 + i))).collect();
    let bytes: usize = mats.iter().map(|m| m.nbytes()).sum();
    let blocks: usize = mats.iter().map(|m| m.rows() * m.cols() / 512).sum();
    let team = Team::global();
    println!("{} threads, {} MB of Q4_1 blocks per pass, {} blocks of 16 x 32", team.threads(), bytes / 1_000_000, blocks);
    let inputs: Vec<Vec<_>> = [576usize, 1536]
        .iter()
        .map(|&c| (0..8).map(|j| QMatrix::prepare(&(0..c).map(|i| ((i * 7 + j * 3) % 23) as f32 / 23.0 - 0.5).collect::<Vec<f32>>())).collect())
        .collect();
    let input = |m: &QMatrix| if m.cols() == 576 { &inputs[0] } else { &inputs[1] };
    // (case, threads, inputs, row group of a task) -> ns per block per thread, every round
    let mut times: std::collections::BTreeMap<(&str, usize, usize, usize), Vec<f64>> = Default::default();
    let rounds: usize = std::env::var("ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(7);
    for _ in 0..rounds {
        for (name, hot) in [("cold", false), ("hot o", true)] {
            for m in [1usize, 8] {
                for (threads, group) in [(1usize, 0usize), (team.threads(), 4), (team.threads(), 16)] {
                    let per_of = |n: usize| (n / (team.threads() * 8)).next_multiple_of(group.max(1)).clamp(16, 256);
                    let t = Instant::now();
                    let mut n_blocks = 0;
                    for i in 0..mats.len() {
                        let w = if hot { &mats[1] } else { &mats[i] };
                        n_blocks += w.rows() * w.cols() / 512;
                        let xs: Vec<&_> = input(w)[..m].iter().collect();
                        let mut outs = vec![vec![0f32; w.rows()]; m];
                        if threads == 1 {
                            let mut o: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
                            w.mul_rows_batch(&xs, 0, &mut o);
                        } else {
                            let per = per_of(w.rows());
                            let shards: Vec<Shards<'_, f32>> = outs.iter_mut().map(|o| Shards::new(o)).collect();
                            team.run(w.rows().div_ceil(per), &|t| {
                                let rows = t * per..((t + 1) * per).min(w.rows());
                                // SAFETY: tasks cover disjoint row ranges
                                let mut o: Vec<&mut [f32]> = shards.iter().map(|s| unsafe { s.part(rows.clone()) }).collect();
                                w.mul_rows_batch(&xs, rows.start, &mut o);
                            });
                        }
                        std::hint::black_box(&outs);
                    }
                    let ns = t.elapsed().as_secs_f64() * 1e9;
                    times.entry((name, threads, m, group)).or_default().push(ns * threads as f64 / n_blocks as f64);
                }
            }
        }
    }
    println!("median ns per block of 16 x 32 per thread over {rounds} rounds (tasks' rows a multiple of 4 or of 16):");
    for ((name, threads, m, group), mut v) in times {
        v.sort_by(f64::total_cmp);
        let task = if group == 0 { "one call".to_string() } else { format!("tasks of a multiple of {group} rows") };
        println!("  {name:6} {m} input(s), {threads} thread(s), {task}: {:.1}", v[v.len() / 2]);
    }
}
