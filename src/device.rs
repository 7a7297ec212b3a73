//! Device and dtype names as Python users write them.

use candle_core::{DType, Device};

use crate::error::{Error, Result};

/// "cpu", "metal", "metal:N", "cuda", "cuda:N". Metal is compiled into macOS builds
/// only and CUDA into none; asking for one that is not compiled in names it.
pub fn parse_device(name: &str) -> Result<Device> {
    let (kind, ordinal) = match name.split_once(':') {
        Some((k, n)) => {
            let n = n.parse::<usize>().map_err(|_| Error::Device(format!("invalid device {name:?}: the ordinal after ':' must be a number")))?;
            (k, n)
        }
        None => (name, 0),
    };
    match kind {
        "cpu" if ordinal == 0 => Ok(Device::Cpu),
        "metal" if candle_core::utils::metal_is_available() => Device::new_metal(ordinal)
            .map_err(|e| Error::Device(format!("cannot open device {name:?}: {e}"))),
        "metal" => Err(Error::Device(format!(
            "device {name:?} is not compiled into this build of kvcandle (Metal is built on macOS only); use device=\"cpu\""
        ))),
        "cuda" if candle_core::utils::cuda_is_available() => Device::new_cuda(ordinal)
            .map_err(|e| Error::Device(format!("cannot open device {name:?}: {e}"))),
        "cuda" => Err(Error::Device(format!(
            "device {name:?} is not compiled into this build of kvcandle (CUDA is not built); use device=\"cpu\""
        ))),
        _ => Err(Error::Device(format!("unknown device {name:?}: expected \"cpu\", \"metal\" or \"cuda\""))),
    }
}

/// The devices this build can open, in the order `parse_device` accepts them.
pub fn compiled_devices() -> Vec<&'static str> {
    let mut out = vec!["cpu"];
    if candle_core::utils::metal_is_available() {
        out.push("metal");
    }
    if candle_core::utils::cuda_is_available() {
        out.push("cuda");
    }
    out
}

/// "float32", "float16", "bfloat16" (also "f32", "f16", "bf16"), checked against what
/// the device can compute. candle's CPU matmul has no bfloat16 kernel, and with
/// Accelerate (the macOS build) no float16 kernel either.
pub fn parse_dtype(name: &str, device: &Device) -> Result<DType> {
    let dtype = match name {
        "float32" | "f32" => DType::F32,
        "float16" | "f16" | "half" => DType::F16,
        "bfloat16" | "bf16" => DType::BF16,
        _ => return Err(Error::DType(format!("unknown dtype {name:?}: expected \"float32\", \"float16\" or \"bfloat16\""))),
    };
    let cpu_ok = match dtype {
        DType::F32 => true,
        DType::F16 => !cfg!(target_os = "macos"),
        _ => false,
    };
    if device.is_cpu() && !cpu_ok {
        return Err(Error::DType(format!(
            "dtype {name:?} is not supported on the cpu device in this build (candle's CPU matmul has no kernel for it); use \"float32\""
        )));
    }
    Ok(dtype)
}

/// A cache's dtype by name: the names [`parse_dtype`] takes, and "q8_0", the 8-bit
/// cache ([`crate::model::cache::Q8_0`]).
pub fn parse_cache_dtype(name: &str, device: &Device) -> Result<DType> {
    match name {
        "q8_0" => Ok(crate::model::cache::Q8_0),
        _ => parse_dtype(name, device).map_err(|e| match e {
            Error::DType(m) if m.starts_with("unknown dtype") => {
                Error::DType(format!("unknown cache dtype {name:?}: expected \"float32\", \"float16\", \"bfloat16\" or \"q8_0\""))
            }
            other => other,
        }),
    }
}

pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F64 => "float64",
        crate::model::cache::Q8_0 => "q8_0",
        _ => "other",
    }
}
