//! The compute kernels and the threads that run them, apart from the model code that
//! calls them (as ggml-cpu's kernels live apart from llama.cpp's model code): the
//! process's thread team, matrix-vector and small-M products for float32 weights, the
//! products over GGUF blocks and their layouts, attention over the cache's blocks, and the
//! element-wise functions (e^x, the MLP's gate).
//! Each kernel has AVX-512, AVX2 and portable (NEON on aarch64) versions chosen at run
//! time, tested against scalar or float64 references.

pub mod activation;
pub mod attention;
pub mod blocks;
pub mod kv8;
pub mod matvec;
pub mod qmatvec;
pub mod team;
pub mod transpose;
