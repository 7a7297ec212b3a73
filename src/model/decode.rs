//! kvcandle's own single-token step (a decode step), for float32 weights or GGUF blocks
//! in CPU memory, for one sequence or several at once (each with its own cache).
//!
//! No candle tensor is made inside a step: the hidden state lives in a few vectors, the
//! weights are read in place ([`Linear::view`]), and each matrix-vector product is one job
//! for the process's [`Team`] (q/k/v stacked in one matrix, gate/up in another, with
//! `silu(gate) * up` done by the job that computed them; the residual added by the job
//! that computed the output rows). The small work between products (norms, RoPE, writing
//! the cache, quantizing inputs to int8) is done row by row: by the caller for one row,
//! as a job of one task a row for several (a batch of 8 sequences at 2,000 tokens,
//! `quantized=True`, 3.03-3.25x -> 3.20-3.32x one sequence, measured with the two builds
//! in turns; the other thread had waited through it). A norm and the quantizing of its
//! result are one job, and each row's int8 inputs are made in buffers kept for the whole
//! step ([`QInput::fill`]): 2 threads, 8 sequences of 16 tokens, `quantized=True`, a
//! step 14.6-15.5 -> 13.1-13.4 ms, one sequence 5.8 -> 5.5 ms (in turns). Five product
//! jobs per layer, plus the attention's. With several sequences, a job's task multiplies
//! its rows with every sequence's input in turn, so the rows are read from memory once
//! and from the core's cache after that.

use super::*;
use super::cache::attend_rows;
use crate::kernels::qmatvec::QInput;
use crate::linear::{Input, View};
use crate::kernels::activation::silu_mul;
use crate::rope::Angles;
use crate::kernels::team::{Shards, Team};
use std::sync::OnceLock;

/// The largest row range one task computes (its partial results live on the stack).
const MAX_ROWS_PER_TASK: usize = 256;

impl Llama {
    /// Runs `ids[b]` (a few tokens) after the tokens of `caches[b]` for every sequence b
    /// in one step of rows: every token is one row, each weight matrix is read once per
    /// step for all rows (a task's rows stay in the core's cache while every row's input
    /// is multiplied with them), attention runs row by row over the row's own cache, each
    /// row seeing its sequence's earlier positions (the rows before it in the same chunk
    /// included). A row's arithmetic is exactly what it is alone (the same kernels on the
    /// same row ranges), so its logits depend neither on the batch nor on the chunk: a
    /// chunk gives, bit for bit, what its tokens give decoded one by one. Returns each
    /// sequence's logits: every row's, (len(ids[b]) * vocab) floats, with `all_logits`,
    /// else its last row's. A cache's length changes only if every step succeeded.
    pub(super) fn decode_rows(&self, ids: &[&[u32]], caches: &mut [&mut KvCache], all_logits: bool) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let (heads, kv_heads, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let team = Team::global();
        for (cache, ids) in caches.iter_mut().zip(ids) {
            cache.reserve(ids.len())?;
        }
        // (sequence, position) of every row, sequence by sequence
        let rows: Vec<(usize, usize)> = ids.iter().zip(caches.iter()).enumerate().flat_map(|(b, (ids, cache))| (0..ids.len()).map(move |j| (b, cache.len() + j))).collect();
        let n = rows.len();
        // each row's rotation angles, for every layer
        let angles: Vec<Angles> = rows.iter().map(|&(_, p)| self.rope.angles(p)).collect();
        let mut x = ids.iter().flat_map(|ids| ids.iter()).map(|&id| self.embed_one(id)).collect::<Result<Vec<_>>>()?;
        let mut xn = vec![vec![0f32; c.hidden_size]; n];
        let mut qkv = vec![vec![0f32; (heads + 2 * kv_heads) * d]; n];
        let mut h = vec![vec![0f32; c.intermediate_size]; n];
        // every row's int8 input to each of a layer's four products, refilled at each layer
        let mut slots: [Vec<QInput>; 4] = std::array::from_fn(|_| vec![QInput::default(); n]);
        let [to_qkv, to_o, to_gate_up, to_down] = &mut slots;
        for (i, layer) in self.layers.iter().enumerate() {
            let qkv_proj = &layer.attn.qkv;
            let inputs = normed(team, &layer.input_layernorm, qkv_proj, &x, &mut xn, to_qkv);
            products(team, &view(qkv_proj)?, &inputs, &mut qkv, false);
            let shared: Vec<&KvCache> = caches.iter().map(|c| &**c).collect();
            each_row(team, &mut qkv, |r, row| {
                let (b, p) = rows[r];
                self.rotate_and_store(row, &angles[r], shared[b], i, p)
            })
            .into_iter()
            .collect::<Result<()>>()?;
            // every row over its own sequence's positions up to itself, in one job
            let row_caches: Vec<&KvCache> = rows.iter().map(|&(b, _)| shared[b]).collect();
            let qs: Vec<&[f32]> = qkv.iter().map(|row| &row[..heads * d]).collect();
            let lens: Vec<usize> = rows.iter().map(|&(_, p)| p + 1).collect();
            let y = attend_rows(&row_caches, i, &qs, &lens)?
                .ok_or_else(|| Error::Cache("the single-token step needs a float32 or float16 cache in CPU memory".into()))?;
            let o = &layer.attn.o_proj;
            products(team, &view(o)?, &prepared(team, o, &y, to_o), &mut x, true);
            let gate_up = &layer.mlp.gate_up;
            let inputs = normed(team, &layer.post_attention_layernorm, gate_up, &x, &mut xn, to_gate_up);
            gated(team, &view(gate_up)?, &inputs, &mut h);
            let down = &layer.mlp.down_proj;
            products(team, &view(down)?, &prepared(team, down, &h, to_down), &mut x, true);
        }
        // the rows whose logits are asked for: each sequence's last, or all
        let wanted: Vec<usize> = (0..n).filter(|&r| all_logits || rows.get(r + 1).is_none_or(|next| next.0 != rows[r].0)).collect();
        let logits = self.head_rows(wanted.iter().map(|&r| &x[r][..]))?;
        for (cache, ids) in caches.iter_mut().zip(ids) {
            cache.commit(ids);
        }
        let mut out = vec![Vec::new(); ids.len()];
        for (&r, logits) in wanted.iter().zip(logits) {
            // a sequence's first row of logits moved, not copied
            let o = &mut out[rows[r].0];
            if o.is_empty() {
                *o = logits;
            } else {
                o.extend_from_slice(&logits);
            }
        }
        Ok(out)
    }
}

impl Llama {
    /// One row of the stacked q/k/v product, at position `p`: its queries and keys
    /// rotated in place by `p`'s angles, its keys and values written to `cache`'s `layer`
    /// (reserved).
    pub(super) fn rotate_and_store(&self, row: &mut [f32], angles: &Angles, cache: &KvCache, layer: usize, p: usize) -> Result<()> {
        let c = &self.config;
        let (q, kv) = row.split_at_mut(c.num_attention_heads * c.head_dim);
        let (k, v) = kv.split_at_mut(c.num_key_value_heads * c.head_dim);
        self.rope.rotate(q, k, angles);
        cache.write_at(layer, p, k, v)
    }

    /// The logits of final hidden states, one row each: the final norm and the head as a
    /// decode step computes them, so a row's logits do not depend on the other rows.
    pub(super) fn head_rows<'x>(&self, xs: impl Iterator<Item = &'x [f32]>) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let team = Team::global();
        let xs: Vec<&[f32]> = xs.collect();
        let mut xn = vec![vec![0f32; c.hidden_size]; xs.len()];
        let mut slots = vec![QInput::default(); xs.len()];
        let inputs = normed(team, &self.norm, &self.lm_head, &xs, &mut xn, &mut slots);
        // each zeroed by the allocator (`vec![row; n]` would copy a zeroed row n - 1 times)
        let mut logits: Vec<Vec<f32>> = xs.iter().map(|_| vec![0f32; c.vocab_size]).collect();
        products(team, &view(&self.lm_head)?, &inputs, &mut logits, false);
        Ok(logits)
    }
}

/// Each row's input prepared for `l` in its slot: quantized to int8 where its rows are
/// blocks, one task a row.
fn prepared<'x>(team: &Team, l: &Linear, xs: &'x [Vec<f32>], slots: &'x mut [QInput]) -> Vec<Input<'x>> {
    if l.int8_activations() {
        each_row(team, slots, |r, slot| l.fill(&xs[r], slot));
    } else {
        xs.iter().zip(slots.iter_mut()).for_each(|(x, slot)| l.fill(x, slot));
    }
    xs.iter().zip(slots.iter()).map(|(x, slot)| l.input(x, slot)).collect()
}

/// `xn[r] = norm(x[r])` and its input to `l` prepared in its slot ([`prepared`]), in one
/// job of one task a row.
fn normed<'x, X: AsRef<[f32]> + Sync>(team: &Team, norm: &Norm, l: &Linear, x: &[X], xn: &'x mut [Vec<f32>], slots: &'x mut [QInput]) -> Vec<Input<'x>> {
    let mut rows: Vec<(&mut Vec<f32>, &mut QInput)> = xn.iter_mut().zip(slots.iter_mut()).collect();
    each_row(team, &mut rows, |r, (xn, slot)| {
        norm.apply(x[r].as_ref(), xn);
        l.fill(xn, slot);
    });
    drop(rows);
    let (xn, slots): (&'x [Vec<f32>], &'x [QInput]) = (xn, slots);
    xn.iter().zip(slots).map(|(x, slot)| l.input(x, slot)).collect()
}

/// `f(r)` for every row r < n on the team, one task a row (one row: on the caller), the
/// results in row order: the small work between products (norms, RoPE, writing the
/// cache, quantizing inputs) for many rows, which the caller would otherwise do alone
/// while the other threads wait.
fn on_rows<R: Send + Sync>(team: &Team, n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let results: Vec<OnceLock<R>> = (0..n).map(|_| OnceLock::new()).collect();
    team.run(n, &|r| {
        let _ = results[r].set(f(r));
    });
    results.into_iter().map(|c| c.into_inner().expect("every row ran")).collect()
}

/// [`on_rows`] with each row's own buffer to change: `f(r, &mut rows[r])`.
fn each_row<T: Send, R: Send + Sync>(team: &Team, rows: &mut [T], f: impl Fn(usize, &mut T) -> R + Sync) -> Vec<R> {
    let n = rows.len();
    let shards = Shards::new(rows);
    // SAFETY: the task for row r is the only one to take row r
    on_rows(team, n, |r| f(r, unsafe { &mut shards.part(r..r + 1)[0] }))
}

fn view(l: &Linear) -> Result<View<'_>> {
    l.view().ok_or_else(|| Error::Engine(candle_core::Error::Msg("a linear layer of a float32 CPU model is not float32 in CPU memory".into())))
}

/// Tasks per thread a product is split into: several, so that a slow or preempted thread
/// is balanced out, and few, each a long run of rows. On the Intel Xeon (2 threads,
/// 2026-12-06, in turns, three tasks per thread against eight), the default model's
/// matrices then split evenly (six tasks of 160, 96 and 256 rows where there were 15 of 64,
/// 12 of 48 and 16 of 96): medians over 3 s, eight sequences of 16 tokens quantized
/// 11.0 / 11.2 -> 10.4 / 9.6 ms a step, float32 24.5 / 26.0 -> 22.3 / 23.3; one sequence
/// quantized 4.2 / 4.5 -> 3.8 / 3.9, float32 16.8 / 17.9 -> 15.6 / 16.5; at 2,000 tokens
/// eight quantized 19.2 / 19.0 -> 18.4 / 18.2, eight float32 36.8 / 36.6 -> 34.4 / 35.0, one
/// float32 22.0 / 22.0 -> 20.7 / 21.2. Four per thread was in between; with two, one
/// sequence in float32 was slower (17.3 / 17.9).
const TASKS_PER_THREAD: usize = 3;

/// Rows per task of `w`: [`TASKS_PER_THREAD`], a multiple of the kernels' row group
/// ([`View::row_group`]), at most [`MAX_ROWS_PER_TASK`].
fn rows_per_task(w: &View<'_>, rows: usize, threads: usize) -> usize {
    (rows / (threads * TASKS_PER_THREAD)).next_multiple_of(w.row_group().max(4)).clamp(16, MAX_ROWS_PER_TASK)
}

/// `out[b] = W x[b]` (or `out[b] += W x[b]` with `add`) for every sequence b, rows split
/// over the team; a task multiplies its rows with every input in turn.
fn products(team: &Team, w: &View<'_>, inputs: &[Input<'_>], outs: &mut [Vec<f32>], add: bool) {
    let n = w.out_features();
    debug_assert!(outs.iter().all(|o| o.len() == n));
    let per = rows_per_task(w, n, team.threads());
    let shards: Vec<Shards<'_, f32>> = outs.iter_mut().map(|o| Shards::new(o)).collect();
    team.run(n.div_ceil(per), &|t| {
        let rows = t * per..((t + 1) * per).min(n);
        // SAFETY: tasks cover disjoint row ranges
        let mut outs: Vec<&mut [f32]> = shards.iter().map(|s| unsafe { s.part(rows.clone()) }).collect();
        if add {
            let (mut stack, mut heap) = ([0f32; MAX_ROWS_PER_TASK], Vec::new());
            let parts = scratch(&mut stack, &mut heap, rows.len() * inputs.len());
            let mut views: Vec<&mut [f32]> = parts.chunks_mut(rows.len()).collect();
            w.mul_rows_batch(inputs, rows.start, &mut views);
            for (out, part) in outs.iter_mut().zip(parts.chunks(rows.len())) {
                out.iter_mut().zip(part).for_each(|(o, p)| *o += p);
            }
        } else {
            w.mul_rows_batch(inputs, rows.start, &mut outs);
        }
    });
}

/// `h[b] = silu(gate x[b]) * (up x[b])` for the stacked gate/up matrix: each task computes
/// the same rows of both halves for every input and combines them.
fn gated(team: &Team, w: &View<'_>, inputs: &[Input<'_>], hs: &mut [Vec<f32>]) {
    let n = w.out_features() / 2;
    debug_assert!(hs.iter().all(|h| h.len() == n));
    let per = rows_per_task(w, n, team.threads());
    let shards: Vec<Shards<'_, f32>> = hs.iter_mut().map(|h| Shards::new(h)).collect();
    team.run(n.div_ceil(per), &|t| {
        let rows = t * per..((t + 1) * per).min(n);
        let (len, batch) = (rows.len(), inputs.len());
        let (mut stack, mut heap) = ([0f32; 2 * MAX_ROWS_PER_TASK], Vec::new());
        let (gate, up) = scratch(&mut stack, &mut heap, 2 * len * batch).split_at_mut(len * batch);
        w.mul_rows_batch(inputs, rows.start, &mut gate.chunks_mut(len).collect::<Vec<_>>());
        w.mul_rows_batch(inputs, n + rows.start, &mut up.chunks_mut(len).collect::<Vec<_>>());
        for (b, shards) in shards.iter().enumerate() {
            // SAFETY: tasks cover disjoint row ranges
            let out = unsafe { shards.part(rows.clone()) };
            silu_mul(&gate[b * len..][..len], &up[b * len..][..len], out);
        }
    });
}

/// `n` zeroed floats: on the stack when they fit (a batch of one), else on the heap.
fn scratch<'a, const N: usize>(stack: &'a mut [f32; N], heap: &'a mut Vec<f32>, n: usize) -> &'a mut [f32] {
    if n <= N {
        &mut stack[..n]
    } else {
        heap.resize(n, 0.0);
        heap
    }
}
