//! kvcandle: a Llama-family model on candle with a KV cache the caller can see and
//! control. The engine modules are plain Rust; the Python bindings live in `bindings`.

pub mod config;
pub mod device;
pub mod error;
pub mod kernels;
pub mod linear;
pub mod loader;
pub mod memory;
pub mod model;
pub mod rope;
pub mod sentencepiece;
pub mod upstream;

#[cfg(feature = "python")]
mod bindings;

pub use model::cache::KvCache;
pub use config::ModelConfig;
pub use error::{Error, Result};
pub use model::Llama;
