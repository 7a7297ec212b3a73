//! Whether the decode attention's reads overlap its arithmetic: one float32 row over
//! 2,048 positions (SmolLM2's 3 KV heads of 64, 3 query heads each), per layer, from
//! memory (30 layers' K/V in turn, 94 MB), beside the same bytes summed alone in the
//! order a task reads them (each task's 256 positions: keys, then values), with the K/V
//! in 4 KiB pages, in 2 MiB pages (Linux only: `madvise`), and laid out as the cache keeps
//! them (blocks of 64 positions, each block all layers' keys in one allocation).
//!
//! What it showed on an AMD EPYC Zen 4, one thread (2026-12-06 late): 300-380 us a
//! layer from memory, 250-300 in 2 MiB pages, the cache's blocks as 4 KiB pages, against
//! 97-139 us to read the bytes alone and about 85 us of arithmetic (attention_probe's
//! eight rows hot, over eight): the reads and the arithmetic do not overlap.
//!
//!     RAYON_NUM_THREADS=1 cargo run --release --example attention_stream_probe
use kvcandle::kernels::attention::{decode_attention, LayerKv};
use std::time::Instant;

#[cfg(target_os = "linux")]
const HUGE_PAGE: usize = 2 << 20;

/// `n` floats on a 2 MiB boundary, asked to be backed by 2 MiB pages when `huge` (Linux),
/// leaked (the probe's lifetime).
#[cfg(target_os = "linux")]
fn floats(n: usize, huge: bool) -> &'static mut [f32] {
    let bytes = n * 4 + HUGE_PAGE;
    // SAFETY: an anonymous private mapping of `bytes`, checked; the slice lies inside it,
    // on a boundary that is a multiple of f32's alignment; madvise never changes contents
    unsafe {
        let p = libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        assert!(p != libc::MAP_FAILED, "mmap of {bytes} bytes");
        let at = (p as usize).next_multiple_of(HUGE_PAGE);
        if huge {
            libc::madvise(at as *mut libc::c_void, n * 4, libc::MADV_HUGEPAGE);
        }
        std::slice::from_raw_parts_mut(at as *mut f32, n)
    }
}

/// Elsewhere an ordinary allocation either way (the "2 MiB pages" figures are then the
/// same memory as the others).
#[cfg(not(target_os = "linux"))]
fn floats(n: usize, _huge: bool) -> &'static mut [f32] {
    Vec::leak(vec![0f32; n])
}

fn value(i: usize) -> f32 {
    ((i * 7919) % 1000) as f32 / 1000.0 - 0.5
}

fn main() {
    let (kv_heads, n_rep, d, len, layers) = (3usize, 3usize, 64usize, 2048usize, 30usize);
    let per = kv_heads * len * d;
    let bytes = 2.0 * per as f64 * 4.0;
    let q: Vec<f32> = (0..kv_heads * n_rep * d).map(|i| (i % 13) as f32 / 13.0).collect();
    let sets: Vec<(&str, &[f32], &[f32])> = [("4 KiB pages", false), ("2 MiB pages", true)]
        .into_iter()
        .map(|(name, huge)| {
            let (k, v) = (floats(per * layers, huge), floats(per * layers, huge));
            for (i, (k, v)) in k.iter_mut().zip(v.iter_mut()).enumerate() {
                (*k, *v) = (value(i), value(i));
            }
            (name, &k[..], &v[..])
        })
        .collect();
    // the cache's layout: blocks of 64 positions, each all layers' (kv_heads, 64, d) keys
    // in one allocation and the values in another
    let (blocks, block) = (len / 64, kv_heads * 64 * d);
    let bk: Vec<Vec<f32>> = (0..blocks).map(|b| (0..layers * block).map(|i| value(i + b)).collect()).collect();
    let bv = bk.clone();
    let rounds: usize = std::env::var("ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(4);
    let us = |t: Instant| t.elapsed().as_secs_f64() / layers as f64 * 1e6;
    for round in 0..rounds {
        for &(name, k, v) in &sets {
            let t = Instant::now();
            for l in 0..layers {
                let kv = LayerKv::contiguous(&k[l * per..(l + 1) * per], &v[l * per..(l + 1) * per], kv_heads, len, len, d);
                std::hint::black_box(decode_attention(&q, &kv));
            }
            let attention = us(t);
            // the same bytes in the same order, summed in 16 lanes
            let t = Instant::now();
            let mut acc = [0f32; 16];
            for l in 0..layers {
                for h in 0..kv_heads {
                    for c in 0..len / 256 {
                        for src in [k, v] {
                            for chunk in src[l * per + (h * len + c * 256) * d..][..256 * d].chunks_exact(16) {
                                acc.iter_mut().zip(chunk).for_each(|(a, x)| *a += x);
                            }
                        }
                    }
                }
            }
            std::hint::black_box(acc);
            let alone = us(t);
            println!("round {round}, {name}: attention {attention:.0} us a layer ({:.1} GB/s), the bytes alone {alone:.0} us ({:.1} GB/s)", bytes / attention / 1e3, bytes / alone / 1e3);
        }
        let t = Instant::now();
        for l in 0..layers {
            let pairs = (0..blocks).map(|b| (&bk[b][l * block..(l + 1) * block], &bv[b][l * block..(l + 1) * block])).collect();
            let kv = LayerKv { blocks: pairs, block_len: 64, kv_heads, len, head_dim: d };
            std::hint::black_box(decode_attention(&q, &kv));
        }
        let attention = us(t);
        println!("round {round}, the cache's blocks: attention {attention:.0} us a layer ({:.1} GB/s)", bytes / attention / 1e3);
    }
}
