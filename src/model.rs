//! The native Llama engine: a forward written with candle ops over a [`KvCache`] it owns.
//! Positions always come from the cache's length; the caller never passes one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Embedding;

use cache::{CacheLayout, KvCache};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::linear::Linear;
use crate::loader::{Part, Weights};
use crate::rope::Rope;

static NEXT_MODEL_ID: AtomicU64 = AtomicU64::new(1);

/// Longest run of tokens one pass handles; longer inputs are split (see `Llama::forward`).
pub const PREFILL_CHUNK: usize = 256;

/// Chunks of up to this many tokens run as rows of a single-token step
/// ([`Llama::decode_rows`]): the weights read once for all rows, each row's arithmetic
/// that of a decode step. Longer ones take the prefill path (matrix products tiled for
/// many rows, attention for a whole chunk at once). Measured on the default model after
/// 300 tokens (2 threads, Xeon), in decode steps, rows against the prefill path: float32
/// 8 tokens 1.38 against 2.24, 16 2.00 against 2.61, 32 3.09 against 3.37; quantized 16
/// 5.4 against 10.2, 32 10.5 against 12.2 (the prefill path dequantizes every matrix).
pub const SMALL_CHUNK: usize = 32;

/// Most rows of one prefill pass over several sequences' chunks (see `Llama::run`). A
/// pass reads (and, quantized, dequantizes) every weight matrix once, about 40 ms of a
/// chunk's cost on the default model, so short prompts gain most from sharing it: eight
/// prompts of 40 tokens took 1.7x less time stacked than one by one, eight of 64 1.4x
/// less, two of 128 1.15x less (float32, 2 threads, Xeon). Passes of 256, 512 and 1,024
/// rows measured the same within 5 % (more rows per pass cost more per row: the inputs of
/// a tile outgrow the core's cache).
pub const PREFILL_ROWS: usize = 2 * PREFILL_CHUNK;

/// A fresh identity for a loaded model; caches remember the model that made them.
pub(crate) fn next_model_id() -> u64 {
    NEXT_MODEL_ID.fetch_add(1, Ordering::Relaxed)
}

pub mod cache;
pub mod cache_file;
mod decode;
mod prefill;

struct Attention {
    /// q, k and v stacked: (heads + 2 kv_heads) * head_dim output rows
    qkv: Linear,
    o_proj: Linear,
}

struct Mlp {
    /// gate then up: 2 * intermediate_size output rows
    gate_up: Linear,
    down_proj: Linear,
}

struct Layer {
    input_layernorm: Norm,
    post_attention_layernorm: Norm,
    attn: Attention,
    mlp: Mlp,
}

pub struct Llama {
    id: u64,
    config: ModelConfig,
    quantized: bool,
    dtype: DType,
    device: Device,
    /// The lookup table; None when the embeddings are tied and the table is the
    /// `lm_head` (rows read from it, in its blocks when quantized: no second copy).
    embed_tokens: Option<Embedding>,
    layers: Vec<Layer>,
    norm: Norm,
    lm_head: Linear,
    rope: Rope,
    /// Float32 in CPU memory: single tokens take kvcandle's own step ([`decode`]) and
    /// prefill chunks its own causal attention ([`crate::kernels::attention::prefill_attention`]).
    decode: bool,
}

impl Llama {
    /// Builds the engine from loaded weights (shapes already checked by the loader); `w`
    /// keeps its tensors (they are shared, not copied, where the engine uses them as
    /// they are). [`Llama::from_weights`] releases them as it goes instead.
    pub fn new(w: &Weights) -> Result<Self> {
        let shallow = Weights {
            config: w.config.clone(),
            tensors: w.tensors.clone(),
            qtensors: w.qtensors.clone(),
            source: w.source.clone(),
            format: w.format,
            arena: w.arena.clone(),
        };
        Ok(Self::from_weights(shallow)?.0)
    }

    /// Builds the engine, taking each tensor out of `w` as it is used, so that a tensor
    /// copied into another form (q/k/v and gate/up stacked, GGUF blocks repacked) is
    /// released at once and loading never holds two copies of the weights. Returns what
    /// is left of `w` (config, source; no tensors).
    pub fn from_weights(mut w: Weights) -> Result<(Self, Weights)> {
        let c = w.config.clone();
        let (dtype, device, quantized) = (w.dtype(), w.device(), w.is_quantized());
        let source = w.source.clone();
        let linear = |w: &mut Weights, part: Part| -> Result<Linear> {
            let name = part.name();
            match (w.qtensors.remove(&name), w.tensors.remove(&name)) {
                (Some(q), _) => Ok(Linear::quantized(q, dtype, &device)?),
                (None, Some(t)) => Ok(Linear::new(t)),
                (None, None) => Err(Error::load(&source, format!("tensor {name} is missing"))),
            }
        };
        let take = |w: &mut Weights, part: Part| -> Result<Tensor> {
            let name = part.name();
            w.tensors.remove(&name).ok_or_else(|| Error::load(&source, format!("tensor {name} is missing")))
        };
        let norm = |w: &mut Weights, part: Part| -> Result<Norm> { Norm::new(take(w, part)?, c.rms_norm_eps) };
        // the largest matrix first, while the least memory is taken: converting it needs
        // its stored form and its new one at once
        let lm_head = linear(&mut w, if c.tie_word_embeddings { Part::Embed } else { Part::LmHead })?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let qkv = [Part::Q(i), Part::K(i), Part::V(i)].into_iter().map(|p| linear(&mut w, p)).collect::<Result<_>>()?;
            let gate_up = [Part::Gate(i), Part::Up(i)].into_iter().map(|p| linear(&mut w, p)).collect::<Result<_>>()?;
            let arena = w.arena.clone();
            layers.push(Layer {
                input_layernorm: norm(&mut w, Part::InputNorm(i))?,
                post_attention_layernorm: norm(&mut w, Part::PostNorm(i))?,
                attn: Attention { qkv: Linear::stack(qkv, arena.as_deref())?, o_proj: linear(&mut w, Part::O(i))? },
                mlp: Mlp { gate_up: Linear::stack(gate_up, arena.as_deref())?, down_proj: linear(&mut w, Part::Down(i))? },
            });
        }
        // tied: the lm_head is the table (a float lm_head is the same tensor; a quantized
        // one is read a row at a time), so no float copy is kept beside it
        let embed_tokens = match (c.tie_word_embeddings, &lm_head) {
            (true, Linear::Quantized(_)) => None,
            (true, Linear::Float(l)) => Some(Embedding::new(l.weight().clone(), c.hidden_size)),
            _ => Some(Embedding::new(take(&mut w, Part::Embed)?, c.hidden_size)),
        };
        let final_norm = norm(&mut w, Part::FinalNorm)?;
        let decode = device.is_cpu() && dtype == DType::F32;
        let model = Self {
            id: next_model_id(),
            rope: Rope::new(&c, dtype, &device)?,
            config: c,
            quantized,
            embed_tokens,
            layers,
            norm: final_norm,
            lm_head,
            dtype,
            device,
            decode,
        };
        Ok((model, w))
    }

    /// Every weight under its Hugging Face name, as candle's own Llama loads them: views
    /// into the engine's tensors (q/k/v and gate/up narrowed out of their stacks), no
    /// copy. None for a model whose linear layers run on quantized blocks.
    pub fn hf_tensors(&self) -> Option<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        let float = |l: &Linear| match l {
            Linear::Float(l) => Some(l.weight().clone()),
            _ => None,
        };
        let c = &self.config;
        let (q, kv, ff) = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size);
        for (i, l) in self.layers.iter().enumerate() {
            let qkv = float(&l.attn.qkv)?;
            let gate_up = float(&l.mlp.gate_up)?;
            for (part, t) in [
                (Part::Q(i), qkv.narrow(0, 0, q).ok()?),
                (Part::K(i), qkv.narrow(0, q, kv).ok()?),
                (Part::V(i), qkv.narrow(0, q + kv, kv).ok()?),
                (Part::O(i), float(&l.attn.o_proj)?),
                (Part::Gate(i), gate_up.narrow(0, 0, ff).ok()?),
                (Part::Up(i), gate_up.narrow(0, ff, ff).ok()?),
                (Part::Down(i), float(&l.mlp.down_proj)?),
                (Part::InputNorm(i), l.input_layernorm.weight.clone()),
                (Part::PostNorm(i), l.post_attention_layernorm.weight.clone()),
            ] {
                out.insert(part.name(), t);
            }
        }
        out.insert(Part::FinalNorm.name(), self.norm.weight.clone());
        out.insert(Part::Embed.name(), self.embed_tokens.as_ref()?.embeddings().clone());
        if !c.tie_word_embeddings {
            out.insert(Part::LmHead.name(), float(&self.lm_head)?);
        }
        Some(out)
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Bytes of the weights the engine holds (each shared tensor counted once).
    pub fn weight_bytes(&self) -> usize {
        let tensor = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let norms: usize = self.layers.iter().map(|l| tensor(&l.input_layernorm.weight) + tensor(&l.post_attention_layernorm.weight)).sum();
        let linears: usize = self
            .layers
            .iter()
            .map(|l| l.attn.qkv.nbytes() + l.attn.o_proj.nbytes() + l.mlp.gate_up.nbytes() + l.mlp.down_proj.nbytes())
            .sum();
        // a tied float table is the lm_head's own tensor
        let table = match (&self.embed_tokens, self.config.tie_word_embeddings) {
            (Some(e), false) => tensor(e.embeddings()),
            _ => 0,
        };
        norms + linears + table + tensor(&self.norm.weight) + self.lm_head.nbytes()
    }

    /// Whether the linear layers run on GGUF quantized blocks.
    pub fn is_quantized(&self) -> bool {
        self.quantized
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The dtype a new cache stores keys and values in unless asked otherwise: for a model
    /// whose linear layers multiply GGUF blocks with int8 activations, the 8-bit cache
    /// ([`cache::Q8_0`]; float16 where a head is not whole blocks of 32): against
    /// the float32 model on the same weights its greedy token then differs at 3.0 % of 600
    /// decode positions, as with a float32 cache, for 0.27 of its bytes per step
    /// (`bench_cache_dtype.py`). Else the model's own dtype (a float32 model, and one of
    /// kept 16-bit matrices, keep parity with float64).
    pub fn default_cache_dtype(&self) -> DType {
        if self.decode && self.layers.iter().any(|l| l.attn.qkv.int8_activations() || l.mlp.gate_up.int8_activations()) {
            if self.takes_eight_bit_cache() {
                cache::Q8_0
            } else {
                DType::F16
            }
        } else {
            self.dtype
        }
    }

    /// An empty cache storing keys and values as [`Self::default_cache_dtype`].
    pub fn new_cache(&self) -> KvCache {
        self.cache_of(self.default_cache_dtype())
    }

    /// An empty cache storing keys and values as `dtype`: the model's own, or for a
    /// float32 model in CPU memory float16 (half the bytes read per decode step) or the
    /// 8-bit blocks of [`cache::Q8_0`] (0.27 of them; head sizes that are whole
    /// blocks of 32). Attention still computes in float32, from the stored keys and values.
    pub fn new_cache_with(&self, dtype: DType) -> Result<KvCache> {
        let eight_bit = self.takes_eight_bit_cache();
        if dtype == self.dtype || (self.decode && (dtype == DType::F16 || (dtype == cache::Q8_0 && eight_bit))) {
            return Ok(self.cache_of(dtype));
        }
        let also = match (self.decode, eight_bit) {
            (true, true) => ", float16 or q8_0",
            (true, false) => " or float16 (q8_0 needs a head size that is a multiple of 32)",
            _ => "",
        };
        Err(Error::DType(format!(
            "a cache of {} does not fit this {} model on {}: its cache stores {}{also}",
            crate::device::dtype_name(dtype),
            crate::device::dtype_name(self.dtype),
            if self.device.is_cpu() { "cpu" } else { "this device" },
            crate::device::dtype_name(self.dtype),
        )))
    }

    /// Whether a head's keys and values are whole blocks of the 8-bit cache.
    fn takes_eight_bit_cache(&self) -> bool {
        self.config.head_dim.is_multiple_of(crate::kernels::kv8::QK)
    }

    fn cache_of(&self, dtype: DType) -> KvCache {
        KvCache::new(
            self.id,
            CacheLayout {
                num_layers: self.config.num_hidden_layers,
                kv_heads: self.config.num_key_value_heads,
                head_dim: self.config.head_dim,
                max_len: self.config.max_position_embeddings,
                dtype,
                device: self.device.clone(),
            },
        )
    }

    /// Checks everything about a call before any work: the cache's owner, the ids, the
    /// context length. Returns the ids as u32.
    pub fn check_input(&self, ids: &[i64], cache: &KvCache) -> Result<Vec<u32>> {
        self.check_owner(cache)?;
        let out = token_ids(ids, self.config.vocab_size)?;
        let (len, limit) = (cache.len(), cache.max_len());
        if len + ids.len() > limit {
            return Err(Error::Position { offset: len, requested: ids.len(), limit, available: limit - len });
        }
        Ok(out)
    }

    /// Checks, changing nothing, that `ids` as a whole sequence could be held by `cache`
    /// (after cropping it to a common prefix): the cache is this model's, every id is in
    /// the vocabulary and the sequence fits the context length.
    pub fn check_sequence(&self, ids: &[i64], cache: &KvCache) -> Result<Vec<u32>> {
        self.check_owner(cache)?;
        let out = token_ids(ids, self.config.vocab_size)?;
        let limit = cache.max_len();
        if ids.len() > limit {
            return Err(Error::Position { offset: 0, requested: ids.len(), limit, available: limit });
        }
        Ok(out)
    }

    fn check_owner(&self, cache: &KvCache) -> Result<()> {
        if cache.model_id() != self.id {
            return Err(Error::Cache(
                "this cache was made by another model: a cache holds one model's keys and values; use model.new_cache()".into(),
            ));
        }
        Ok(())
    }

    /// Runs `ids` at positions `len(cache)..`, appends their keys and values to the cache
    /// and returns float32 logits: (vocab,) for the last position, or (len(ids), vocab).
    /// On error the cache holds exactly what it held before.
    ///
    /// Long inputs run in chunks of [`PREFILL_CHUNK`] tokens, so attention scores never
    /// take more than (heads, chunk, len) floats; rows are independent in every product,
    /// so chunking does not change the results.
    pub fn forward(&self, ids: &[i64], cache: &mut KvCache, all_logits: bool) -> Result<Tensor> {
        let ids = self.check_input(ids, cache)?;
        let start = cache.len();
        match self.run(&[ids], &mut [cache], all_logits) {
            Ok(mut out) => Ok(out.pop().expect("one sequence")),
            Err(e) => {
                cache.crop(start as i64)?;
                Err(e)
            }
        }
    }

    /// Runs `ids[b]` after the tokens of `caches[b]` for every sequence b in one call and
    /// returns each sequence's logits as [`Self::forward`] returns them. Every sequence is
    /// checked before any work (an error names the sequence and is the one `forward`
    /// would raise); on error every cache holds what it held before. How the sequences
    /// share the work: [`Self::run`].
    pub fn forward_batch(&self, ids: &[Vec<i64>], caches: &mut [&mut KvCache], all_logits: bool) -> Result<Vec<Tensor>> {
        if ids.len() != caches.len() {
            return Err(Error::Input(format!("{} sequences of ids for {} caches: one cache per sequence", ids.len(), caches.len())));
        }
        let checked = ids
            .iter()
            .zip(caches.iter())
            .enumerate()
            .map(|(b, (ids, cache))| self.check_input(ids, cache).map_err(|e| e.in_sequence(b)))
            .collect::<Result<Vec<_>>>()?;
        let starts: Vec<usize> = caches.iter().map(|c| c.len()).collect();
        let result = self.run(&checked, caches, all_logits);
        if result.is_err() {
            for (cache, &start) in caches.iter_mut().zip(&starts) {
                cache.crop(start as i64)?;
            }
        }
        result
    }

    /// The work of [`Self::forward_batch`] on checked ids. Each sequence is split into
    /// chunks of [`PREFILL_CHUNK`] tokens, and round r runs the r-th chunk of every
    /// sequence that has one: the chunks of up to [`SMALL_CHUNK`] tokens as rows of one
    /// decode step ([`Self::decode_rows`]: each decode row's logits bit-identical to the
    /// sequence run alone), the longer ones with their rows stacked in every matrix
    /// product ([`Self::prefill_rows`], up to [`PREFILL_ROWS`] rows a pass; bit-identical
    /// to each alone too). Either way each weight matrix is read once for all of a pass's
    /// rows. Models whose products are candle's (not float32 or blocks in CPU memory)
    /// run every chunk alone through tensors ([`Self::prefill_chunk`]). A short chunk is
    /// always its sequence's last, so every earlier chunk ran in an earlier round.
    fn run(&self, ids: &[Vec<u32>], caches: &mut [&mut KvCache], all_logits: bool) -> Result<Vec<Tensor>> {
        let chunks: Vec<Vec<&[u32]>> = ids.iter().map(|s| s.chunks(PREFILL_CHUNK).collect()).collect();
        let mut outs: Vec<Vec<Tensor>> = vec![Vec::new(); ids.len()];
        let rounds = chunks.iter().map(Vec::len).max().unwrap_or(0);
        for r in 0..rounds {
            let live = (0..ids.len()).filter(|&b| r < chunks[b].len());
            let (rows, long): (Vec<usize>, Vec<usize>) = live.partition(|&b| self.decode && chunks[b][r].len() <= SMALL_CHUNK);
            if !rows.is_empty() {
                let tokens: Vec<&[u32]> = rows.iter().map(|&b| chunks[b][r]).collect();
                let logits = self.decode_rows(&tokens, &mut subset(caches, &rows), all_logits)?;
                for ((&b, logits), ids) in rows.iter().zip(logits).zip(&tokens) {
                    outs[b].push(self.logits_tensor(logits, ids.len(), all_logits)?);
                }
            }
            if self.decode {
                for pass in passes(&long, |b| chunks[b][r].len()) {
                    let tokens: Vec<&[u32]> = pass.iter().map(|&b| chunks[b][r]).collect();
                    let wanted: Vec<bool> = pass.iter().map(|&b| all_logits || r + 1 == chunks[b].len()).collect();
                    for (&b, logits) in pass.iter().zip(self.prefill_rows(&tokens, &mut subset(caches, &pass), &wanted, all_logits)?) {
                        outs[b].extend(logits);
                    }
                }
            } else {
                // candle's products (float16, GPUs) do not keep rows independent bit for
                // bit, so each chunk runs alone there, and on the CPU a short one (what
                // checking guessed tokens runs) one position at a time: what its ids give
                // fed so (a GPU keeps its one pass: there a step is worth many rows)
                for &b in &long {
                    let (chunk, want) = (chunks[b][r], all_logits || r + 1 == chunks[b].len());
                    if chunk.len() <= SMALL_CHUNK && self.device.is_cpu() {
                        for (i, id) in chunk.iter().enumerate() {
                            let wanted = all_logits || (want && i + 1 == chunk.len());
                            outs[b].extend(self.prefill_chunk(std::slice::from_ref(id), caches[b], wanted, all_logits)?);
                        }
                    } else {
                        outs[b].extend(self.prefill_chunk(chunk, caches[b], want, all_logits)?);
                    }
                }
            }
        }
        outs.into_iter()
            .map(|mut o| Ok(if o.len() == 1 { o.pop().expect("one output") } else { Tensor::cat(&o, 0)? }))
            .collect()
    }

    /// A step of rows' logits as [`Self::forward`] returns them.
    fn logits_tensor(&self, logits: Vec<f32>, rows: usize, all_logits: bool) -> Result<Tensor> {
        let vocab = self.config.vocab_size;
        Ok(if all_logits { Tensor::from_vec(logits, (rows, vocab), &self.device)? } else { Tensor::from_vec(logits, vocab, &self.device)? })
    }

    /// One chunk through candle tensors, for models whose weights are not float32 or blocks
    /// in CPU memory (float16, GPUs): appends it to the cache and returns its logits when
    /// `wanted` (all rows with `all_logits`, else the last row).
    fn prefill_chunk(&self, ids: &[u32], cache: &mut KvCache, wanted: bool, all_logits: bool) -> Result<Option<Tensor>> {
        let seq = ids.len();
        cache.reserve(seq)?;
        let mut x = self.embed(ids)?.unsqueeze(0)?;
        let mask = causal_mask(seq, cache.len(), &self.device)?;
        let rope = self.rope.tables(cache.len(), seq)?;
        for (i, layer) in self.layers.iter().enumerate() {
            x = self.layer_forward(i, layer, &x, cache, mask.as_ref(), &rope)?;
        }
        let logits = match (wanted, all_logits) {
            (false, _) => None,
            (true, true) => Some(self.lm_head.forward(&self.norm.forward(&x)?)?.squeeze(0)?),
            (true, false) => Some(self.lm_head.forward(&self.norm.forward(&x.narrow(1, seq - 1, 1)?.contiguous()?)?)?.squeeze(0)?.squeeze(0)?),
        };
        let logits = logits.map(|t| t.to_dtype(DType::F32)).transpose()?;
        cache.commit(ids);
        Ok(logits)
    }

    fn layer_forward(&self, index: usize, layer: &Layer, x: &Tensor, cache: &KvCache, mask: Option<&Tensor>, rope: &(Tensor, Tensor)) -> Result<Tensor> {
        let h = layer.input_layernorm.forward(x)?;
        let h = self.attention(index, &layer.attn, &h, cache, mask, rope)?;
        let x = (x + h)?;
        let h = layer.post_attention_layernorm.forward(&x)?;
        let m = &layer.mlp;
        let gate_up = m.gate_up.forward(&h)?;
        let inter = self.config.intermediate_size;
        let h = (candle_nn::ops::silu(&gate_up.narrow(2, 0, inter)?)? * gate_up.narrow(2, inter, inter)?)?;
        Ok((x + m.down_proj.forward(&h)?)?)
    }

    /// A chunk's attention over its cache (its keys and values written there first).
    fn attention(&self, index: usize, a: &Attention, x: &Tensor, cache: &KvCache, mask: Option<&Tensor>, rope: &(Tensor, Tensor)) -> Result<Tensor> {
        let c = &self.config;
        let qkv = a.qkv.forward(x)?;
        let (b, seq, _) = qkv.dims3()?;
        let (heads, kv_heads, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let offset = cache.len();
        let split = |t: Tensor, n: usize| -> candle_core::Result<Tensor> { t.reshape((b, seq, n, d))?.transpose(1, 2)?.contiguous() };
        let q = Rope::apply(&split(qkv.narrow(2, 0, heads * d)?, heads)?, rope)?;
        let k = Rope::apply(&split(qkv.narrow(2, heads * d, kv_heads * d)?, kv_heads)?, rope)?;
        let v = split(qkv.narrow(2, (heads + kv_heads) * d, kv_heads * d)?, kv_heads)?;
        cache.write(index, &k, &v)?;
        let total = offset + seq;
        let (k, v) = cache.view(index, total)?;
        // candle's gemm backend takes the strided views as they are; Accelerate (macOS) and
        // GPU kernels are stricter about strides, so they get a contiguous copy.
        let strided_ok = self.device.is_cpu() && !cfg!(target_os = "macos");
        let (k, v) = if strided_ok { (k, v) } else { (k.contiguous()?, v.contiguous()?) };

        // Grouped-query attention without repeating K/V: the n_rep query heads that share a
        // key/value head are stacked as extra rows of one matrix product per KV head.
        let n_rep = c.n_rep();
        let q = q.reshape((b, kv_heads, n_rep * seq, d))?.to_dtype(DType::F32)?;
        let (k, v) = (k.to_dtype(DType::F32)?, v.to_dtype(DType::F32)?);
        let att = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
        let att = match mask {
            Some(mask) => att.reshape((b, kv_heads, n_rep, seq, total))?.broadcast_add(mask)?.reshape((b, kv_heads, n_rep * seq, total))?,
            None => att,
        };
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let y = att.matmul(&v)?.to_dtype(self.dtype)?;
        let y = y.reshape((b, heads, seq, d))?.transpose(1, 2)?.reshape((b, seq, heads * d))?;
        Ok(a.o_proj.forward(&y)?)
    }
}

impl Llama {
    /// The embeddings of `ids`, (len, hidden) in the model's dtype.
    fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        match &self.embed_tokens {
            Some(table) => Ok(table.forward(&Tensor::new(ids, &self.device)?)?),
            None => {
                let mut rows = Vec::with_capacity(ids.len() * self.config.hidden_size);
                for &id in ids {
                    self.lm_head.row(id as usize, &mut rows)?;
                }
                Ok(Tensor::from_vec(rows, (ids.len(), self.config.hidden_size), &self.device)?.to_dtype(self.dtype)?)
            }
        }
    }

    /// One token's embedding as float32.
    fn embed_one(&self, id: u32) -> Result<Vec<f32>> {
        match &self.embed_tokens {
            Some(table) => Ok(table.embeddings().get(id as usize)?.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            None => {
                let mut row = Vec::with_capacity(self.config.hidden_size);
                self.lm_head.row(id as usize, &mut row)?;
                Ok(row)
            }
        }
    }
}

/// RMS normalisation with a learned scale.
struct Norm {
    weight: Tensor,
    /// the scale as floats, for single vectors
    floats: Vec<f32>,
    eps: f64,
}

impl Norm {
    fn new(weight: Tensor, eps: f64) -> Result<Self> {
        let floats = weight.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(Self { weight, floats, eps })
    }

    /// Every row of `x` normalised. On the CPU in float32, each row as [`Norm::apply`]
    /// does it (the mean of squares in float64), so a prefill's rows get a decode row's
    /// arithmetic; elsewhere candle's kernel.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = x.contiguous()?;
        if !(x.device().is_cpu() && x.dtype() == DType::F32) {
            return candle_nn::ops::rms_norm(&x, &self.weight, self.eps as f32);
        }
        let d = self.floats.len();
        let src = x.flatten_all()?.to_vec1::<f32>()?;
        let mut out = vec![0f32; src.len()];
        for (row, o) in src.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            self.apply(row, o);
        }
        Tensor::from_vec(out, x.shape(), x.device())
    }

    /// One vector: `out = x / sqrt(mean(x²) + eps) * weight`, the mean accumulated in
    /// float64, in eight independent sums (lane j: elements j, j + 8, ...) added at the
    /// end: one sum's chain of dependent additions took about 0.6 us a row of 576 (two
    /// norms a layer, 1 % of a quantized decode step), eight run side by side in vector
    /// registers.
    fn apply(&self, x: &[f32], out: &mut [f32]) {
        let mut lanes = [0f64; 8];
        let whole = x.chunks_exact(8);
        let rest: f64 = whole.remainder().iter().map(|v| (*v as f64) * (*v as f64)).sum();
        for c in whole {
            for (s, v) in lanes.iter_mut().zip(c) {
                *s += (*v as f64) * (*v as f64);
            }
        }
        let mean = (lanes.iter().sum::<f64>() + rest) / x.len() as f64;
        let scale = (1.0 / (mean + self.eps).sqrt()) as f32;
        for ((o, v), w) in out.iter_mut().zip(x).zip(&self.floats) {
            *o = v * scale * w;
        }
    }
}

/// Checks token ids are non-empty and inside the vocabulary; returns them as u32.
pub(crate) fn token_ids(ids: &[i64], vocab: usize) -> Result<Vec<u32>> {
    if ids.is_empty() {
        return Err(Error::Input("ids is empty: forward needs at least one token id".into()));
    }
    ids.iter()
        .enumerate()
        .map(|(index, &id)| match u32::try_from(id) {
            Ok(t) if (t as usize) < vocab => Ok(t),
            _ => Err(Error::TokenId { id: id.to_string(), index, vocab }),
        })
        .collect()
}

/// The caches at `picked` (indices in increasing order), borrowed for one pass.
fn subset<'c>(caches: &'c mut [&mut KvCache], picked: &[usize]) -> Vec<&'c mut KvCache> {
    caches.iter_mut().enumerate().filter(|(b, _)| picked.contains(b)).map(|(_, c)| &mut **c).collect()
}

/// `items` split, in order, into passes of at most [`PREFILL_ROWS`] rows (an item of more
/// rows alone in its pass).
fn passes(items: &[usize], rows: impl Fn(usize) -> usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut filled = 0;
    for &b in items {
        let n = rows(b);
        match out.last_mut() {
            Some(pass) if filled + n <= PREFILL_ROWS => pass.push(b),
            _ => {
                out.push(vec![b]);
                filled = 0;
            }
        }
        filled += n;
    }
    out
}

/// Additive causal mask (seq, offset + seq) for `seq` new tokens after `offset` cached
/// ones: the cached columns are all visible, the new ones form a triangle. None for a
/// single token, which sees everything.
fn causal_mask(seq: usize, offset: usize, device: &Device) -> Result<Option<Tensor>> {
    if seq == 1 {
        return Ok(None);
    }
    let total = offset + seq;
    let mask: Vec<f32> = (0..seq)
        .flat_map(|i| (0..total).map(move |j| if j > offset + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Ok(Some(Tensor::from_vec(mask, (seq, total), device)?))
}

#[allow(unused)]
fn _assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Llama>();
    is::<KvCache>();
}
