//! Decode attention alone at 2,048 positions (SmolLM2's 3 KV heads of 64, 3 query heads
//! each): per layer, cold (30 layers' K/V read in turn, 47 MB, as a decode step reads
//! them), hot (one layer's again and again: in the core's cache, so compute alone) and
//! for a float16 cache. What it showed here with the per-score horizontal sums: cold ~190
//! us, hot ~85 us, float16 cold ~135 us per layer; with blocks of 16 keys scored by one
//! transposing reduction, the exponential vectorized and prefetch one block ahead: cold
//! ~150 us (~21 GB/s of the ~30 GB/s numpy reads on 2 threads), hot ~60 us, float16
//! cold ~80 us. The 8-bit cache (`kv8`, blocks of 32 int8 values and a float16 scale)
//! is timed cold beside them, and eight rows over one layer's 8-bit blocks (forks of one
//! prompt, hot): 8 x 9 query heads' 2,048 scores and weighted sums; and the same eight
//! rows over one layer's float32 keys and values.
//!
//!     RAYON_NUM_THREADS=2 cargo run --release --example attention_probe

use kvcandle::kernels::attention::{decode_attention, decode_attention_rows, LayerKv};
use kvcandle::kernels::kv8;
use std::time::Instant;
fn main() {
    let (kv_heads, n_rep, d, len, layers) = (3usize, 3usize, 64usize, 2048usize, 30usize);
    let per = kv_heads * len * d;
    let keys: Vec<f32> = (0..per * layers).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    let values = keys.clone();
    let kh: Vec<half::f16> = keys.iter().map(|&x| half::f16::from_f32(x)).collect();
    let mut k8 = vec![0u8; kv8::row_bytes(keys.len())];
    kv8::quantize_into(&keys, &mut k8);
    let per8 = kv8::row_bytes(per);
    let q: Vec<f32> = (0..kv_heads * n_rep * d).map(|i| (i % 13) as f32 / 13.0).collect();
    for round in 0..3 {
        // cold: a different layer each call (47 MB of f32 K/V in turn)
        let t = Instant::now();
        for l in 0..layers {
            let kv = LayerKv::contiguous(&keys[l * per..(l + 1) * per], &values[l * per..(l + 1) * per], kv_heads, len, len, d);
            std::hint::black_box(decode_attention(&q, &kv));
        }
        let cold = t.elapsed().as_secs_f64() / layers as f64;
        let t = Instant::now();
        let kv = LayerKv::contiguous(&keys[..per], &values[..per], kv_heads, len, len, d);
        for _ in 0..layers {
            std::hint::black_box(decode_attention(&q, &kv));
        }
        let hot = t.elapsed().as_secs_f64() / layers as f64;
        let t = Instant::now();
        for l in 0..layers {
            let kv = LayerKv::contiguous(&kh[l * per..(l + 1) * per], &kh[l * per..(l + 1) * per], kv_heads, len, len, d);
            std::hint::black_box(decode_attention(&q, &kv));
        }
        let half = t.elapsed().as_secs_f64() / layers as f64;
        let t = Instant::now();
        for l in 0..layers {
            let blocks = kv8::as_blocks(&k8[l * per8..(l + 1) * per8]);
            let kv = LayerKv::contiguous(blocks, blocks, kv_heads, len, len, d);
            std::hint::black_box(decode_attention(&q, &kv));
        }
        let eight = t.elapsed().as_secs_f64() / layers as f64;
        // eight rows over one layer's 8-bit blocks (forks of one prompt), again and again
        let blocks = kv8::as_blocks(&k8[..per8]);
        let kv = LayerKv::contiguous(blocks, blocks, kv_heads, len, len, d);
        let qs8: Vec<Vec<f32>> = (0..8).map(|r| q.iter().map(|x| x + r as f32 / 8.0).collect()).collect();
        let (q_refs, kv_refs): (Vec<&[f32]>, Vec<_>) = qs8.iter().map(|q| (&q[..], &kv)).unzip();
        let t = Instant::now();
        for _ in 0..10 * layers {
            std::hint::black_box(decode_attention_rows(&q_refs, &kv_refs));
        }
        let rows8 = t.elapsed().as_secs_f64() / (10 * layers) as f64;
        // the same over one layer's float32 keys and values
        let kv = LayerKv::contiguous(&keys[..per], &values[..per], kv_heads, len, len, d);
        let kv_refs: Vec<_> = qs8.iter().map(|_| &kv).collect();
        let t = Instant::now();
        for _ in 0..10 * layers {
            std::hint::black_box(decode_attention_rows(&q_refs, &kv_refs));
        }
        let rows8_f32 = t.elapsed().as_secs_f64() / (10 * layers) as f64;
        let bytes = 2.0 * per as f64 * 4.0;
        println!(
            "round {round}: cold {:.0} us ({:.1} GB/s), hot {:.0} us, f16 cold {:.0} us, q8_0 cold {:.0} us, q8_0 8 rows hot {:.0} us, f32 8 rows hot {:.0} us",
            cold * 1e6,
            bytes / cold / 1e9,
            hot * 1e6,
            half * 1e6,
            eight * 1e6,
            rows8 * 1e6,
            rows8_f32 * 1e6
        );
    }
}
