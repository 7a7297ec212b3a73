//! Decode attention of one row over an 8-bit cache laid out as kvcandle's cache is
//! (blocks of 64 positions, each block one allocation holding every layer's keys, and
//! another its values), per layer: cold (between layers, 3.3 MB of other memory read, as
//! a quantized decode step reads a layer's weights) and hot (one layer again and again).
//!
//! With a second argument, for a profiler: `hot` (one row, one layer, five seconds) or
//! `rows8` (eight rows on one layer's blocks, as forks of one prompt, five seconds).
//!
//!     RAYON_NUM_THREADS=1 cargo run --release --example kv8_attention_probe [positions [hot|rows8]]
use kvcandle::kernels::attention::{decode_attention, decode_attention_rows, LayerKv};
use kvcandle::kernels::kv8;
use std::time::Instant;
fn main() {
    let (kv_heads, n_rep, d, layers, block_len) = (3usize, 3usize, 64usize, 30usize, 64usize);
    let len: usize = std::env::args().nth(1).map_or(2000, |s| s.parse().unwrap());
    let row = kv8::row_bytes(d);
    let per_layer = kv_heads * block_len * row;
    let nblocks = len.div_ceil(block_len);
    let mk = |seed: usize| -> Vec<Vec<u8>> {
        (0..nblocks)
            .map(|b| {
                let x: Vec<f32> = (0..layers * kv_heads * block_len * d).map(|i| (((i + b * 7 + seed) * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
                let mut out = vec![0u8; kv8::row_bytes(x.len())];
                kv8::quantize_into(&x, &mut out);
                out
            })
            .collect()
    };
    let (kb, vb) = (mk(1), mk(2));
    let weights: Vec<u8> = (0..layers * 3_300_000).map(|i| i as u8).collect();
    let q: Vec<f32> = (0..kv_heads * n_rep * d).map(|i| (i % 13) as f32 / 13.0).collect();
    let layer = |l: usize| -> LayerKv<'_, kv8::Q8Block> {
        LayerKv {
            blocks: (0..nblocks).map(|b| (kv8::as_blocks(&kb[b][l * per_layer..(l + 1) * per_layer]), kv8::as_blocks(&vb[b][l * per_layer..(l + 1) * per_layer]))).collect(),
            block_len,
            kv_heads,
            len,
            head_dim: d,
        }
    };
    let mut sink = 0u64;
    if std::env::args().nth(2).as_deref() == Some("hot") {
        // for a profiler: one layer hot for five seconds
        let (kv, t) = (layer(0), Instant::now());
        while t.elapsed().as_secs_f64() < 5.0 {
            std::hint::black_box(decode_attention(&q, &kv));
        }
        return;
    }
    if std::env::args().nth(2).as_deref() == Some("rows8") {
        // for a profiler: eight rows over one layer's blocks (forks of one prompt), hot
        let kv = layer(0);
        let qs: Vec<Vec<f32>> = (0..8).map(|r| q.iter().map(|x| x + r as f32 / 8.0).collect()).collect();
        let (q_refs, kv_refs): (Vec<&[f32]>, Vec<_>) = qs.iter().map(|q| (&q[..], &kv)).unzip();
        let (t, mut n) = (Instant::now(), 0);
        while t.elapsed().as_secs_f64() < 5.0 {
            std::hint::black_box(decode_attention_rows(&q_refs, &kv_refs));
            n += 1;
        }
        println!("8 rows, hot: {:.0} us a layer", t.elapsed().as_secs_f64() / n as f64 * 1e6);
        return;
    }
    for round in 0..5 {
        let (mut cold, mut stream) = (0.0, 0.0);
        for l in 0..layers {
            let t = Instant::now();
            sink += weights[l * 3_300_000..(l + 1) * 3_300_000].chunks_exact(64).map(|c| c[0] as u64).sum::<u64>();
            stream += t.elapsed().as_secs_f64();
            let kv = layer(l);
            let t = Instant::now();
            std::hint::black_box(decode_attention(&q, &kv));
            cold += t.elapsed().as_secs_f64();
        }
        let kv = layer(0);
        let t = Instant::now();
        for _ in 0..layers {
            std::hint::black_box(decode_attention(&q, &kv));
        }
        let hot = t.elapsed().as_secs_f64() / layers as f64;
        let bytes = (2 * kv_heads * len * row) as f64;
        println!(
            "round {round}: {len} positions, per layer: cold {:.0} us ({:.1} GB/s), hot {:.0} us; weights' stream {:.1} GB/s",
            cold / layers as f64 * 1e6,
            bytes * layers as f64 / cold / 1e9,
            hot * 1e6,
            (layers * 3_300_000) as f64 / stream / 1e9
        );
    }
    std::hint::black_box(sink);
}
