//! Engine errors. Each variant maps to one Python exception class in `bindings`.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model file or directory does not exist.
    #[error("model not found: {path}")]
    NotFound { path: PathBuf },

    /// The file exists but is malformed, incomplete or of an architecture we cannot run.
    #[error("cannot load model from {path}: {reason}")]
    Load { path: PathBuf, reason: String },

    /// A device that is unknown or not compiled into this build.
    #[error("{0}")]
    Device(String),

    /// A dtype that is unknown or not supported on the chosen device.
    #[error("{0}")]
    DType(String),

    /// The cache would grow past the model's context length.
    #[error("cannot run {requested} token(s) at position {offset}: the model's context length is {limit} (max_length), so at most {available} more token(s) fit")]
    Position { offset: usize, requested: usize, limit: usize, available: usize },

    /// A token id that is negative or not below the vocabulary size.
    /// (`id` as written by the caller: it may not fit any integer type.)
    #[error("token id {id} at index {index} is out of range: the vocabulary has {vocab} ids (0..{vocab})")]
    TokenId { id: String, index: usize, vocab: usize },

    /// Bad argument value (empty ids, bad crop length, ...).
    #[error("{0}")]
    Input(String),

    /// A cache used with a model that did not create it, or another cache misuse.
    #[error("{0}")]
    Cache(String),

    /// A cache file that cannot be read or written: missing, truncated, corrupted, of
    /// another format or version, or with sizes that do not fit the model.
    #[error("cache file {path}: {reason}")]
    CacheFile { path: PathBuf, reason: String },

    /// An error inside candle while computing.
    #[error("engine error: {0}")]
    Engine(candle_core::Error),

    /// One sequence of a batch refused: the error a single call would raise, naming the
    /// sequence (its Python class is the inner error's).
    #[error("sequence {index}: {inner}")]
    Sequence { index: usize, inner: Box<Error> },
}

impl Error {
    /// This error as sequence `index` of a batch raised it.
    pub fn in_sequence(self, index: usize) -> Self {
        Error::Sequence { index, inner: Box::new(self) }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<candle_core::Error> for Error {
    /// Keeps candle's message, not the backtrace candle attaches when RUST_BACKTRACE is set.
    fn from(e: candle_core::Error) -> Self {
        Error::Engine(without_backtrace(e))
    }
}

fn without_backtrace(mut e: candle_core::Error) -> candle_core::Error {
    while let candle_core::Error::WithBacktrace { inner, .. } = e {
        e = *inner;
    }
    e
}

/// candle's message for `e` on one line: without the backtrace candle appends when
/// RUST_BACKTRACE is set. Every candle error shown to a user goes through this (or
/// through `From`, which does the same).
pub(crate) fn message(e: candle_core::Error) -> String {
    one_line(&without_backtrace(e).to_string())
}

/// `text` with control characters (newlines, escapes) written as Rust escapes.
pub fn one_line(text: &str) -> String {
    if !text.chars().any(char::is_control) {
        return text.to_string();
    }
    text.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

/// Runs `f`, turning a panic (a bug in kvcandle or candle, never a bad input) into an
/// [`Error::Engine`], so that no panic reaches the caller (in Python, a PanicException,
/// which `except Exception` does not catch).
pub fn no_panic<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("unknown panic");
        Err(Error::Engine(candle_core::Error::Msg(format!("internal error (a bug in kvcandle, please report it): {what}"))))
    })
}

impl Error {
    /// A load error; names read from the file (keys, tensor names) may hold any
    /// character, so control characters are escaped to keep the message one line.
    pub(crate) fn load(path: impl Into<PathBuf>, reason: impl std::fmt::Display) -> Self {
        Error::Load { path: path.into(), reason: one_line(&reason.to_string()) }
    }
}
