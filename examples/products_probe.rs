//! Float32 matrix-vector products of a decode step for 1 and for 8 inputs (SmolLM2-135M's
//! shapes: q/k/v stacked, o, gate/up stacked, down; 30 layers, 427 MB), on the process's
//! team as a step runs them, from three places: cold (every layer's matrices in turn, as
//! a step reads them from memory), one layer's four matrices again and again (14 MB: the
//! last-level cache) and one o matrix again and again (1.3 MB: the second-level caches).
//! Printed as weight bytes read per second: the 8-input rate against the 1-input rate
//! says how far a batch of 8 (or a chunk of 8 tokens) is from reading the weights at one
//! input's pace.
//!
//! What it showed on the Xeon (AVX-512, 2 threads, 2026-12-02): cold, 25-27 GB/s for one
//! input and 19-21 GB/s for eight; with the weights in either cache 36-40 GB/s for eight
//! (one input: 50-110), so eight inputs' arithmetic alone (about one multiply-add per
//! cycle, half the core's peak) takes two thirds of one input's memory time and does not
//! fully overlap with it. Shapes of 2 x 8 and 1 x 8 (rows x
//! inputs), two passes of 4 inputs over 4 rows, prefetch distances of 512 to 4,096
//! floats, prefetching to the second level, and a burst of prefetches at each task's
//! start were all slower or the same as 3 x 8 with 2,048 floats ahead.
//!
//!     RAYON_NUM_THREADS=2 cargo run --release --example products_probe
use kvcandle::kernels::matvec::kernel;
use kvcandle::kernels::team::{Shards, Team};
use std::time::Instant;

/// (rows, columns) of a layer's four products.
const SHAPES: [(usize, usize); 4] = [(960, 576), (576, 576), (3072, 576), (576, 1536)];
const LAYERS: usize = 30;
/// Which matrix the i-th product of a pass multiplies.
type Pick = fn(usize) -> usize;

fn main() {
    let mats: Vec<(Vec<f32>, usize, usize)> = (0..LAYERS)
        .flat_map(|l| SHAPES.iter().map(move |&(r, c)| ((0..r * c).map(|i| ((i * 31 + l) % 97) as f32 / 97.0 - 0.5).collect(), r, c)))
        .collect();
    let bytes: usize = mats.iter().map(|(w, _, _)| 4 * w.len()).sum();
    let (team, k) = (Team::global(), kernel());
    println!("kernels {}, {} threads, {} MB of weights per pass", k.name(), team.threads(), bytes / 1_000_000);
    // rows per task as the decode step splits them
    let per_of = |n: usize| (n / (team.threads() * 8)).next_multiple_of(4).clamp(16, 256);
    let passes: [(&str, Pick); 3] = [("cold", |i| i), ("one layer", |i| i % SHAPES.len()), ("one o matrix", |_| 1)];
    for round in 0..4 {
        let mut line = format!("round {round}:");
        for (name, pick) in &passes {
            let pass_bytes: usize = (0..mats.len()).map(|i| 4 * mats[pick(i)].0.len()).sum();
            let mut ms = [0f64; 2];
            for (slot, m) in [1usize, 8].into_iter().enumerate() {
                let t = Instant::now();
                for i in 0..mats.len() {
                    let (w, r, c) = &mats[pick(i)];
                    let xs: Vec<Vec<f32>> = (0..m).map(|j| vec![0.01 * (j + 1) as f32; *c]).collect();
                    let xs: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
                    let mut outs = vec![vec![0f32; *r]; m];
                    let per = per_of(*r);
                    let shards: Vec<Shards<'_, f32>> = outs.iter_mut().map(|o| Shards::new(o)).collect();
                    team.run(r.div_ceil(per), &|t| {
                        let rows = t * per..((t + 1) * per).min(*r);
                        // SAFETY: tasks cover disjoint row ranges
                        let mut o: Vec<&mut [f32]> = shards.iter().map(|s| unsafe { s.part(rows.clone()) }).collect();
                        k.mul_rows_batch(w, &xs, rows.start, &mut o);
                    });
                    std::hint::black_box(&outs);
                }
                ms[slot] = t.elapsed().as_secs_f64() * 1e3;
            }
            let rate = |ms: f64| pass_bytes as f64 / ms / 1e6;
            line += &format!("  {name}: 1 input {:.1} GB/s, 8 inputs {:.1} GB/s", rate(ms[0]), rate(ms[1]));
        }
        println!("{line}");
    }
}
