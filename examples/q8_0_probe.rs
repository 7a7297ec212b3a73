//! The Q8_0 products (the default model's LM head: 49,152 x 576, read from memory; and a
//! 576 x 576 matrix again and again, from the second-level cache) for 1 and for 8 inputs
//! on one thread, as the best of 15 timings, in nanoseconds per block of 32 values of one
//! row (all inputs together), so builds can be compared in turns on any CPU.
//!
//!     cargo run --release --example q8_0_probe
use kvcandle::kernels::qmatvec::{QKind, QMatrix};
use std::time::Instant;
/// A Q8_0 matrix of pseudo-random bytes (scales 0.01).
fn mat(rows: usize, cols: usize) -> QMatrix {
    let mut s = 12345u64; let mut data = Vec::new();
    for _ in 0..rows * cols / 32 {
        data.extend_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        for _ in 0..32 { s ^= s << 13; s ^= s >> 7; s ^= s << 17; data.push(s as u8); }
    }
    QMatrix::new(QKind::Q8_0, rows, cols, data).unwrap_or_else(|_| panic!())
}
fn main() {
    let cols = 576;
    let hot = mat(576, cols); let cold = mat(49152, cols);
    let xs: Vec<_> = (0..8).map(|j| QMatrix::prepare(&(0..cols).map(|i| ((i * 7 + j * 3) % 23) as f32 / 23.0 - 0.5).collect::<Vec<f32>>())).collect();
    for (name, w, reps) in [("hot 576x576", &hot, 200usize), ("cold lm head", &cold, 3)] {
        for m in [1usize, 8] {
            let refs: Vec<&_> = xs[..m].iter().collect();
            let mut outs = vec![vec![0f32; w.rows()]; m];
            let mut best = f64::MAX;
            for _ in 0..15 {
                let t = Instant::now();
                for _ in 0..reps { let mut o: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect(); w.mul_rows_batch(&refs, 0, &mut o); std::hint::black_box(&outs); }
                best = best.min(t.elapsed().as_secs_f64() / reps as f64);
            }
            let blocks = (w.rows() * cols / 32) as f64;
            println!("{name} {m} input(s): {:.2} ns per block-row (all inputs)", best * 1e9 / blocks);
        }
    }
}
