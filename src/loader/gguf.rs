//! GGUF (llama.cpp) files: metadata to [`ModelConfig`], tensors dequantized and renamed
//! to the Hugging Face layout, with llama.cpp's q/k row permutation undone.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use std::sync::Arc;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};

use super::{arena_for, expected_tensors, kept, gguf_header, Blocks, Progress, TensorSpec, Weights};
use crate::config::ModelConfig;
use crate::error::{message, Error, Result};

/// The file's header, checked as a Llama model's: its metadata and configuration (no
/// tensor data read).
fn llama_header(path: &Path) -> Result<(Content, ModelConfig)> {
    // validated before candle sees anything of the file
    let content = gguf_header::read(path)?;
    let meta = Meta { path, content: &content };
    let arch = meta.string("general.architecture")?;
    if arch != "llama" {
        return Err(Error::load(
            path,
            format!("unsupported architecture {arch:?} (general.architecture); kvcandle runs \"llama\""),
        ));
    }
    let config = meta.config(&arch)?;
    Ok((content, config))
}

/// The tokenizer's and the general metadata keys (the loaded model keeps none of them).
pub(super) fn metadata(path: &Path) -> Result<HashMap<String, Value>> {
    let content = llama_header(path)?.0;
    Ok(content.metadata.into_iter().filter(|(k, _)| k.starts_with("tokenizer.") || k.starts_with("general.")).collect())
}

pub(super) fn load_file(path: &Path, dtype: DType, device: &Device, quantized: bool, progress: Progress<'_>) -> Result<Weights> {
    let (content, mut config) = llama_header(path)?;
    let file = File::open(path).map_err(|e| Error::load(path, e))?;
    let mut reader = BufReader::new(file);
    config.rope_freq_factors = rope_freq_factors(&content, &mut reader, path)?;
    let table = expected_tensors(&config, content.tensor_infos.len(), path)?;
    // every shape is checked before any tensor data is read
    for spec in &table {
        let info = content
            .tensor_infos
            .get(&spec.gguf)
            .ok_or_else(|| Error::load(path, format!("tensor {} ({}) is missing", spec.gguf, spec.name)))?;
        if info.shape.dims() != spec.shape.as_slice() {
            return Err(Error::load(
                path,
                format!("tensor {} ({}) has shape {:?}, expected {:?}", spec.gguf, spec.name, info.shape.dims(), spec.shape),
            ));
        }
    }

    let arena = arena_for(&table, dtype, device, quantized, path)?;
    let mut tensors = HashMap::new();
    let mut qtensors = HashMap::new();
    for (loaded, spec) in table.iter().enumerate() {
        let fail = |e: candle_core::Error| Error::load(path, format!("tensor {}: {}", spec.gguf, message(e)));
        if quantized && spec.linear {
            // kept as stored, read straight into the buffer the engine takes over
            let blocks = read_blocks(&content, &mut reader, spec).map_err(fail)?;
            qtensors.insert(spec.name.clone(), Arc::new(blocks));
        } else {
            let q = content.tensor(&mut reader, &spec.gguf, &Device::Cpu).map_err(fail)?;
            let mut t = q.dequantize(&Device::Cpu).map_err(fail)?;
            drop(q);
            if let Some(heads) = spec.rope_heads {
                t = unpermute(&t, heads).map_err(fail)?;
            }
            let t = t.to_dtype(dtype).and_then(|t| t.to_device(device)).and_then(|t| kept(t, &arena)).map_err(fail)?;
            tensors.insert(spec.name.clone(), t);
        }
        progress(loaded + 1, table.len());
    }

    Ok(Weights { config, tensors, qtensors, source: path.to_path_buf(), format: "gguf", arena })
}

/// llama.cpp's form of Llama 3 RoPE scaling: a divisor per frequency in the tensor
/// `rope_freqs.weight` (the metadata says nothing). Read in full only when it is one row
/// of at most 2^16 numbers; its length is checked against the head dim with the config.
fn rope_freq_factors(content: &Content, reader: &mut BufReader<File>, path: &Path) -> Result<Option<Vec<f32>>> {
    const NAME: &str = "rope_freqs.weight";
    let Some(info) = content.tensor_infos.get(NAME) else { return Ok(None) };
    match info.shape.dims() {
        [n] if *n <= 1 << 16 => {}
        dims => return Err(Error::load(path, format!("tensor {NAME} has shape {dims:?}, expected one row of head_dim / 2 factors"))),
    }
    let fail = |e: candle_core::Error| Error::load(path, format!("tensor {NAME}: {}", message(e)));
    let t = content.tensor(reader, NAME, &Device::Cpu).map_err(fail)?;
    let factors = t.dequantize(&Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).and_then(|t| t.to_vec1::<f32>()).map_err(fail)?;
    Ok(Some(factors))
}

/// llama.cpp's converter reorders the rows of each q/k head from the Hugging Face
/// "rotate half" layout to interleaved pairs. For a head of `d` rows, row `2j + t`
/// holds what Hugging Face keeps at row `t * d/2 + j`. Undo that:
/// (heads, d/2, 2, in) -> (heads, 2, d/2, in).
fn unpermute(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (out, inp) = w.dims2()?;
    if heads == 0 || out % heads != 0 || !(out / heads).is_multiple_of(2) {
        candle_core::bail!("cannot split {out} rows into {heads} heads of even size");
    }
    let half = out / heads / 2;
    w.reshape((heads, half, 2, inp))?.transpose(1, 2)?.contiguous()?.reshape((out, inp))
}

/// A matrix's bytes as the file stores them, with the row reordering of [`unpermute`]
/// undone for q and k: GGUF blocks run along a row, so whole rows (a fixed number of
/// bytes each) move and no value changes. (The header check has made sure the tensor
/// is whole blocks inside the file.)
fn read_blocks(content: &Content, reader: &mut BufReader<File>, spec: &TensorSpec) -> candle_core::Result<Blocks> {
    let info = &content.tensor_infos[&spec.gguf];
    let (rows, cols) = info.shape.dims2()?;
    let bytes = rows * cols / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
    reader.seek(SeekFrom::Start(content.tensor_data_offset + info.offset))?;
    let mut data = vec![0u8; bytes];
    reader.read_exact(&mut data)?;
    if let Some(heads) = spec.rope_heads {
        if heads == 0 || rows % heads != 0 || !(rows / heads).is_multiple_of(2) {
            candle_core::bail!("cannot split {rows} rows into {heads} heads of even size");
        }
        let row = bytes / rows;
        let (d, half) = (rows / heads, rows / heads / 2);
        let mut hf = Vec::with_capacity(bytes);
        for h in 0..heads {
            for t in 0..2 {
                for j in 0..half {
                    // HF row h*d + t*half + j is stored at GGUF row h*d + 2j + t
                    let src = h * d + 2 * j + t;
                    hf.extend_from_slice(&data[src * row..(src + 1) * row]);
                }
            }
        }
        data = hf;
    }
    Ok(Blocks { dtype: info.ggml_dtype, rows, cols, data })
}

struct Meta<'a> {
    path: &'a Path,
    content: &'a Content,
}

impl Meta<'_> {
    fn get(&self, key: &str) -> Result<&Value> {
        self.content
            .metadata
            .get(key)
            .ok_or_else(|| Error::load(self.path, format!("metadata key {key} is missing")))
    }

    fn string(&self, key: &str) -> Result<String> {
        match self.get(key)? {
            Value::String(s) => Ok(s.clone()),
            other => Err(Error::load(self.path, format!("metadata {key} should be a string, got {other:?}"))),
        }
    }

    fn uint(&self, key: &str) -> Result<usize> {
        let v = self.get(key)?;
        let n = match v {
            Value::U8(x) => Some(*x as u64),
            Value::U16(x) => Some(*x as u64),
            Value::U32(x) => Some(*x as u64),
            Value::U64(x) => Some(*x),
            Value::I8(x) => u64::try_from(*x).ok(),
            Value::I16(x) => u64::try_from(*x).ok(),
            Value::I32(x) => u64::try_from(*x).ok(),
            Value::I64(x) => u64::try_from(*x).ok(),
            _ => None,
        };
        n.and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| Error::load(self.path, format!("metadata {key} should be a non-negative integer, got {v:?}")))
    }

    fn float(&self, key: &str) -> Result<f64> {
        match self.get(key)? {
            Value::F32(x) => Ok(*x as f64),
            Value::F64(x) => Ok(*x),
            other => Err(Error::load(self.path, format!("metadata {key} should be a float, got {other:?}"))),
        }
    }

    fn opt<T>(&self, key: &str, f: impl Fn(&Self, &str) -> Result<T>) -> Result<Option<T>> {
        if self.content.metadata.contains_key(key) {
            f(self, key).map(Some)
        } else {
            Ok(None)
        }
    }

    fn tensor_dims(&self, name: &str) -> Option<&[usize]> {
        self.content.tensor_infos.get(name).map(|t| t.shape.dims())
    }

    fn config(&self, arch: &str) -> Result<ModelConfig> {
        let k = |s: &str| format!("{arch}.{s}");
        let hidden_size = self.uint(&k("embedding_length"))?;
        let num_attention_heads = self.uint(&k("attention.head_count"))?;
        let num_key_value_heads =
            self.opt(&k("attention.head_count_kv"), Self::uint)?.unwrap_or(num_attention_heads);
        let head_dim = match self.opt(&k("attention.key_length"), Self::uint)? {
            Some(d) => d,
            None => match self.opt(&k("rope.dimension_count"), Self::uint)? {
                Some(d) => d,
                None if num_attention_heads > 0 => hidden_size / num_attention_heads,
                None => 0,
            },
        };
        let vocab_size = match self.opt(&k("vocab_size"), Self::uint)? {
            Some(v) => v,
            None => match self.tensor_dims("token_embd.weight") {
                Some([v, _]) => *v,
                _ => return Err(Error::load(self.path, "cannot tell the vocabulary size: no llama.vocab_size and no 2-D token_embd.weight")),
            },
        };
        let token_id = |key: &str| -> Result<Option<u32>> {
            Ok(self.opt(key, Self::uint)?.and_then(|v| u32::try_from(v).ok()))
        };
        if self.content.metadata.contains_key(&k("rope.scaling.type")) {
            let kind = self.string(&k("rope.scaling.type"))?;
            if kind != "none" {
                return Err(Error::load(self.path, format!("unsupported RoPE scaling {kind:?} ({arch}.rope.scaling.type)")));
            }
        }
        Ok(ModelConfig {
            vocab_size,
            hidden_size,
            intermediate_size: self.uint(&k("feed_forward_length"))?,
            num_hidden_layers: self.uint(&k("block_count"))?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rope_theta: self.opt(&k("rope.freq_base"), Self::float)?.unwrap_or(10_000.0) as f32,
            rms_norm_eps: self.float(&k("attention.layer_norm_rms_epsilon"))?,
            max_position_embeddings: self.uint(&k("context_length"))?,
            tie_word_embeddings: !self.content.tensor_infos.contains_key("output.weight"),
            bos_token_id: token_id("tokenizer.ggml.bos_token_id")?,
            eos_token_ids: token_id("tokenizer.ggml.eos_token_id")?.into_iter().collect(),
            rope_scaling: None,
            rope_freq_factors: None,
        })
    }
}
