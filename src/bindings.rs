//! PyO3 wrappers: `kvcandle._core`. Inputs are converted first, then the engine runs
//! with the GIL released. Engine errors become the exception classes defined in
//! `kvcandle/errors.py` (Python classes, so they can also subclass IndexError etc).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use candle_core::quantized::gguf_file::Value;
use half::f16;
use numpy::{PyArray1, PyArrayMethods, PyUntypedArray};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::pyclass::boolean_struct::False;
use pyo3::PyClass;
use pyo3::types::{PyDict, PyInt, PyList, PyType};

use crate::model::cache::KvCache;
use crate::model::cache_file;
use crate::device::{compiled_devices, dtype_name, parse_cache_dtype, parse_device, parse_dtype};
use crate::error::{no_panic, one_line, Error};
use crate::loader::{self, Weights};
use crate::model::Llama;
use crate::sentencepiece::SentencePiece;
use crate::upstream::{UpstreamCache, UpstreamLlama};

fn error_class(e: &Error) -> &'static str {
    match e {
        Error::NotFound { .. } => "ModelNotFoundError",
        Error::Load { .. } => "ModelLoadError",
        Error::Device(_) => "DeviceError",
        Error::DType(_) => "DTypeError",
        Error::Position { .. } => "PositionError",
        Error::TokenId { .. } => "TokenIdError",
        Error::Input(_) => "InputError",
        Error::Cache(_) => "CacheError",
        Error::CacheFile { .. } => "CacheFileError",
        Error::Engine(_) => "EngineError",
        Error::Sequence { inner, .. } => error_class(inner),
    }
}

fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let message = one_line(&e.to_string());
    let class = py
        .import("kvcandle.errors")
        .and_then(|m| m.getattr(error_class(&e)))
        .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
    match class {
        Ok(class) => PyErr::from_type(class, message),
        Err(_) => PyRuntimeError::new_err(message),
    }
}

trait IntoPy<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPy<T> for crate::error::Result<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

/// A tensor as a numpy array of the same shape (float32, or float16 for half caches).
fn to_numpy<'py>(py: Python<'py>, t: Tensor) -> PyResult<Bound<'py, PyUntypedArray>> {
    let dims = t.dims().to_vec();
    let flat = t.flatten_all().map_err(|e| to_py(py, e.into()))?;
    let array = match flat.dtype() {
        DType::F16 => {
            let v = py.detach(|| flat.to_vec1::<f16>()).map_err(|e| to_py(py, e.into()))?;
            PyArray1::from_vec(py, v).reshape(dims)?.into_any()
        }
        _ => {
            let v = py
                .detach(|| flat.to_dtype(DType::F32).and_then(|t| t.to_vec1::<f32>()))
                .map_err(|e| to_py(py, e.into()))?;
            PyArray1::from_vec(py, v).reshape(dims)?.into_any()
        }
    };
    array.cast_into::<PyUntypedArray>().map_err(PyErr::from)
}

fn gguf_value<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::U8(x) => x.into_pyobject(py)?.into_any(),
        Value::I8(x) => x.into_pyobject(py)?.into_any(),
        Value::U16(x) => x.into_pyobject(py)?.into_any(),
        Value::I16(x) => x.into_pyobject(py)?.into_any(),
        Value::U32(x) => x.into_pyobject(py)?.into_any(),
        Value::I32(x) => x.into_pyobject(py)?.into_any(),
        Value::U64(x) => x.into_pyobject(py)?.into_any(),
        Value::I64(x) => x.into_pyobject(py)?.into_any(),
        Value::F32(x) => x.into_pyobject(py)?.into_any(),
        Value::F64(x) => x.into_pyobject(py)?.into_any(),
        Value::Bool(x) => x.into_pyobject(py)?.to_owned().into_any(),
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(gguf_value(py, item)?)?;
            }
            list.into_any()
        }
    })
}

/// An int argument as an i64, or (Err) the number as written when it fits no i64: such a
/// number is out of every valid range, and the caller says so in its own terms. Anything
/// but an int raises TypeError.
fn int_arg(n: &Bound<'_, PyAny>) -> PyResult<Result<i64, String>> {
    match n.extract::<i64>() {
        Ok(v) => Ok(Ok(v)),
        Err(_) if n.is_instance_of::<PyInt>() => Ok(Err(n.str()?.to_string())),
        Err(e) => Err(e),
    }
}

/// Token ids from a Python list of ints. An int that fits no i64 is outside every
/// vocabulary: a TokenIdError naming it, as for any other id out of range.
fn id_list(ids: &Bound<'_, PyAny>, vocab: usize) -> PyResult<Vec<i64>> {
    if let Ok(v) = ids.extract::<Vec<i64>>() {
        return Ok(v);
    }
    let items: Vec<Bound<'_, PyAny>> = ids.extract()?;
    let mut out = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        match int_arg(item)? {
            Ok(id) => out.push(id),
            Err(id) => return Err(to_py(ids.py(), Error::TokenId { id, index, vocab })),
        }
    }
    Ok(out)
}

/// A loaded model running on the native engine.
#[pyclass(frozen, module = "kvcandle._core")]
struct Model {
    inner: Arc<Llama>,
    /// What is left of the loaded weights once the engine took the tensors: config,
    /// source and format.
    weights: Arc<Weights>,
    device_name: String,
    num_parameters: usize,
}

#[pymethods]
impl Model {
    /// `progress(done, total)` is called as tensors load.
    #[staticmethod]
    #[pyo3(signature = (path, dtype, device, progress=None, quantized=false))]
    fn load(
        py: Python<'_>,
        path: PathBuf,
        dtype: &str,
        device: &str,
        progress: Option<Py<PyAny>>,
        quantized: bool,
    ) -> PyResult<Self> {
        let dev = parse_device(device).py_err(py)?;
        let dt = parse_dtype(dtype, &dev).py_err(py)?;
        crate::kernels::matvec::check_env().map_err(Error::Device).py_err(py)?;
        let report = |done: usize, total: usize| {
            if let Some(callback) = &progress {
                // A failing callback must not fail the load; its error is dropped.
                Python::attach(|py| {
                    let _ = callback.call1(py, (done, total));
                });
            }
        };
        let (weights, model, num_parameters) = py
            .detach(|| -> crate::Result<(Weights, Llama, usize)> {
                no_panic(|| {
                    let w = loader::load_with_progress(&path, dt, &dev, quantized, &report)?;
                    let n = parameters(&w);
                    // the engine takes the tensors: stacked or repacked ones are released as
                    // it goes, so one copy of the weights is held
                    let (m, rest) = Llama::from_weights(w)?;
                    release_freed_memory();
                    Ok((rest, m, n))
                })
            })
            .py_err(py)?;
        Ok(Self { inner: Arc::new(model), weights: Arc::new(weights), device_name: device.to_string(), num_parameters })
    }

    /// The architecture numbers as a dict.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.config();
        let d = PyDict::new(py);
        d.set_item("vocab_size", c.vocab_size)?;
        d.set_item("hidden_size", c.hidden_size)?;
        d.set_item("intermediate_size", c.intermediate_size)?;
        d.set_item("num_hidden_layers", c.num_hidden_layers)?;
        d.set_item("num_attention_heads", c.num_attention_heads)?;
        d.set_item("num_key_value_heads", c.num_key_value_heads)?;
        d.set_item("head_dim", c.head_dim)?;
        d.set_item("rope_theta", c.rope_theta)?;
        d.set_item("rms_norm_eps", c.rms_norm_eps)?;
        d.set_item("max_position_embeddings", c.max_position_embeddings)?;
        d.set_item("tie_word_embeddings", c.tie_word_embeddings)?;
        d.set_item("bos_token_id", c.bos_token_id)?;
        d.set_item("eos_token_ids", c.eos_token_ids.clone())?;
        Ok(d)
    }

    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.inner.dtype())
    }

    /// The dtype `new_cache()` stores keys and values in.
    #[getter]
    fn default_cache_dtype(&self) -> &'static str {
        dtype_name(self.inner.default_cache_dtype())
    }

    #[getter]
    fn device(&self) -> &str {
        &self.device_name
    }

    /// Whether the linear layers run on the GGUF file's quantized blocks.
    #[getter]
    fn quantized(&self) -> bool {
        self.inner.is_quantized()
    }

    #[getter]
    fn format(&self) -> &'static str {
        self.weights.format
    }

    #[getter]
    fn source(&self) -> PathBuf {
        self.weights.source.clone()
    }

    /// Number of weights (tied embeddings counted once).
    #[getter]
    fn num_parameters(&self) -> usize {
        self.num_parameters
    }

    /// Bytes of the weights the engine holds.
    #[getter]
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }

    /// An empty cache; `dtype` (a name) stores its keys and values in another type than
    /// the model's (float16 or q8_0 for a float32 CPU model).
    #[pyo3(signature = (dtype=None))]
    fn new_cache(&self, py: Python<'_>, dtype: Option<&str>) -> PyResult<KVCache> {
        let inner = match dtype {
            None => self.inner.new_cache(),
            Some(name) => {
                let dt = parse_cache_dtype(name, self.inner.device()).py_err(py)?;
                self.inner.new_cache_with(dt).py_err(py)?
            }
        };
        Ok(KVCache { inner })
    }

    /// Runs `ids` after the cache's tokens, appends them, returns float32 logits.
    fn forward<'py>(
        &self,
        py: Python<'py>,
        ids: &Bound<'py, PyAny>,
        cache: &Bound<'py, KVCache>,
        all_logits: bool,
    ) -> PyResult<Bound<'py, PyUntypedArray>> {
        let ids = id_list(ids, self.inner.config().vocab_size)?;
        let mut guard = write(cache)?;
        let cache: &mut KvCache = &mut guard.inner;
        let model = &self.inner;
        let logits = py.detach(|| no_panic(|| model.forward(&ids, cache, all_logits))).py_err(py)?;
        to_numpy(py, logits)
    }

    /// Runs each sequence's ids after its cache's tokens in one call (decode rows in one
    /// step); returns one float32 logits array per sequence.
    fn forward_batch<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<Bound<'py, PyAny>>,
        caches: Vec<Bound<'py, KVCache>>,
        all_logits: bool,
    ) -> PyResult<Vec<Bound<'py, PyUntypedArray>>> {
        let vocab = self.inner.config().vocab_size;
        // an error of sequence b, of the kind a forward of it alone raises, names it
        let named = |b: usize, e: PyErr| PyErr::from_type(e.get_type(py), format!("sequence {b}: {}", e.value(py)));
        let ids = ids.iter().enumerate().map(|(b, ids)| id_list(ids, vocab).map_err(|e| named(b, e))).collect::<PyResult<Vec<_>>>()?;
        for (b, cache) in caches.iter().enumerate() {
            if let Some(first) = caches[..b].iter().position(|c| c.is(cache)) {
                return Err(to_py(py, Error::Cache(format!("sequence {b} has the same cache as sequence {first}: each sequence needs its own (fork one)"))));
            }
        }
        let mut guards = caches.iter().enumerate().map(|(b, c)| write(c).map_err(|e| named(b, e))).collect::<PyResult<Vec<_>>>()?;
        let mut inner: Vec<&mut KvCache> = guards.iter_mut().map(|g| &mut g.inner).collect();
        let model = &self.inner;
        let logits = py.detach(|| no_panic(|| model.forward_batch(&ids, &mut inner, all_logits))).py_err(py)?;
        logits.into_iter().map(|t| to_numpy(py, t)).collect()
    }

    /// Checks, without running or changing anything, that `ids` as a whole sequence could
    /// be held by `cache`: the cache is this model's, every id is in the vocabulary and
    /// the sequence fits the context length. Callers that will crop the cache to a
    /// common prefix check first, so a refused call leaves the cache as it was.
    fn check_sequence(&self, ids: &Bound<'_, PyAny>, cache: &Bound<'_, KVCache>) -> PyResult<()> {
        let ids = id_list(ids, self.inner.config().vocab_size)?;
        let guard = read(cache)?;
        self.inner.check_sequence(&ids, &guard.inner).map(drop).py_err(cache.py())
    }

    /// Reads a cache file saved from this model; every (key, value) of `expected` (the
    /// model's fingerprint) must match the file's metadata.
    fn load_cache(&self, py: Python<'_>, path: PathBuf, expected: HashMap<String, String>) -> PyResult<(KVCache, HashMap<String, String>)> {
        let model = &self.inner;
        let (inner, metadata) = py.detach(|| no_panic(|| cache_file::load(&path, model, &expected))).py_err(py)?;
        Ok((KVCache { inner }, metadata))
    }

    /// candle-transformers' own Llama built from the same weights (shared, not copied).
    fn upstream(&self, py: Python<'_>) -> PyResult<UpstreamModel> {
        if self.inner.is_quantized() {
            return Err(to_py(py, Error::Input(UpstreamLlama::QUANTIZED.into())));
        }
        let (rest, engine) = (&self.weights, &self.inner);
        let model = py
            .detach(|| {
                no_panic(|| {
                    // candle's Llama loads the engine's own tensors (q/k/v and gate/up as
                    // views into their stacks): nothing is copied
                    let tensors = engine.hf_tensors().ok_or_else(|| Error::Input(UpstreamLlama::QUANTIZED.into()))?;
                    let w = Weights {
                        config: rest.config.clone(),
                        tensors,
                        qtensors: Default::default(),
                        source: rest.source.clone(),
                        format: rest.format,
                        arena: None,
                    };
                    UpstreamLlama::new(&w)
                })
            })
            .py_err(py)?;
        Ok(UpstreamModel { inner: Arc::new(model) })
    }
}

/// The native engine's KV cache.
#[pyclass(module = "kvcandle._core")]
struct KVCache {
    inner: KvCache,
}

const CACHE_BUSY: &str = "the cache is in use by another call (a cache runs one forward at a time)";

/// A cache is borrowed mutably for the whole of a `forward` (with the GIL released), so
/// another thread touching it meanwhile finds it borrowed: a CacheError, never PyO3's
/// generic "Already borrowed" RuntimeError.
fn busy(py: Python<'_>) -> PyErr {
    to_py(py, Error::Cache(CACHE_BUSY.into()))
}

fn read<'py, T: PyClass>(cache: &Bound<'py, T>) -> PyResult<PyRef<'py, T>> {
    cache.try_borrow().map_err(|_| busy(cache.py()))
}

fn write<'py, T: PyClass<Frozen = False>>(cache: &Bound<'py, T>) -> PyResult<PyRefMut<'py, T>> {
    cache.try_borrow_mut().map_err(|_| busy(cache.py()))
}

#[pymethods]
impl KVCache {
    fn __len__(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(read(slf)?.inner.len())
    }

    #[getter]
    fn max_length(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(read(slf)?.inner.max_len())
    }

    #[getter]
    fn tokens(slf: &Bound<'_, Self>) -> PyResult<Vec<u32>> {
        Ok(read(slf)?.inner.tokens().to_vec())
    }

    #[getter]
    fn nbytes(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(read(slf)?.inner.nbytes())
    }

    #[getter]
    fn capacity(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(read(slf)?.inner.capacity())
    }

    /// The type keys and values are stored in ("float32", "float16", ...).
    #[getter]
    fn dtype(slf: &Bound<'_, Self>) -> PyResult<&'static str> {
        Ok(dtype_name(read(slf)?.inner.layout().dtype))
    }

    #[getter]
    fn num_layers(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(read(slf)?.inner.layout().num_layers)
    }

    #[getter]
    fn bytes_per_token(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(read(slf)?.inner.layout().bytes_per_token())
    }

    #[getter]
    fn is_shared(slf: &Bound<'_, Self>) -> PyResult<bool> {
        Ok(read(slf)?.inner.is_shared())
    }

    fn reset(slf: &Bound<'_, Self>) -> PyResult<()> {
        write(slf)?.inner.reset();
        Ok(())
    }

    /// Keeps the first n positions. Returns how many were dropped.
    fn crop(slf: &Bound<'_, Self>, n: &Bound<'_, PyAny>) -> PyResult<usize> {
        shorten(slf, n, false)
    }

    /// Drops the last n positions. Returns how many were dropped (n).
    fn trim(slf: &Bound<'_, Self>, n: &Bound<'_, PyAny>) -> PyResult<usize> {
        shorten(slf, n, true)
    }

    fn fork(slf: &Bound<'_, Self>) -> PyResult<KVCache> {
        Ok(KVCache { inner: read(slf)?.inner.fork() })
    }

    /// Writes the cache to `path` atomically, with `metadata` (the model's fingerprint).
    fn save(slf: &Bound<'_, Self>, path: PathBuf, metadata: HashMap<String, String>) -> PyResult<()> {
        let guard = read(slf)?;
        let cache = &guard.inner;
        slf.py().detach(|| no_panic(|| cache_file::save(cache, &path, &metadata))).py_err(slf.py())
    }

    fn keys<'py>(slf: &Bound<'py, Self>, layer: usize) -> PyResult<Bound<'py, PyUntypedArray>> {
        let guard = read(slf)?;
        let t = no_panic(|| guard.inner.layer_tensor(layer, false)).py_err(slf.py())?;
        to_numpy(slf.py(), t)
    }

    fn values<'py>(slf: &Bound<'py, Self>, layer: usize) -> PyResult<Bound<'py, PyUntypedArray>> {
        let guard = read(slf)?;
        let t = no_panic(|| guard.inner.layer_tensor(layer, true)).py_err(slf.py())?;
        to_numpy(slf.py(), t)
    }
}

/// Hands the heap memory freed while loading (the loader's buffers, the Python lists the
/// tokenizer was built from) back to the system: glibc keeps freed heap pages otherwise,
/// and they stay resident (7 MB of the default model's load).
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::os::raw::c_int;
        }
        // SAFETY: glibc's malloc_trim only returns free heap pages to the system
        unsafe {
            malloc_trim(0);
        }
    }
}

/// Number of weights (tied embeddings counted once).
fn parameters(w: &Weights) -> usize {
    let float: usize = w.tensors.values().map(|t| t.elem_count()).sum();
    let quantized: usize = w.qtensors.iter().filter(|(name, _)| !w.tensors.contains_key(*name)).map(|(_, q)| q.rows * q.cols).sum();
    float + quantized
}

/// `crop(n)` or (`trim`) `trim(n)`; an int no i64 holds is out of range like any other.
fn shorten(slf: &Bound<'_, KVCache>, n: &Bound<'_, PyAny>, trim: bool) -> PyResult<usize> {
    let mut guard = write(slf)?;
    let cache = &mut guard.inner;
    let result = match int_arg(n)? {
        Ok(n) if trim => cache.trim(n),
        Ok(n) => cache.crop(n),
        Err(written) => Err(cache.count_error(trim, &written)),
    };
    result.py_err(slf.py())
}

/// candle-transformers' `Llama`, as shipped.
#[pyclass(frozen, module = "kvcandle._core")]
struct UpstreamModel {
    inner: Arc<UpstreamLlama>,
}

#[pymethods]
impl UpstreamModel {
    #[staticmethod]
    fn load(py: Python<'_>, path: PathBuf, dtype: &str, device: &str) -> PyResult<Self> {
        let dev = parse_device(device).py_err(py)?;
        let dt = parse_dtype(dtype, &dev).py_err(py)?;
        let model = py
            .detach(|| no_panic(|| loader::load(&path, dt, &dev).and_then(|w| UpstreamLlama::new(&w))))
            .py_err(py)?;
        Ok(Self { inner: Arc::new(model) })
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    #[getter]
    fn max_length(&self) -> usize {
        self.inner.max_length()
    }

    fn new_cache(&self, py: Python<'_>, use_kv_cache: bool) -> PyResult<UpstreamKVCache> {
        Ok(UpstreamKVCache { inner: no_panic(|| self.inner.new_cache(use_kv_cache)).py_err(py)? })
    }

    fn forward<'py>(
        &self,
        py: Python<'py>,
        ids: &Bound<'py, PyAny>,
        index_pos: usize,
        cache: &Bound<'py, UpstreamKVCache>,
    ) -> PyResult<Bound<'py, PyUntypedArray>> {
        let ids = id_list(ids, self.inner.vocab_size())?;
        let mut guard = write(cache)?;
        let cache: &mut UpstreamCache = &mut guard.inner;
        let model = &self.inner;
        let logits = py.detach(|| no_panic(|| model.forward(&ids, index_pos, cache))).py_err(py)?;
        to_numpy(py, logits)
    }
}

/// candle-transformers' `Cache`, as shipped.
#[pyclass(module = "kvcandle._core")]
struct UpstreamKVCache {
    inner: UpstreamCache,
}

#[pymethods]
impl UpstreamKVCache {
    #[getter]
    fn use_kv_cache(slf: &Bound<'_, Self>) -> PyResult<bool> {
        Ok(read(slf)?.inner.use_kv_cache())
    }

    fn clone(slf: &Bound<'_, Self>) -> PyResult<UpstreamKVCache> {
        Ok(UpstreamKVCache { inner: read(slf)?.inner.clone_cache() })
    }
}

/// candle asks for its thread count before every CPU matmul, and without
/// RAYON_NUM_THREADS that means parsing /proc/cpuinfo each time (num_cpus::get_physical):
/// about 8% of a decode step. Pin the variable once, at import, to the same value.
fn pin_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", num_cpus::get_physical().max(1).to_string());
    }
}

/// The `tokenizer.*` and `general.*` metadata of a GGUF file holding a Llama model, read
/// from its header alone (the tokenizer is built from it before the weights load).
#[pyfunction]
fn read_gguf_metadata<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let metadata = py.detach(|| no_panic(|| loader::gguf_metadata(&path))).py_err(py)?;
    let d = PyDict::new(py);
    for (k, v) in &metadata {
        d.set_item(k, gguf_value(py, v)?)?;
    }
    Ok(d)
}

/// A SentencePiece BPE vocabulary ("llama" GGUF tokenizers), encoded and decoded as
/// SentencePiece does (`crate::sentencepiece`).
#[pyclass(frozen, module = "kvcandle._core", name = "SentencePiece")]
struct PySentencePiece(SentencePiece);

#[pymethods]
impl PySentencePiece {
    #[new]
    fn new(py: Python<'_>, tokens: Vec<String>, types: Vec<i64>, scores: Vec<f32>, add_dummy_prefix: bool) -> PyResult<Self> {
        py.detach(|| no_panic(|| SentencePiece::new(tokens, &types, &scores, add_dummy_prefix))).py_err(py).map(PySentencePiece)
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }

    fn encode(&self, py: Python<'_>, text: &str, parse_special: bool) -> PyResult<Vec<u32>> {
        py.detach(|| no_panic(|| Ok(self.0.encode(text, parse_special)))).py_err(py)
    }

    fn decode(&self, py: Python<'_>, ids: Vec<u32>, skip_special: bool, continuation: bool) -> PyResult<String> {
        py.detach(|| no_panic(|| self.0.decode(&ids, skip_special, continuation))).py_err(py)
    }

    fn id_to_piece(&self, id: u32) -> Option<String> {
        self.0.id_to_piece(id).map(str::to_string)
    }

    fn piece_to_id(&self, piece: &str) -> Option<u32> {
        self.0.piece_to_id(piece)
    }
}

/// The SIMD level kvcandle's own kernels run at (`avx512`, `avx2` or `portable`): the
/// best this CPU runs, or the one `KVCANDLE_SIMD` forces.
#[pyfunction]
fn simd_level(py: Python<'_>) -> PyResult<&'static str> {
    crate::kernels::matvec::check_env().map_err(Error::Device).py_err(py)?;
    Ok(crate::kernels::matvec::kernel().short_name())
}

/// Where the float32 kernels' software prefetches put the weights and which passes ask
/// (`l1`, `l2`, `l2-batch` or `l1+l2`): the CPU's default, or the one `KVCANDLE_PREFETCH`
/// sets.
#[pyfunction]
fn prefetch_level(py: Python<'_>) -> PyResult<&'static str> {
    crate::kernels::matvec::check_env().map_err(Error::Device).py_err(py)?;
    Ok(crate::kernels::matvec::prefetch().short_name())
}

/// How many weight rows a float32 product of one input reads side by side (1 or 8): 1,
/// or the number `KVCANDLE_ROWS` sets.
#[pyfunction]
fn one_input_rows(py: Python<'_>) -> PyResult<usize> {
    crate::kernels::matvec::check_env().map_err(Error::Device).py_err(py)?;
    Ok(crate::kernels::matvec::one_input_rows())
}

/// The SIMD levels this CPU runs, the best last.
#[pyfunction]
fn simd_levels() -> Vec<&'static str> {
    crate::kernels::matvec::Kernel::available().into_iter().map(|k| k.short_name()).collect()
}

/// Bytes of the blocks `caches` refer to together, each block counted once.
#[pyfunction]
fn held_bytes(caches: Vec<Bound<'_, KVCache>>) -> PyResult<usize> {
    let guards = caches.iter().map(read).collect::<PyResult<Vec<_>>>()?;
    Ok(KvCache::held_bytes(guards.iter().map(|g| &g.inner)))
}

/// Removes the temporary files a killed save left in `directory` for target files whose
/// names start with `prefix` (their processes no longer run); returns how many.
#[pyfunction]
fn remove_stale_temporaries(py: Python<'_>, directory: PathBuf, prefix: &str) -> usize {
    py.detach(|| cache_file::remove_stale_temporaries(&directory, |target| target.starts_with(prefix)))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    pin_thread_count();
    // numpy's C API loaded now: loaded lazily by the first array made, it ran an import at
    // the end of the first forward, where a Ctrl-C that arrived during the forward was
    // raised inside rust-numpy, which panics on it
    m.py().import("numpy")?;
    let _ = PyArray1::<f32>::zeros(m.py(), 0, false);
    m.add_class::<Model>()?;
    m.add_function(wrap_pyfunction!(read_gguf_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(held_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(remove_stale_temporaries, m)?)?;
    m.add_function(wrap_pyfunction!(simd_level, m)?)?;
    m.add_function(wrap_pyfunction!(simd_levels, m)?)?;
    m.add_function(wrap_pyfunction!(prefetch_level, m)?)?;
    m.add_function(wrap_pyfunction!(one_input_rows, m)?)?;
    m.add("SIMD_ENV", crate::kernels::matvec::SIMD_ENV)?;
    m.add("PREFETCH_ENV", crate::kernels::matvec::PREFETCH_ENV)?;
    m.add("ROWS_ENV", crate::kernels::matvec::ROWS_ENV)?;
    m.add("BLOCK_LEN", crate::model::cache::BLOCK_LEN)?;
    m.add("SMALL_CHUNK", crate::model::SMALL_CHUNK)?;
    m.add("PREFILL_CHUNK", crate::model::PREFILL_CHUNK)?;
    m.add("PREFILL_ROWS", crate::model::PREFILL_ROWS)?;
    m.add_class::<KVCache>()?;
    m.add_class::<UpstreamModel>()?;
    m.add_class::<UpstreamKVCache>()?;
    m.add_class::<PySentencePiece>()?;
    m.add("compiled_devices", compiled_devices())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
