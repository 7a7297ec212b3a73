//! A checked reader of GGUF headers. candle's reader trusts the file's numbers (a tensor
//! whose dimensions multiply past 2^64 wraps round to a plausible size; duplicate keys
//! and tensor names silently replace each other; ranges may overlap), so kvcandle reads
//! the header itself, validates every number against the file, and only then hands
//! candle a [`Content`] to read tensor data from.
//!
//! Checked here, each failure naming the key or tensor: magic and version (2 or 3);
//! every count, string and array length against the bytes left in the file; memory for
//! the metadata bounded by a multiple of the file size; no duplicate keys or tensor
//! names; `general.alignment` a non-zero power of two; every tensor with 1 to 4 positive
//! dimensions whose product and byte size are computed without overflow, rows of whole
//! quantization blocks, a known type, an aligned offset, its bytes inside the data
//! section, and the tensors packed in order with no gap or overlap (as llama.cpp requires).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};
use candle_core::quantized::GgmlDType;

use crate::error::{Error, Result};

const MAGIC: u32 = 0x4655_4747; // "GGUF" read as a little-endian u32
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
const MAX_DIMS: u32 = 4;
/// Arrays inside arrays are allowed this deep (real files use none).
const MAX_NESTING: usize = 2;
/// Bytes of metadata held in memory may reach this multiple of the file size, plus
/// [`METADATA_SLACK`]: a `Value` is larger than its encoding (32 bytes for a 1-byte u8).
const METADATA_MEMORY_FACTOR: u64 = 4;
const METADATA_SLACK: u64 = 64 << 20;

/// The GGUF type ids ggml defines and candle can hold.
fn ggml_dtype(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// The names of the GGUF type ids ggml defines that candle cannot hold (the i-quants,
/// the ternary types, MXFP4, integers, float64): a file of one is valid, and kvcandle
/// says it does not read that type rather than that the file is broken.
fn unread_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return None,
    })
}

/// Reads and validates the header of the GGUF file at `path`.
pub(super) fn read(path: &Path) -> Result<Content> {
    let file = File::open(path).map_err(|e| Error::load(path, e))?;
    let len = file.metadata().map_err(|e| Error::load(path, e))?.len();
    let mut r = Reader { inner: BufReader::new(file), pos: 0, len, memory: 0, unread_type: false };
    let content = r.content();
    content.map_err(|reason| match r.unread_type {
        true => Error::load(path, reason),
        false => Error::load(path, format!("not a valid GGUF file: {reason}")),
    })
}

struct Reader {
    inner: BufReader<File>,
    pos: u64,
    len: u64,
    /// Whether the header was given up at a tensor of a type ggml defines and kvcandle
    /// does not read (the file may be valid).
    unread_type: bool,
    /// Bytes of metadata held in memory so far (estimated from the values' sizes).
    memory: u64,
}

type Check<T> = std::result::Result<T, String>;

impl Reader {
    fn remaining(&self) -> u64 {
        self.len - self.pos
    }

    fn bytes(&mut self, n: u64, what: &dyn Fn() -> String) -> Check<Vec<u8>> {
        if n > self.remaining() {
            return Err(format!("{} needs {n} bytes at offset {}, but the file ends after {}", what(), self.pos, self.remaining()));
        }
        let mut buf = vec![0u8; n as usize];
        self.inner.read_exact(&mut buf).map_err(|e| format!("{}: {e}", what()))?;
        self.pos += n;
        Ok(buf)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Check<[u8; N]> {
        let v = self.bytes(N as u64, what)?;
        Ok(v.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Check<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Check<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Check<Vec<u8>> {
        let n = self.u64(what)?;
        let s = self.bytes(n, what)?; // bounded by the file before anything is allocated
        self.use_memory(n, what)?;
        Ok(s)
    }

    /// Counts `n` bytes of memory against the budget.
    fn use_memory(&mut self, n: u64, what: &dyn Fn() -> String) -> Check<()> {
        self.memory = self.memory.saturating_add(n);
        let limit = self.len.saturating_mul(METADATA_MEMORY_FACTOR).saturating_add(METADATA_SLACK);
        if self.memory > limit {
            return Err(format!(
                "{} would take the metadata past {limit} bytes of memory, more than a {}-byte file justifies",
                what(),
                self.len
            ));
        }
        Ok(())
    }

    fn content(&mut self) -> Check<Content> {
        let header = || "the header".to_string();
        let magic = self.u32(&header)?;
        if magic != MAGIC {
            return Err(format!("the file starts with 0x{magic:08x}, not the GGUF magic 0x{MAGIC:08x}"));
        }
        let version = self.u32(&header)?;
        let magic = match version {
            2 => VersionedMagic::GgufV2,
            3 => VersionedMagic::GgufV3,
            1 => return Err("GGUF version 1 is not supported (re-convert the model with a current llama.cpp)".into()),
            v if v.swap_bytes() <= 3 => return Err("a big-endian GGUF file; kvcandle reads little-endian files".into()),
            v => return Err(format!("unknown GGUF version {v}")),
        };
        let tensor_count = self.u64(&header)?;
        let kv_count = self.u64(&header)?;
        // each metadata entry takes at least 8 + 4 + 1 bytes, each tensor info 8 + 4 + 8 + 4 + 8
        let least = kv_count.checked_mul(13).and_then(|a| tensor_count.checked_mul(32).and_then(|b| a.checked_add(b)));
        if least.is_none_or(|n| n > self.remaining()) {
            return Err(format!(
                "the header declares {kv_count} metadata entries and {tensor_count} tensors, more than the {} bytes left in the file can hold",
                self.remaining()
            ));
        }

        let mut metadata = HashMap::new();
        for i in 0..kv_count {
            let key = self.string(&|| format!("metadata key #{i}"))?;
            let key = String::from_utf8(key).map_err(|_| format!("metadata key #{i} is not valid UTF-8"))?;
            let what = || format!("metadata {key}");
            let kind = self.u32(&what)?;
            let value = self.value(kind, 0, &what)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(format!("metadata key {key} appears twice"));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) if a.is_power_of_two() => u64::from(*a),
            Some(other) => return Err(format!("general.alignment must be a power of two (u32), got {other:?}")),
        };

        let mut infos: Vec<(String, GgmlDType, Vec<usize>, u64, u64)> = Vec::new();
        for i in 0..tensor_count {
            let name = self.string(&|| format!("tensor #{i}'s name"))?;
            let name = String::from_utf8(name).map_err(|_| format!("tensor #{i}'s name is not valid UTF-8"))?;
            let what = || format!("tensor {name}");
            let n_dims = self.u32(&what)?;
            if !(1..=MAX_DIMS).contains(&n_dims) {
                return Err(format!("tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)"));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(self.u64(&what)?);
            }
            let type_id = self.u32(&what)?;
            let offset = self.u64(&what)?;
            let Some(dtype) = ggml_dtype(type_id) else {
                return Err(match unread_type_name(type_id) {
                    Some(kind) => {
                        self.unread_type = true;
                        format!("tensor {name} is {kind} (GGUF type {type_id}), a type kvcandle does not read (it reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K to Q6_K)")
                    }
                    None => format!("tensor {name} has unknown type id {type_id}"),
                });
            };
            let bytes = tensor_bytes(&dims, dtype).map_err(|reason| format!("tensor {name} {reason}"))?;
            if offset % alignment != 0 {
                return Err(format!("tensor {name}'s offset {offset} is not a multiple of the alignment {alignment}"));
            }
            // GGUF lists the fastest-varying dimension first; candle's shapes are row-major
            let shape = dims.iter().rev().map(|&d| d as usize).collect();
            infos.push((name, dtype, shape, offset, bytes));
        }
        let data_start = self.pos.div_ceil(alignment).checked_mul(alignment).filter(|&s| s <= self.len);
        let data_start = match data_start {
            Some(s) => s,
            None if infos.is_empty() => self.len,
            None => return Err("the tensor data section starts past the end of the file".into()),
        };
        let data_len = self.len - data_start;

        // As llama.cpp requires: tensors packed in the data section in offset order, each
        // starting at the first aligned byte after the previous one, the last ending at
        // the end of the file (give or take the padding). A changed type, dimension or
        // offset leaves a gap or an overlap, so it is caught here and cannot silently
        // shift what a tensor reads.
        let mut order: Vec<usize> = (0..infos.len()).collect();
        order.sort_unstable_by_key(|&i| infos[i].3);
        let mut expected = 0u64;
        let mut previous: Option<&str> = None;
        for i in order {
            let (name, _, _, offset, bytes) = &infos[i];
            if *offset != expected {
                let before = previous.map_or("the data section starts".to_string(), |p| format!("tensor {p} before it ends"));
                return Err(format!(
                    "tensor {name} starts at byte {offset} of the data section, but {before} at {expected}: the tensor table is inconsistent (a changed offset, type or dimension)"
                ));
            }
            let end = offset.checked_add(*bytes).filter(|&e| e <= data_len).ok_or_else(|| {
                format!("tensor {name} needs bytes {offset}..{} of the data section, which holds {data_len}", offset.saturating_add(*bytes))
            })?;
            expected = end.div_ceil(alignment) * alignment;
            previous = Some(name);
        }
        if let Some(last) = previous.filter(|_| data_len > expected) {
            return Err(format!(
                "{} bytes follow the data of tensor {last}, the last one: the tensor table is inconsistent (a changed type or dimension)",
                data_len - expected
            ));
        }

        let mut tensor_infos = HashMap::with_capacity(infos.len());
        for (name, ggml_dtype, shape, offset, _) in infos {
            let info = TensorInfo { ggml_dtype, shape: shape.into(), offset };
            if tensor_infos.insert(name.clone(), info).is_some() {
                return Err(format!("tensor {name} appears twice"));
            }
        }
        Ok(Content { magic, metadata, tensor_infos, tensor_data_offset: data_start })
    }

    fn value(&mut self, kind: u32, depth: usize, what: &dyn Fn() -> String) -> Check<Value> {
        self.use_memory(std::mem::size_of::<Value>() as u64, what)?;
        Ok(match kind {
            0 => Value::U8(self.array::<1>(what)?[0]),
            1 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format!("{} is a bool stored as {b} (0 or 1 allowed)", what())),
            },
            8 => {
                let mut s = self.string(what)?;
                // llama.cpp writes no terminator, but some converters did
                while s.last() == Some(&0) {
                    s.pop();
                }
                Value::String(String::from_utf8_lossy(&s).into_owned())
            }
            9 => {
                if depth >= MAX_NESTING {
                    return Err(format!("{} nests arrays deeper than {MAX_NESTING}", what()));
                }
                let item = self.u32(what)?;
                let count = self.u64(what)?;
                let least = match item {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => return Err(format!("{} is an array of unknown type {t}", what())),
                };
                if count.checked_mul(least).is_none_or(|n| n > self.remaining()) {
                    return Err(format!("{} declares {count} items, more than the {} bytes left can hold", what(), self.remaining()));
                }
                self.use_memory(count.saturating_mul(std::mem::size_of::<Value>() as u64), what)?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(item, depth + 1, what)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            t => return Err(format!("{} has unknown value type {t}", what())),
        })
    }
}

/// Bytes of a tensor with GGUF dimensions `dims` (fastest first) of type `dtype`, computed
/// without overflow; rows must be whole blocks and no dimension zero.
fn tensor_bytes(dims: &[u64], dtype: GgmlDType) -> Check<u64> {
    if dims.contains(&0) {
        return Err(format!("has a zero dimension {dims:?}"));
    }
    let elements = dims
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64 && usize::try_from(n).is_ok())
        .ok_or_else(|| format!("has dimensions {dims:?} whose product overflows"))?;
    let block = dtype.block_size() as u64;
    if !dims[0].is_multiple_of(block) {
        return Err(format!("has rows of {} values, not a multiple of {dtype:?}'s block of {block}", dims[0]));
    }
    (elements / block)
        .checked_mul(dtype.type_size() as u64)
        .ok_or_else(|| format!("has dimensions {dims:?} whose byte size overflows"))
}
