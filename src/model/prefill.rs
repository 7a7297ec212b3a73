//! kvcandle's own prefill pass, for float32 weights or GGUF blocks in CPU memory: chunks of
//! one or several sequences (each with its own cache) whose rows are stacked in every
//! matrix product.
//!
//! As in a decode step ([`super::decode`]) no candle tensor is made inside the pass: the
//! hidden states of all rows live in a few buffers, each product is one job of tiles for
//! the process's [`Team`] ([`Linear::product_into`]: each weight read once for all rows,
//! the output projections adding into the residual), and the work between products (norms,
//! RoPE and the cache writes, `silu(gate) * up`) is a job of row ranges too, so no thread
//! waits through it. Attention runs chunk by chunk, each over its own cache. Every row's
//! arithmetic is its own: a chunk's logits and keys do not depend on the other chunks of
//! the pass (the products' rows are independent; see `Llama::run`).

use super::*;
use crate::kernels::activation::silu_mul;
use crate::rope::Angles;
use crate::kernels::team::{Shards, Team};
use crate::linear::Out;

impl Llama {
    /// One chunk of each of several sequences, appended to their caches; returns, for the
    /// chunks where `wanted`, their logits: all rows with `all_logits`, else the last row
    /// (through the decode step's head, [`Self::head_rows`]).
    pub(super) fn prefill_rows(&self, ids: &[&[u32]], caches: &mut [&mut KvCache], wanted: &[bool], all_logits: bool) -> Result<Vec<Option<Tensor>>> {
        let c = &self.config;
        let (heads, kv_heads, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (hidden, inter, width) = (c.hidden_size, c.intermediate_size, (heads + 2 * kv_heads) * d);
        let team = Team::global();
        for (cache, ids) in caches.iter_mut().zip(ids) {
            cache.reserve(ids.len())?;
        }
        // each chunk's first row in the pass and first position in its cache
        let firsts: Vec<usize> = ids.iter().scan(0, |at, ids| Some(std::mem::replace(at, *at + ids.len()))).collect();
        let offsets: Vec<usize> = caches.iter().map(|c| c.len()).collect();
        // (chunk, position) of every row
        let rows: Vec<(usize, usize)> = ids.iter().enumerate().flat_map(|(b, ids)| (0..ids.len()).map(move |j| (b, j))).map(|(b, j)| (b, offsets[b] + j)).collect();
        let n = rows.len();
        let angles: Vec<Angles> = rows.iter().map(|&(_, p)| self.rope.angles(p)).collect();
        let mut x = Vec::with_capacity(n * hidden);
        for ids in ids {
            x.extend(self.embed(ids)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
        let (mut xn, mut qkv, mut y) = (vec![0f32; n * hidden], vec![0f32; n * width], vec![0f32; n * heads * d]);
        let (mut gate_up, mut h) = (vec![0f32; n * 2 * inter], vec![0f32; n * inter]);
        let shared: Vec<&KvCache> = caches.iter().map(|c| &**c).collect();
        for (i, layer) in self.layers.iter().enumerate() {
            by_rows(team, &mut xn, hidden, |r, out| {
                layer.input_layernorm.apply(&x[r * hidden..][..hidden], out);
                Ok(())
            })?;
            layer.attn.qkv.product_into(&xn, into(&mut qkv, width, false))?;
            by_rows(team, &mut qkv, width, |r, row| {
                let (b, p) = rows[r];
                self.rotate_and_store(row, &angles[r], shared[b], i, p)
            })?;
            for (b, cache) in shared.iter().enumerate() {
                let (first, seq) = (firsts[b], ids[b].len());
                // the chunk's queries as (heads, seq, head_dim)
                let mut q = Vec::with_capacity(heads * seq * d);
                for head in 0..heads {
                    for row in qkv[first * width..(first + seq) * width].chunks_exact(width) {
                        q.extend_from_slice(&row[head * d..][..d]);
                    }
                }
                let out = cache
                    .attend_causal(i, &q, seq, offsets[b] + seq)?
                    .ok_or_else(|| Error::Cache("prefill needs a float32, float16 or 8-bit cache in CPU memory".into()))?;
                y[first * heads * d..(first + seq) * heads * d].copy_from_slice(&out);
            }
            layer.attn.o_proj.product_into(&y, into(&mut x, hidden, true))?;
            by_rows(team, &mut xn, hidden, |r, out| {
                layer.post_attention_layernorm.apply(&x[r * hidden..][..hidden], out);
                Ok(())
            })?;
            layer.mlp.gate_up.product_into(&xn, into(&mut gate_up, 2 * inter, false))?;
            by_rows(team, &mut h, inter, |r, out| {
                let (gate, up) = gate_up[r * 2 * inter..][..2 * inter].split_at(inter);
                silu_mul(gate, up, out);
                Ok(())
            })?;
            layer.mlp.down_proj.product_into(&h, into(&mut x, hidden, true))?;
        }
        // the head over the rows asked for, all chunks' together: each chunk's last row
        // as a decode step computes it, or every row through the tiled product
        let picked: Vec<std::ops::Range<usize>> = (0..ids.len())
            .filter(|&b| wanted[b])
            .map(|b| if all_logits { firsts[b]..firsts[b] + ids[b].len() } else { firsts[b] + ids[b].len() - 1..firsts[b] + ids[b].len() })
            .collect();
        let vocab = c.vocab_size;
        let flat = if all_logits {
            let picked: Vec<usize> = picked.iter().flat_map(|r| r.clone()).collect();
            let mut normed = vec![0f32; picked.len() * hidden];
            by_rows(team, &mut normed, hidden, |r, out| {
                self.norm.apply(&x[picked[r] * hidden..][..hidden], out);
                Ok(())
            })?;
            let mut l = vec![0f32; picked.len() * vocab];
            self.lm_head.product_into(&normed, into(&mut l, vocab, false))?;
            l
        } else {
            self.head_rows(picked.iter().map(|r| &x[r.start * hidden..][..hidden]))?.concat()
        };
        let mut logits = Vec::with_capacity(ids.len());
        let (mut rest, mut at) = (picked.iter(), 0);
        for &w in wanted {
            logits.push(if w {
                let r = rest.next().expect("a range per wanted chunk");
                let l = flat[at..at + r.len() * vocab].to_vec();
                at += r.len() * vocab;
                Some(if all_logits { Tensor::from_vec(l, (r.len(), vocab), &self.device)? } else { Tensor::from_vec(l, vocab, &self.device)? })
            } else {
                None
            });
        }
        drop(shared);
        for (cache, ids) in caches.iter_mut().zip(ids) {
            cache.commit(ids);
        }
        Ok(logits)
    }
}

/// `f(r, row r of data)` for every row of `data` ((rows, width) row-major) on the team, a
/// task per range of rows; the first error, if any.
fn by_rows(team: &Team, data: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) -> Result<()> + Sync) -> Result<()> {
    let n = data.len() / width.max(1);
    let per = n.div_ceil(team.threads() * 4).max(1);
    let shards = Shards::new(data);
    let failed = std::sync::Mutex::new(None);
    team.run(n.div_ceil(per), &|t| {
        for r in t * per..((t + 1) * per).min(n) {
            // SAFETY: the task for a range of rows is the only one to take them
            if let Err(e) = f(r, unsafe { shards.part(r * width..(r + 1) * width) }) {
                failed.lock().expect("no task panics").get_or_insert(e);
                return;
            }
        }
    });
    failed.into_inner().expect("no task panics").map_or(Ok(()), Err)
}

/// A product's whole output: rows of `ld` floats, written or added to.
fn into(data: &mut [f32], ld: usize, add: bool) -> Out<'_> {
    Out { data, ld, col: 0, add }
}
