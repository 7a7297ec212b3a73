//! The KV cache the native engine owns.
//!
//! Keys and values are stored per layer before GQA expansion, as (1, kv_heads, capacity,
//! head_dim) buffers that new positions are written into in place; attention reads a
//! narrowed view of the first `len` positions, so no step copies the cache. Buffers grow
//! geometrically up to the model's context length.
//!
//! Forks share buffers copy-on-write. A shared store keeps a *frontier*: the highest
//! length any holder may rely on. A holder whose length equals the frontier may append
//! in place (every other holder only reads positions below its own, shorter or equal,
//! length); any other holder copies its prefix into a fresh store first. So after a
//! fork the first side to append keeps the buffers and the second pays one copy.

use std::sync::{Arc, Mutex};

use half::slice::HalfFloatSliceExt;

use candle_core::{DType, Device, Storage, Tensor};

use crate::attention::{decode_attention, prefill_attention, prefill_attention_half, LayerKv};

/// One layer's cached keys and values read in place, by storage type.
enum Kv<'a> {
    F32(&'a LayerKv<'a>),
    F16(&'a LayerKv<'a, half::f16>),
}

use crate::error::{Error, Result};

/// The shape of every layer's storage; fixed by the model that made the cache.
#[derive(Debug, Clone)]
pub struct CacheLayout {
    pub num_layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub max_len: usize,
    pub dtype: DType,
    pub device: Device,
}

impl CacheLayout {
    /// Bytes of keys plus values for one position across all layers.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.size_in_bytes()
    }
}

const MIN_CAPACITY: usize = 64;

struct Store {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    capacity: usize,
    frontier: Mutex<usize>,
}

impl Store {
    fn new(layout: &CacheLayout, capacity: usize) -> Result<Self> {
        let shape = (1, layout.kv_heads, capacity, layout.head_dim);
        let mut keys = Vec::with_capacity(layout.num_layers);
        let mut values = Vec::with_capacity(layout.num_layers);
        for _ in 0..layout.num_layers {
            keys.push(Tensor::zeros(shape, layout.dtype, &layout.device)?);
            values.push(Tensor::zeros(shape, layout.dtype, &layout.device)?);
        }
        Ok(Self { keys, values, capacity, frontier: Mutex::new(0) })
    }
}

pub struct KvCache {
    model_id: u64,
    layout: CacheLayout,
    store: Option<Arc<Store>>,
    /// The ids whose keys and values the cache holds; its length is the cache length.
    tokens: Vec<u32>,
}

impl KvCache {
    pub(crate) fn new(model_id: u64, layout: CacheLayout) -> Self {
        Self { model_id, layout, store: None, tokens: Vec::new() }
    }

    pub fn model_id(&self) -> u64 {
        self.model_id
    }

    pub fn layout(&self) -> &CacheLayout {
        &self.layout
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn max_len(&self) -> usize {
        self.layout.max_len
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Positions allocated in the storage this cache currently points at.
    pub fn capacity(&self) -> usize {
        self.store.as_ref().map_or(0, |s| s.capacity)
    }

    /// Bytes of the keys and values of the positions this cache holds.
    pub fn nbytes(&self) -> usize {
        self.len() * self.layout.bytes_per_token()
    }

    /// Empties the cache, keeping its storage for reuse.
    pub fn reset(&mut self) {
        self.tokens.clear();
    }

    /// Keeps the first `n` positions. O(1): only the length changes. Returns the number
    /// of positions dropped.
    pub fn crop(&mut self, n: i64) -> Result<usize> {
        let keep = self.count(n, false)?;
        let dropped = self.len() - keep;
        self.tokens.truncate(keep);
        Ok(dropped)
    }

    /// Drops the last `n` positions. O(1). Returns `n`, the number dropped.
    pub fn trim(&mut self, n: i64) -> Result<usize> {
        let drop = self.count(n, true)?;
        self.tokens.truncate(self.len() - drop);
        Ok(drop)
    }

    /// `n` as a count of positions this cache holds: in `[0, len]`.
    fn count(&self, n: i64, trim: bool) -> Result<usize> {
        match usize::try_from(n) {
            Ok(k) if k <= self.len() => Ok(k),
            _ => Err(self.count_error(trim, &n)),
        }
    }

    /// The error for `crop` (or `trim`) given `n` outside `[0, len]` (also for numbers that
    /// fit no integer type, as the caller wrote them). A negative crop length is refused
    /// rather than read as "drop from the end": `crop(-0)` could not be told from
    /// `crop(0)`; `trim(n)` says it.
    pub fn count_error(&self, trim: bool, n: &dyn std::fmt::Display) -> Error {
        let (len, n) = (self.len(), n.to_string());
        let verb = if trim { "trim" } else { "crop to" };
        let hint = match n.strip_prefix('-') {
            Some(m) if !trim => format!("; to drop the last {m} positions use trim({m})"),
            _ => String::new(),
        };
        Error::Input(format!("cannot {verb} {n}: the cache holds {len} positions, so n must be in [0, {len}]{hint}"))
    }

    /// A new cache with the same prefix, sharing the storage until one side appends.
    pub fn fork(&self) -> Self {
        Self {
            model_id: self.model_id,
            layout: self.layout.clone(),
            store: self.store.clone(),
            tokens: self.tokens.clone(),
        }
    }

    /// Whether this cache is sharing storage with another live cache.
    pub fn is_shared(&self) -> bool {
        self.store.as_ref().is_some_and(|s| Arc::strong_count(s) > 1)
    }

    /// Makes positions `len..len + extra` writable in place: claims them in the shared
    /// store, or moves this cache's prefix into a new, larger or private store.
    pub(crate) fn reserve(&mut self, extra: usize) -> Result<()> {
        let len = self.len();
        let needed = len + extra;
        if needed > self.layout.max_len {
            return Err(Error::Position {
                offset: len,
                requested: extra,
                limit: self.layout.max_len,
                available: self.layout.max_len - len,
            });
        }
        if let Some(store) = &self.store {
            if store.capacity >= needed {
                let exclusive = Arc::strong_count(store) == 1;
                let mut frontier = store.frontier.lock().unwrap_or_else(|p| p.into_inner());
                if exclusive || *frontier <= len {
                    *frontier = needed;
                    return Ok(());
                }
            }
        }
        // Room to double what the cache holds: geometric growth when it fills up, and a
        // fork copying its prefix out of shared storage gets headroom, not the old size.
        let capacity = needed.max(2 * len).max(MIN_CAPACITY).min(self.layout.max_len);
        let fresh = Store::new(&self.layout, capacity)?;
        if len > 0 {
            let old = self.store.as_ref().expect("a non-empty cache has a store");
            for (dst, src) in fresh.keys.iter().zip(&old.keys).chain(fresh.values.iter().zip(&old.values)) {
                dst.slice_set(&src.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
            }
        }
        *fresh.frontier.lock().unwrap_or_else(|p| p.into_inner()) = needed;
        self.store = Some(Arc::new(fresh));
        Ok(())
    }

    /// Writes the new keys and values (1, kv_heads, n, head_dim) of `layer` at the end
    /// of the cache. Positions must have been reserved.
    pub(crate) fn write(&self, layer: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let store = self.store.as_ref().expect("reserve() runs before write()");
        let dtype = self.layout.dtype;
        store.keys[layer].slice_set(&k.to_dtype(dtype)?, 2, self.len())?;
        store.values[layer].slice_set(&v.to_dtype(dtype)?, 2, self.len())?;
        Ok(())
    }

    /// Writes one new position's keys and values (kv_heads * head_dim floats each) of
    /// `layer` at the end of the cache, in place. Positions must have been reserved; the
    /// cache must be float32 or float16 in CPU memory.
    pub(crate) fn write_one(&self, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let store = self.store.as_ref().expect("reserve() runs before write_one()");
        let (heads, d) = (self.layout.kv_heads, self.layout.head_dim);
        for (t, data) in [(&store.keys[layer], k), (&store.values[layer], v)] {
            t.inplace_op1(&WritePosition { data, pos: self.len(), capacity: store.capacity, heads, head_dim: d })?;
        }
        Ok(())
    }

    /// Views of the first `len` positions of `layer`'s keys and values (no copy).
    pub(crate) fn view(&self, layer: usize, len: usize) -> Result<(Tensor, Tensor)> {
        match &self.store {
            Some(store) => Ok((store.keys[layer].narrow(2, 0, len)?, store.values[layer].narrow(2, 0, len)?)),
            None => Err(Error::Cache("the cache has no storage yet".into())),
        }
    }

    /// Attention of one new position's queries `q` (heads, head_dim) over `layer`'s first
    /// `len` positions, read in place from the buffers ([`crate::attention`]). None when
    /// the cache is not float32 in CPU memory (the caller then uses candle's ops).
    pub(crate) fn attend_one(&self, layer: usize, q: &[f32], len: usize) -> Result<Option<Vec<f32>>> {
        self.with_layer(layer, len, |kv| match kv {
            Kv::F32(kv) => decode_attention(q, kv),
            Kv::F16(kv) => decode_attention(q, kv),
        })
    }

    /// Causal attention of `seq` new positions' queries `q` (heads, seq, head_dim), the
    /// last `seq` of `layer`'s first `len` positions, over everything they may see; (seq,
    /// heads * head_dim) ([`crate::attention::prefill_attention`]). None when the cache is
    /// not float32 in CPU memory.
    pub(crate) fn attend_causal(&self, layer: usize, q: &[f32], seq: usize, len: usize) -> Result<Option<Vec<f32>>> {
        self.with_layer(layer, len, |kv| match kv {
            Kv::F32(kv) => prefill_attention(q, seq, kv),
            Kv::F16(kv) => prefill_attention_half(q, seq, kv),
        })
    }

    /// Runs `f` over `layer`'s first `len` positions read in place; None when the cache is
    /// not float32 or float16 in CPU memory.
    fn with_layer<R>(&self, layer: usize, len: usize, f: impl FnOnce(Kv<'_>) -> R) -> Result<Option<R>> {
        let store = self.store.as_ref().ok_or_else(|| Error::Cache("the cache has no storage yet".into()))?;
        if !self.layout.device.is_cpu() {
            return Ok(None);
        }
        let (ks, kl) = store.keys[layer].storage_and_layout();
        let (vs, vl) = store.values[layer].storage_and_layout();
        let (Storage::Cpu(k), Storage::Cpu(v)) = (&*ks, &*vs) else { return Ok(None) };
        let (kv_heads, capacity, head_dim) = (self.layout.kv_heads, store.capacity, self.layout.head_dim);
        Ok(match self.layout.dtype {
            DType::F32 => Some(f(Kv::F32(&LayerKv {
                keys: &k.as_slice::<f32>()?[kl.start_offset()..],
                values: &v.as_slice::<f32>()?[vl.start_offset()..],
                kv_heads,
                capacity,
                len,
                head_dim,
            }))),
            DType::F16 => Some(f(Kv::F16(&LayerKv {
                keys: &k.as_slice::<half::f16>()?[kl.start_offset()..],
                values: &v.as_slice::<half::f16>()?[vl.start_offset()..],
                kv_heads,
                capacity,
                len,
                head_dim,
            }))),
            _ => None,
        })
    }

    /// Records the ids whose keys and values were just written.
    pub(crate) fn commit(&mut self, ids: &[u32]) {
        self.tokens.extend_from_slice(ids);
    }

    /// A contiguous copy of `layer`'s keys (or values), shape (1, kv_heads, len, head_dim).
    pub fn layer_tensor(&self, layer: usize, values: bool) -> Result<Tensor> {
        if layer >= self.layout.num_layers {
            return Err(Error::Input(format!(
                "layer {layer} is out of range: the cache has {} layers",
                self.layout.num_layers
            )));
        }
        if self.is_empty() {
            let shape = (1, self.layout.kv_heads, 0, self.layout.head_dim);
            return Ok(Tensor::zeros(shape, self.layout.dtype, &self.layout.device)?);
        }
        let (k, v) = self.view(layer, self.len())?;
        Ok(if values { v } else { k }.contiguous()?)
    }
}

/// Copies one position's heads into a (1, heads, capacity, head_dim) float32 or float16
/// buffer.
struct WritePosition<'a> {
    data: &'a [f32],
    pos: usize,
    capacity: usize,
    heads: usize,
    head_dim: usize,
}

impl candle_core::InplaceOp1 for WritePosition<'_> {
    fn name(&self) -> &'static str {
        "kvcandle-write-position"
    }

    fn cpu_fwd(&self, storage: &mut candle_core::CpuStorage, layout: &candle_core::Layout) -> candle_core::Result<()> {
        let d = self.head_dim;
        if self.data.len() != self.heads * d || self.pos >= self.capacity || layout.dims() != [1, self.heads, self.capacity, d] {
            candle_core::bail!("cache write of {} floats at position {} does not fit {:?}", self.data.len(), self.pos, layout.dims());
        }
        let start = layout.start_offset();
        for (h, src) in self.data.chunks_exact(d).enumerate() {
            let at = start + (h * self.capacity + self.pos) * d;
            match storage {
                candle_core::CpuStorage::F32(buf) => buf[at..at + d].copy_from_slice(src),
                // rounded to nearest, as candle's to_dtype(F16) rounds a prefill's keys
                candle_core::CpuStorage::F16(buf) => buf[at..at + d].convert_from_f32_slice(src),
                _ => candle_core::bail!("the cache is neither float32 nor float16"),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache() -> KvCache {
        KvCache::new(1, CacheLayout { num_layers: 2, kv_heads: 2, head_dim: 4, max_len: 200, dtype: DType::F32, device: Device::Cpu })
    }

    /// Appends `n` positions whose keys and values all hold `value`.
    fn append(c: &mut KvCache, n: usize, value: f32) {
        c.reserve(n).unwrap();
        let t = Tensor::full(value, (1, 2, n, 4), &Device::Cpu).unwrap();
        for layer in 0..2 {
            c.write(layer, &t, &t).unwrap();
        }
        c.commit(&vec![value as u32; n]);
    }

    fn position_values(c: &KvCache) -> Vec<f32> {
        let k = c.layer_tensor(1, false).unwrap();
        (0..c.len()).map(|p| k.narrow(2, p, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()[0]).collect()
    }

    #[test]
    fn fork_is_copy_on_write() {
        let mut a = cache();
        append(&mut a, 3, 1.0);
        let mut b = a.fork();
        assert!(a.is_shared() && b.is_shared());
        append(&mut a, 1, 2.0); // a owns the frontier: writes in place
        append(&mut b, 2, 3.0); // b must copy its prefix first
        assert!(!a.is_shared() && !b.is_shared());
        assert_eq!(position_values(&a), vec![1.0, 1.0, 1.0, 2.0]);
        assert_eq!(position_values(&b), vec![1.0, 1.0, 1.0, 3.0, 3.0]);
    }

    #[test]
    fn crop_then_append_overwrites_only_the_dropped_tail() {
        let mut a = cache();
        append(&mut a, 5, 1.0);
        assert_eq!(a.trim(2).unwrap(), 2);
        append(&mut a, 1, 4.0);
        assert_eq!(position_values(&a), vec![1.0, 1.0, 1.0, 4.0]);
        assert!(a.crop(5).is_err() && a.crop(-1).is_err() && a.trim(5).is_err() && a.trim(-1).is_err());
        assert_eq!(a.len(), 4);
        assert_eq!(a.crop(4).unwrap(), 0);
        assert_eq!(a.trim(0).unwrap(), 0);
    }

    #[test]
    fn growth_keeps_contents_and_stops_at_the_context_length() {
        let mut a = cache();
        for i in 0..200 {
            append(&mut a, 1, i as f32);
        }
        assert_eq!(a.capacity(), 200);
        assert_eq!(position_values(&a), (0..200).map(|i| i as f32).collect::<Vec<_>>());
        assert!(matches!(a.reserve(1), Err(Error::Position { offset: 200, limit: 200, .. })));
    }
}
