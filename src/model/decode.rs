//! kvcandle's own single-token step (a decode step), for float32 weights or GGUF blocks
//! in CPU memory.
//!
//! No candle tensor is made inside a step: the hidden state lives in a few vectors, the
//! weights are read in place ([`Linear::view`]), and each matrix-vector product is one job
//! for the process's [`Team`] (q/k/v stacked in one matrix, gate/up in another, with
//! `silu(gate) * up` done by the job that computed them; the residual added by the job
//! that computed the output rows). Small serial work between jobs (norms, RoPE, writing
//! the cache) runs on the caller. Five jobs per layer, plus the attention's.

use super::*;
use crate::linear::{Input, View};
use crate::team::{Shards, Team};

/// The largest row range one task computes (its partial results live on the stack).
const MAX_ROWS_PER_TASK: usize = 256;

impl Llama {
    /// Runs one token at the cache's next position, appends its keys and values and
    /// returns the logits. The cache's length changes only if every step succeeded.
    pub(super) fn decode_one(&self, id: u32, cache: &mut KvCache) -> Result<Vec<f32>> {
        let c = &self.config;
        let (heads, kv_heads, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let team = Team::global();
        cache.reserve(1)?;
        let pos = cache.len();
        let mut x = self.embed_one(id)?;
        let mut xn = vec![0f32; c.hidden_size];
        let mut qkv = vec![0f32; (heads + 2 * kv_heads) * d];
        let mut h = vec![0f32; c.intermediate_size];
        for (i, layer) in self.layers.iter().enumerate() {
            layer.input_layernorm.apply(&x, &mut xn);
            let qkv_proj = &layer.attn.qkv;
            products(team, &view(qkv_proj)?, &qkv_proj.prepare(&xn), &mut qkv, false);
            let (q, kv) = qkv.split_at_mut(heads * d);
            let (k, v) = kv.split_at_mut(kv_heads * d);
            self.rope.rotate(q, pos);
            self.rope.rotate(k, pos);
            cache.write_one(i, k, v)?;
            let y = cache
                .attend_one(i, q, pos + 1)?
                .ok_or_else(|| Error::Cache("the single-token step needs a float32 or float16 cache in CPU memory".into()))?;
            let o = &layer.attn.o_proj;
            products(team, &view(o)?, &o.prepare(&y), &mut x, true);
            layer.post_attention_layernorm.apply(&x, &mut xn);
            let gate_up = &layer.mlp.gate_up;
            gated(team, &view(gate_up)?, &gate_up.prepare(&xn), &mut h);
            let down = &layer.mlp.down_proj;
            products(team, &view(down)?, &down.prepare(&h), &mut x, true);
        }
        self.norm.apply(&x, &mut xn);
        let mut logits = vec![0f32; c.vocab_size];
        products(team, &view(&self.lm_head)?, &self.lm_head.prepare(&xn), &mut logits, false);
        cache.commit(&[id]);
        Ok(logits)
    }
}

fn view(l: &Linear) -> Result<View<'_>> {
    l.view().ok_or_else(|| Error::Engine(candle_core::Error::Msg("a linear layer of a float32 CPU model is not float32 in CPU memory".into())))
}

/// Rows per task: several tasks per thread (so a slow thread is balanced out), a
/// multiple of four (the kernels' row group), at most [`MAX_ROWS_PER_TASK`].
fn rows_per_task(rows: usize, threads: usize) -> usize {
    (rows / (threads * 8)).next_multiple_of(4).clamp(16, MAX_ROWS_PER_TASK)
}

/// `out = W x` (or `out += W x` with `add`), rows split over the team.
fn products(team: &Team, w: &View<'_>, input: &Input<'_>, out: &mut [f32], add: bool) {
    let n = w.out_features();
    debug_assert_eq!(out.len(), n);
    let per = rows_per_task(n, team.threads());
    let shards = Shards::new(out);
    team.run(n.div_ceil(per), &|t| {
        let rows = t * per..((t + 1) * per).min(n);
        // SAFETY: tasks cover disjoint row ranges
        let out = unsafe { shards.part(rows.clone()) };
        if add {
            let mut part = [0f32; MAX_ROWS_PER_TASK];
            let part = &mut part[..rows.len()];
            w.mul_rows(input, rows.start, part);
            out.iter_mut().zip(part.iter()).for_each(|(o, p)| *o += p);
        } else {
            w.mul_rows(input, rows.start, out);
        }
    });
}

/// `h = silu(gate x) * (up x)` for the stacked gate/up matrix: each task computes the
/// same rows of both halves and combines them.
fn gated(team: &Team, w: &View<'_>, input: &Input<'_>, h: &mut [f32]) {
    let n = h.len();
    debug_assert_eq!(w.out_features(), 2 * n);
    let per = rows_per_task(n, team.threads());
    let shards = Shards::new(h);
    team.run(n.div_ceil(per), &|t| {
        let rows = t * per..((t + 1) * per).min(n);
        let (mut gate, mut up) = ([0f32; MAX_ROWS_PER_TASK], [0f32; MAX_ROWS_PER_TASK]);
        let (gate, up) = (&mut gate[..rows.len()], &mut up[..rows.len()]);
        w.mul_rows(input, rows.start, gate);
        w.mul_rows(input, n + rows.start, up);
        // SAFETY: tasks cover disjoint row ranges
        let out = unsafe { shards.part(rows) };
        for ((o, g), u) in out.iter_mut().zip(gate.iter()).zip(up.iter()) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    });
}
