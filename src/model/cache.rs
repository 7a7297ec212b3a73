//! The KV cache the native engine owns.
//!
//! Keys and values are stored per layer before GQA expansion, in blocks of
//! [`BLOCK_LEN`] positions: each block holds the keys of every layer as one (num_layers,
//! kv_heads, BLOCK_LEN, head_dim) tensor and the values as another, and a cache is a table
//! of references to its blocks (position `p` lives in block `p / BLOCK_LEN`). New positions are written in place; attention
//! reads the blocks through the table ([`crate::kernels::attention::LayerKv`]), so no step copies
//! the cache.
//!
//! Blocks are shared by reference: `fork` copies the table, never keys or values, and
//! `crop`, `trim` and `reset` drop references. A block keeps a *frontier*: how many of its
//! positions some holder may rely on. A holder that holds exactly the frontier (or the
//! only holder) may append in place, since every other holder only reads positions below
//! its own, shorter or equal, length; any other holder first copies that one partly filled
//! block. So after a fork the first side to append writes in place and the second copies
//! at most one block, and n forks of a long prompt share every full block of it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use half::slice::HalfFloatSliceExt;

use candle_core::{DType, Device, Storage, Tensor};

use crate::kernels::attention::{decode_attention_rows, prefill_attention, prefill_attention_widened, LayerKv};
use crate::kernels::kv8::{self, Q8Block};

/// A tensor's storage, locked for reading, and its layout.
type Locked<'g> = (std::sync::RwLockReadGuard<'g, Storage>, &'g candle_core::Layout);

/// One layer's cached keys and values read in place, by storage type.
enum Kv<'a> {
    F32(&'a LayerKv<'a>),
    F16(&'a LayerKv<'a, half::f16>),
    Q8(&'a LayerKv<'a, Q8Block>),
}

use crate::error::{Error, Result};

/// Positions per block: small enough that a fork that diverges copies little and holds
/// little beyond what it adds (a 2,000-token prompt forked 8 times and extended by 64
/// tokens each: at most 64 + 64 positions per fork), a whole number of the decode
/// attention's groups of 16 and a divisor of its chunk of 256 positions per task.
pub const BLOCK_LEN: usize = 64;

/// The storage dtype of the 8-bit cache (`new_cache(dtype="q8_0")`): each (position, KV
/// head) row of keys or values as [`kv8`]'s blocks of 32 int8 values and a float16 scale,
/// held as bytes. A float32 model's CPU engine reads it; head sizes must be whole blocks.
pub const Q8_0: DType = DType::U8;

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
    /// Storage elements of one (position, KV head) row: `head_dim` numbers, or the bytes
    /// of its 8-bit blocks.
    pub fn row_len(&self) -> usize {
        if self.dtype == Q8_0 {
            kv8::row_bytes(self.head_dim)
        } else {
            self.head_dim
        }
    }

    /// Bytes of keys plus values for one position across all layers.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.kv_heads * self.row_len() * self.dtype.size_in_bytes()
    }

    /// Bytes of one block (all its positions, used or not).
    pub fn bytes_per_block(&self) -> usize {
        BLOCK_LEN * self.bytes_per_token()
    }
}

/// A block's keys (or values) of every layer are one tensor, (num_layers, kv_heads,
/// BLOCK_LEN, row length), layer `l` at `narrow(0, l, 1)`. A step takes each block's
/// storage lock once per layer, on the caller while the other threads wait: one lock per
/// block is met again at every layer, where a tensor per layer made each lock a few cache
/// lines met once a step (4 % of a quantized decode step at 2,000 positions, `perf`).
struct Block {
    keys: Tensor,
    values: Tensor,
    frontier: Mutex<usize>,
}

impl Block {
    fn new(layout: &CacheLayout) -> Result<Self> {
        let shape = (layout.num_layers, layout.kv_heads, BLOCK_LEN, layout.row_len());
        let zeros = || Tensor::zeros(shape, layout.dtype, &layout.device);
        Ok(Self { keys: zeros()?, values: zeros()?, frontier: Mutex::new(0) })
    }

    /// A private copy (every position: the ones past the holder's length are never read).
    fn copy(&self) -> Result<Self> {
        Ok(Self { keys: self.keys.copy()?, values: self.values.copy()?, frontier: Mutex::new(0) })
    }

    /// `layer`'s keys and values, (1, kv_heads, BLOCK_LEN, row length) views.
    fn layer(&self, layer: usize) -> Result<(Tensor, Tensor)> {
        Ok((self.keys.narrow(0, layer, 1)?, self.values.narrow(0, layer, 1)?))
    }

    /// Read locks on the storage of the keys and values (every layer's).
    fn lock(&self) -> [Locked<'_>; 2] {
        [self.keys.storage_and_layout(), self.values.storage_and_layout()]
    }

    /// Lets a holder of `start` positions write up to position `end`: true if it may write
    /// in place (it is the only holder, or no holder relies on more than `start`).
    fn claim(self: &Arc<Self>, start: usize, end: usize) -> bool {
        let only = Arc::strong_count(self) == 1;
        let mut frontier = self.frontier.lock().unwrap_or_else(|p| p.into_inner());
        if only || *frontier <= start {
            *frontier = end;
            return true;
        }
        false
    }
}

pub struct KvCache {
    model_id: u64,
    layout: CacheLayout,
    /// block `b` holds positions `b * BLOCK_LEN..`; at least the blocks of `len` positions
    blocks: Vec<Arc<Block>>,
    /// The ids whose keys and values the cache holds; its length is the cache length.
    tokens: Vec<u32>,
}

/// Each block's keys and values as slices of its CPU storage (None elsewhere).
#[allow(clippy::type_complexity)]
fn slices<'g, T: candle_core::WithDType>(guards: &'g [[Locked<'g>; 2]], layer: usize) -> Result<Option<Vec<(&'g [T], &'g [T])>>> {
    guards.iter().map(|g| slice_pair::<T>(g, layer)).collect::<Result<Option<Vec<_>>>>()
}

/// One block's keys and values of `layer` as slices of its CPU storage (None elsewhere).
#[allow(clippy::type_complexity)]
fn slice_pair<'g, T: candle_core::WithDType>([(ks, kl), (vs, vl)]: &'g [Locked<'g>; 2], layer: usize) -> Result<Option<(&'g [T], &'g [T])>> {
    let (Storage::Cpu(k), Storage::Cpu(v)) = (&**ks, &**vs) else { return Ok(None) };
    // (every layer's part of the block is the same size, and the layout contiguous)
    let part = kl.shape().elem_count() / kl.dims()[0];
    let of = |s: &'g [T], l: &candle_core::Layout| &s[l.start_offset() + layer * part..][..part];
    Ok(Some((of(k.as_slice::<T>()?, kl), of(v.as_slice::<T>()?, vl))))
}

/// [`slices`] of the 8-bit cache's bytes, read as its blocks.
#[allow(clippy::type_complexity)]
fn q8_slices<'g>(guards: &'g [[Locked<'g>; 2]], layer: usize) -> Result<Option<Vec<(&'g [Q8Block], &'g [Q8Block])>>> {
    guards.iter().map(|g| q8_pair(g, layer)).collect::<Result<Option<Vec<_>>>>()
}

/// [`slice_pair`] of the 8-bit cache's bytes, read as its blocks.
#[allow(clippy::type_complexity)]
fn q8_pair<'g>(guard: &'g [Locked<'g>; 2], layer: usize) -> Result<Option<(&'g [Q8Block], &'g [Q8Block])>> {
    Ok(slice_pair::<u8>(guard, layer)?.map(|(k, v)| (kv8::as_blocks(k), kv8::as_blocks(v))))
}

/// Read locks on the storage of the blocks of row r's first `lens[r]` positions in
/// `caches[r]`, each block locked once however many rows read it (forks of one prompt
/// share their blocks, the rows of one chunk their cache); and each row's blocks as
/// indices into them.
fn lock_shared<'g>(caches: &[&'g KvCache], lens: &[usize]) -> (Vec<[Locked<'g>; 2]>, Vec<Vec<usize>>) {
    let mut locked = Vec::new();
    // the distinct blocks met at each block index (a block has one index: its positions),
    // each with its place in `locked`
    let mut met: Vec<Vec<(*const Block, usize)>> = Vec::new();
    let mut tables = Vec::with_capacity(caches.len());
    for (cache, &len) in caches.iter().zip(lens) {
        let blocks = &cache.blocks[..len.div_ceil(BLOCK_LEN)];
        met.resize_with(met.len().max(blocks.len()), Vec::new);
        let mut table = Vec::with_capacity(blocks.len());
        for (b, met) in blocks.iter().zip(met.iter_mut()) {
            let at = match met.iter().find(|(p, _)| *p == Arc::as_ptr(b)) {
                Some(&(_, at)) => at,
                None => {
                    locked.push(b.lock());
                    met.push((Arc::as_ptr(b), locked.len() - 1));
                    locked.len() - 1
                }
            };
            table.push(at);
        }
        tables.push(table);
    }
    (locked, tables)
}

/// Attention of several new positions at once: row r's queries `qs[r]` (heads, head_dim)
/// over the first `lens[r]` positions of `caches[r]`'s `layer`, in one job for the team
/// ([`decode_attention_rows`]); each row's result is what it is alone. Rows of
/// float32, float16 and 8-bit caches run as one such job per storage type. None when a
/// cache is none of them, or not in CPU memory.
pub(crate) fn attend_rows(caches: &[&KvCache], layer: usize, qs: &[&[f32]], lens: &[usize]) -> Result<Option<Vec<Vec<f32>>>> {
    if caches.iter().any(|c| !c.layout.device.is_cpu() || !matches!(c.layout.dtype, DType::F32 | DType::F16 | Q8_0)) {
        return Ok(None);
    }
    let (locked, tables) = lock_shared(caches, lens);
    let mut out = vec![Vec::new(); caches.len()];
    macro_rules! group {
        ($dtype:pat, $t:ty, $pair:expr) => {{
            let rows: Vec<usize> = (0..caches.len()).filter(|&r| matches!(caches[r].layout.dtype, $dtype)).collect();
            if !rows.is_empty() {
                // each locked block's slices, made once for every row that reads it
                let mut pairs: Vec<Option<(&[$t], &[$t])>> = vec![None; locked.len()];
                let mut kvs = Vec::with_capacity(rows.len());
                for &r in &rows {
                    let mut blocks = Vec::with_capacity(tables[r].len());
                    for &at in &tables[r] {
                        let pair = match pairs[at] {
                            Some(pair) => pair,
                            None => {
                                let Some(pair) = $pair(&locked[at], layer)? else { return Ok(None) };
                                *pairs[at].insert(pair)
                            }
                        };
                        blocks.push(pair);
                    }
                    let layout = &caches[r].layout;
                    kvs.push(LayerKv { blocks, block_len: BLOCK_LEN, kv_heads: layout.kv_heads, len: lens[r], head_dim: layout.head_dim });
                }
                let refs: Vec<&LayerKv<'_, $t>> = kvs.iter().collect();
                let row_qs: Vec<&[f32]> = rows.iter().map(|&r| qs[r]).collect();
                for (&r, y) in rows.iter().zip(decode_attention_rows(&row_qs, &refs)) {
                    out[r] = y;
                }
            }
        }};
    }
    group!(DType::F32, f32, slice_pair::<f32>);
    group!(DType::F16, half::f16, slice_pair::<half::f16>);
    group!(Q8_0, Q8Block, q8_pair);
    Ok(Some(out))
}

impl KvCache {
    pub(crate) fn new(model_id: u64, layout: CacheLayout) -> Self {
        Self { model_id, layout, blocks: Vec::new(), tokens: Vec::new() }
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

    /// Positions in the blocks this cache refers to.
    pub fn capacity(&self) -> usize {
        self.blocks.len() * BLOCK_LEN
    }

    /// Bytes of the keys and values of the positions this cache holds.
    pub fn nbytes(&self) -> usize {
        self.len() * self.layout.bytes_per_token()
    }

    /// Bytes of the blocks `caches` refer to together, each block counted once however
    /// many of them share it: the memory they hold.
    pub fn held_bytes<'a>(caches: impl IntoIterator<Item = &'a KvCache>) -> usize {
        let mut seen = HashSet::new();
        let mut bytes = 0;
        for cache in caches {
            for block in &cache.blocks {
                if seen.insert(Arc::as_ptr(block)) {
                    bytes += cache.layout.bytes_per_block();
                }
            }
        }
        bytes
    }

    /// Drops the blocks past the first `len` positions' (references only).
    fn release(&mut self) {
        self.blocks.truncate(self.len().div_ceil(BLOCK_LEN));
    }

    /// Empties the cache, dropping its references to blocks.
    pub fn reset(&mut self) {
        self.tokens.clear();
        self.release();
    }

    /// Keeps the first `n` positions. O(1) in the positions: the length changes and the
    /// references to blocks past them are dropped. Returns the number of positions dropped.
    pub fn crop(&mut self, n: i64) -> Result<usize> {
        let keep = self.count(n, false)?;
        let dropped = self.len() - keep;
        self.tokens.truncate(keep);
        self.release();
        Ok(dropped)
    }

    /// Drops the last `n` positions, as [`Self::crop`]. Returns `n`, the number dropped.
    pub fn trim(&mut self, n: i64) -> Result<usize> {
        let drop = self.count(n, true)?;
        self.tokens.truncate(self.len() - drop);
        self.release();
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

    /// A new cache with the same positions, sharing every block.
    pub fn fork(&self) -> Self {
        Self {
            model_id: self.model_id,
            layout: self.layout.clone(),
            blocks: self.blocks[..self.len().div_ceil(BLOCK_LEN)].to_vec(),
            tokens: self.tokens.clone(),
        }
    }

    /// Whether this cache shares a block with another live cache.
    pub fn is_shared(&self) -> bool {
        self.blocks.iter().any(|b| Arc::strong_count(b) > 1)
    }

    /// Makes positions `len..len + extra` writable in place: claims them in the blocks
    /// this cache has, copying a block another holder relies on past this cache's
    /// positions, and adds new blocks.
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
        for b in len / BLOCK_LEN..needed.div_ceil(BLOCK_LEN) {
            let first = b * BLOCK_LEN;
            let (start, end) = (len.saturating_sub(first), (needed - first).min(BLOCK_LEN));
            match self.blocks.get(b) {
                Some(block) if block.claim(start, end) => {}
                Some(block) => {
                    let copy = block.copy()?;
                    *copy.frontier.lock().unwrap_or_else(|p| p.into_inner()) = end;
                    self.blocks[b] = Arc::new(copy);
                }
                None => {
                    let block = Block::new(&self.layout)?;
                    *block.frontier.lock().unwrap_or_else(|p| p.into_inner()) = end;
                    self.blocks.push(Arc::new(block));
                }
            }
        }
        Ok(())
    }

    /// Writes the new keys and values (1, kv_heads, n, head_dim) of `layer` at the end
    /// of the cache, a run of positions per block. Positions must have been reserved. An
    /// 8-bit cache rounds float keys and values into its blocks, and takes its own blocks'
    /// bytes, (1, kv_heads, n, row bytes), as they are (a saved cache loading).
    pub(crate) fn write(&self, layer: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let dtype = self.layout.dtype;
        let n = k.dim(2)?;
        let mut done = 0;
        while done < n {
            let p = self.len() + done;
            let (block, at) = (&self.blocks[p / BLOCK_LEN], p % BLOCK_LEN);
            let m = (BLOCK_LEN - at).min(n - done);
            let (k, v) = (k.narrow(2, done, m)?.contiguous()?, v.narrow(2, done, m)?.contiguous()?);
            if dtype == Q8_0 && k.dtype() != Q8_0 {
                let floats = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?) };
                self.write_run(layer, p, m, &floats(&k)?, &floats(&v)?)?;
            } else {
                let (keys, values) = block.layer(layer)?;
                keys.slice_set(&k.to_dtype(dtype)?, 2, at)?;
                values.slice_set(&v.to_dtype(dtype)?, 2, at)?;
            }
            done += m;
        }
        Ok(())
    }

    /// Writes one new position's keys and values (kv_heads * head_dim floats each) of
    /// `layer` at position `p` (the cache's length or after it), in place. Positions must
    /// have been reserved; the cache must be float32, float16 or 8-bit in CPU memory.
    pub(crate) fn write_at(&self, layer: usize, p: usize, k: &[f32], v: &[f32]) -> Result<()> {
        self.write_run(layer, p, 1, k, v)
    }

    /// [`Self::write_at`] for `count` positions from `p` in one block: keys and values
    /// (kv_heads, count, head_dim) floats each.
    fn write_run(&self, layer: usize, p: usize, count: usize, k: &[f32], v: &[f32]) -> Result<()> {
        debug_assert!(p >= self.len());
        let block = &self.blocks[p / BLOCK_LEN];
        let (heads, d, row) = (self.layout.kv_heads, self.layout.head_dim, self.layout.row_len());
        for (t, data) in [(&block.keys, k), (&block.values, v)] {
            t.inplace_op1(&WritePosition { data, layer, pos: p % BLOCK_LEN, count, capacity: BLOCK_LEN, heads, head_dim: d, row })?;
        }
        Ok(())
    }

    /// `layer`'s keys and values of the first `len` positions as stored, (1, kv_heads,
    /// len, row length) each: the blocks joined (a copy).
    pub(crate) fn view(&self, layer: usize, len: usize) -> Result<(Tensor, Tensor)> {
        let used = &self.blocks[..len.div_ceil(BLOCK_LEN)];
        if used.is_empty() {
            let t = Tensor::zeros((1, self.layout.kv_heads, 0, self.layout.row_len()), self.layout.dtype, &self.layout.device)?;
            return Ok((t.clone(), t));
        }
        let (keys, values): (Vec<Tensor>, Vec<Tensor>) = used.iter().map(|b| b.layer(layer)).collect::<Result<Vec<_>>>()?.into_iter().unzip();
        let join = |ts: Vec<Tensor>| -> Result<Tensor> { Ok(Tensor::cat(&ts, 2)?.narrow(2, 0, len)?) };
        Ok((join(keys)?, join(values)?))
    }

    /// Causal attention of `seq` new positions' queries `q` (heads, seq, head_dim), the
    /// last `seq` of `layer`'s first `len` positions, over everything they may see; (seq,
    /// heads * head_dim) ([`crate::kernels::attention::prefill_attention`]). None when the cache is
    /// not float32 in CPU memory.
    pub(crate) fn attend_causal(&self, layer: usize, q: &[f32], seq: usize, len: usize) -> Result<Option<Vec<f32>>> {
        self.with_layer(layer, len, |kv| match kv {
            Kv::F32(kv) => prefill_attention(q, seq, kv),
            Kv::F16(kv) => prefill_attention_widened(q, seq, kv),
            Kv::Q8(kv) => prefill_attention_widened(q, seq, kv),
        })
    }

    /// Runs `f` over `layer`'s first `len` positions read in place from the blocks; None
    /// when the cache is not float32, float16 or 8-bit in CPU memory.
    fn with_layer<R>(&self, layer: usize, len: usize, f: impl FnOnce(Kv<'_>) -> R) -> Result<Option<R>> {
        if !self.layout.device.is_cpu() {
            return Ok(None);
        }
        let guards = self.guards(len);
        let (kv_heads, head_dim) = (self.layout.kv_heads, self.layout.head_dim);
        Ok(match self.layout.dtype {
            DType::F32 => slices::<f32>(&guards, layer)?.map(|blocks| f(Kv::F32(&LayerKv { blocks, block_len: BLOCK_LEN, kv_heads, len, head_dim }))),
            DType::F16 => slices::<half::f16>(&guards, layer)?.map(|blocks| f(Kv::F16(&LayerKv { blocks, block_len: BLOCK_LEN, kv_heads, len, head_dim }))),
            Q8_0 => q8_slices(&guards, layer)?.map(|blocks| f(Kv::Q8(&LayerKv { blocks, block_len: BLOCK_LEN, kv_heads, len, head_dim }))),
            _ => None,
        })
    }

    /// Read locks on the storage of the keys and values in the blocks of the first `len`
    /// positions.
    fn guards(&self, len: usize) -> Vec<[Locked<'_>; 2]> {
        self.blocks[..len.div_ceil(BLOCK_LEN)].iter().map(|b| b.lock()).collect()
    }

    /// Records the ids whose keys and values were just written.
    pub(crate) fn commit(&mut self, ids: &[u32]) {
        self.tokens.extend_from_slice(ids);
    }

    /// A contiguous copy of `layer`'s keys (or values), shape (1, kv_heads, len, head_dim):
    /// as stored, the 8-bit cache's widened to float32.
    pub fn layer_tensor(&self, layer: usize, values: bool) -> Result<Tensor> {
        let stored = self.layer_stored(layer, values)?;
        if self.layout.dtype != Q8_0 {
            return Ok(stored);
        }
        let bytes = stored.flatten_all()?.to_vec1::<u8>()?;
        let mut wide = vec![0f32; bytes.len() / kv8::BLOCK_BYTES * kv8::QK];
        kv8::widen_into(kv8::as_blocks(&bytes), &mut wide);
        Ok(Tensor::from_vec(wide, (1, self.layout.kv_heads, self.len(), self.layout.head_dim), &self.layout.device)?)
    }

    /// A contiguous copy of `layer`'s keys (or values) as stored, shape (1, kv_heads, len,
    /// [`CacheLayout::row_len`]): what a saved cache holds.
    pub fn layer_stored(&self, layer: usize, values: bool) -> Result<Tensor> {
        if layer >= self.layout.num_layers {
            return Err(Error::Input(format!(
                "layer {layer} is out of range: the cache has {} layers",
                self.layout.num_layers
            )));
        }
        let (k, v) = self.view(layer, self.len())?;
        Ok(if values { v } else { k }.contiguous()?)
    }
}

/// Copies `count` positions' heads, (heads, count, head_dim) floats, into `layer` of a
/// (layers, heads, capacity, row) float32 or float16 buffer (row = head_dim) from position
/// `pos`, or rounds them into an 8-bit one (row = the bytes of a head's blocks).
struct WritePosition<'a> {
    data: &'a [f32],
    layer: usize,
    pos: usize,
    count: usize,
    capacity: usize,
    heads: usize,
    head_dim: usize,
    row: usize,
}

impl candle_core::InplaceOp1 for WritePosition<'_> {
    fn name(&self) -> &'static str {
        "kvcandle-write-position"
    }

    fn cpu_fwd(&self, storage: &mut candle_core::CpuStorage, layout: &candle_core::Layout) -> candle_core::Result<()> {
        let (d, row) = (self.head_dim, self.row);
        let n = self.count;
        let dims = layout.dims();
        if self.data.len() != self.heads * n * d || self.pos + n > self.capacity || dims.len() != 4 || self.layer >= dims[0] || dims[1..] != [self.heads, self.capacity, row] {
            candle_core::bail!("cache write of {} floats at layer {}, position {} does not fit {dims:?}", self.data.len(), self.layer, self.pos);
        }
        let start = layout.start_offset() + self.layer * self.heads * self.capacity * row;
        for (r, src) in self.data.chunks_exact(d).enumerate() {
            let (h, i) = (r / n, r % n);
            let at = start + (h * self.capacity + self.pos + i) * row;
            match storage {
                candle_core::CpuStorage::F32(buf) => buf[at..at + d].copy_from_slice(src),
                // rounded to nearest, as candle's to_dtype(F16) rounds a prefill's keys
                candle_core::CpuStorage::F16(buf) => buf[at..at + d].convert_from_f32_slice(src),
                candle_core::CpuStorage::U8(buf) => kv8::quantize_into(src, &mut buf[at..at + row]),
                _ => candle_core::bail!("the cache is neither float32, float16 nor 8-bit"),
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
    fn forks_share_full_blocks_and_copy_at_most_one() {
        let layout = cache().layout;
        let block = layout.bytes_per_block();
        let mut a = cache();
        append(&mut a, 2 * BLOCK_LEN + 10, 1.0); // two full blocks and one partly filled
        let mut forks: Vec<KvCache> = (0..4).map(|_| a.fork()).collect();
        assert_eq!(KvCache::held_bytes(std::iter::once(&a).chain(&forks)), 3 * block);
        for (i, f) in forks.iter_mut().enumerate() {
            append(f, 5, 2.0 + i as f32);
        }
        // the first fork wrote in place; the others copied the partly filled block
        assert_eq!(KvCache::held_bytes(std::iter::once(&a).chain(&forks)), 3 * block + 3 * block);
        for (i, f) in forks.iter().enumerate() {
            let mut want = vec![1.0; 2 * BLOCK_LEN + 10];
            want.extend([2.0 + i as f32; 5]);
            assert_eq!(position_values(f), want);
        }
        assert_eq!(position_values(&a), vec![1.0; 2 * BLOCK_LEN + 10]);
        // a appends after its forks: it copies its partly filled block too
        append(&mut a, 1, 9.0);
        assert_eq!(position_values(&a)[2 * BLOCK_LEN + 10], 9.0);
        assert_eq!(position_values(&forks[0])[2 * BLOCK_LEN + 10], 2.0);
        // cropping drops references: the blocks only `a` held past 64 positions are freed
        a.crop(BLOCK_LEN as i64).unwrap();
        assert_eq!(a.capacity(), BLOCK_LEN);
        drop(forks);
        assert_eq!(KvCache::held_bytes([&a]), block);
        assert!(!a.is_shared());
    }

    #[test]
    fn a_fork_at_a_block_boundary_copies_nothing() {
        let mut a = cache();
        append(&mut a, BLOCK_LEN, 1.0);
        let mut b = a.fork();
        append(&mut b, 3, 2.0);
        append(&mut a, 3, 3.0);
        assert_eq!(KvCache::held_bytes([&a, &b]), 3 * a.layout.bytes_per_block());
        assert_eq!(position_values(&b)[BLOCK_LEN..], [2.0; 3]);
        assert_eq!(position_values(&a)[BLOCK_LEN..], [3.0; 3]);
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
    fn an_eight_bit_cache_stores_rounded_rows_and_forks_exactly() {
        let (heads, d) = (2, 64);
        let layout = CacheLayout { num_layers: 1, kv_heads: heads, head_dim: d, max_len: 300, dtype: Q8_0, device: Device::Cpu };
        assert_eq!(layout.bytes_per_token(), 2 * heads * 68);
        let floats = |n: usize, seed: f32| -> Vec<f32> { (0..heads * n * d).map(|i| (i as f32 * 0.37 + seed).sin() * (1.0 + (i % d) as f32)).collect() };
        let rounded = |x: &[f32]| -> Vec<f32> {
            let mut bytes = vec![0u8; kv8::row_bytes(x.len())];
            kv8::quantize_into(x, &mut bytes);
            let mut out = vec![0f32; x.len()];
            kv8::widen_into(kv8::as_blocks(&bytes), &mut out);
            out
        };
        // (heads, n, d) per write: a prefill that crosses a block, then single positions
        let mut a = KvCache::new(1, layout);
        let mut want_k = vec![Vec::new(); heads];
        let put = |c: &mut KvCache, want: &mut Vec<Vec<f32>>, n: usize, seed: f32| {
            let x = floats(n, seed);
            c.reserve(n).unwrap();
            let t = Tensor::from_vec(x.clone(), (1, heads, n, d), &Device::Cpu).unwrap();
            c.write(0, &t, &t).unwrap();
            c.commit(&vec![0; n]);
            for h in 0..heads {
                want[h].extend(rounded(&x[h * n * d..(h + 1) * n * d]));
            }
        };
        put(&mut a, &mut want_k, BLOCK_LEN + 5, 0.0);
        let mut b = a.fork();
        let mut want_b = want_k.clone();
        put(&mut a, &mut want_k, 1, 1.0);
        put(&mut b, &mut want_b, 3, 2.0);
        for (c, want) in [(&a, &want_k), (&b, &want_b)] {
            let got = c.layer_tensor(0, false).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(got, want.concat());
            let stored = c.layer_stored(0, true).unwrap();
            assert_eq!((stored.dtype(), stored.dims()), (Q8_0, &[1, heads, c.len(), 2 * 34][..]));
        }
        // the full first block shared; the second written in place by `a`, copied by `b`
        assert_eq!(KvCache::held_bytes([&a, &b]), 3 * a.layout.bytes_per_block());
    }

    #[test]
    fn growth_keeps_contents_and_stops_at_the_context_length() {
        let mut a = cache();
        for i in 0..200 {
            append(&mut a, 1, i as f32);
        }
        assert_eq!(a.capacity(), 200usize.div_ceil(BLOCK_LEN) * BLOCK_LEN);
        assert_eq!(position_values(&a), (0..200).map(|i| i as f32).collect::<Vec<_>>());
        assert!(matches!(a.reserve(1), Err(Error::Position { offset: 200, limit: 200, .. })));
    }
}
