//! Where float32 weights live: one buffer for all of a model's tensors, filled by the
//! loader as it reads them, starting on a 2 MiB boundary and asked to be backed by huge
//! pages, each tensor starting on a cache line. Matrices the engine stacks (q/k/v,
//! gate/up) are loaded side by side, so their stack is a view, not a copy
//! ([`Arena::join`]).
//!
//! A decode step streams every weight from memory once. With 4 KiB pages that is one
//! page (and one translation) every 4 KiB; the hardware prefetchers stop at each page's
//! end and the translations miss the TLB. On Linux with transparent huge pages in
//! `madvise` mode (the common default) the kernel backs a region with 2 MiB pages only
//! when asked, before the pages are first written. Measured on the default model
//! (Xeon, 2 threads, 2026-12-02, wheels in turns): a float32 decode step 22.35 -> 20.8
//! ms, a chunk of 8 tokens 1.37-1.39 -> 1.32 decode steps, 8 sequences at 2,000 tokens
//! 4.93-5.02x -> 5.08-5.23x one; `examples/products_probe` reads weights 7-10 % faster
//! from such a buffer. Loading peaks at 1.02x the weights (1.05x when the stacks were
//! copies). Elsewhere (macOS, or Linux with huge pages off) the buffer is an ordinary
//! one, still aligned.

use candle_core::{DType, Device, Result, Storage, Tensor};

/// The boundary the buffer starts on (a huge page; also a multiple of every smaller page).
pub const HUGE_PAGE: usize = 2 << 20;

/// Floats a matrix's start is rounded up to: one cache line.
const LINE_FLOATS: usize = 64 / std::mem::size_of::<f32>();

/// One float32 buffer in CPU memory that weights are copied into, each at the next cache
/// line ([`Arena::place`]). Its pages are untouched (so take no memory) until a weight is
/// copied in; the pages a copy is about to write are first touched on the team
/// ([`prefault`]): room that is never used costs address space only.
pub struct Arena {
    /// the buffer, one dimension; weights are views into it
    buffer: Tensor,
    /// the buffer's first float's address (a view's is the same)
    base: usize,
    /// where the next weight goes and where the untouched pages start (floats from the
    /// buffer's start; the second on a huge page's boundary, or the end)
    next: std::sync::Mutex<(usize, usize)>,
    end: usize,
}

/// A float32 CPU tensor's storage (its first float's address) and where in it the tensor
/// starts; None for any other tensor.
fn storage_of(t: &Tensor) -> Option<(usize, usize)> {
    let (guard, layout) = t.storage_and_layout();
    match &*guard {
        Storage::Cpu(s) => s.as_slice::<f32>().ok().map(|d| (d.as_ptr() as usize, layout.start_offset())),
        _ => None,
    }
}

impl Arena {
    /// Room for weights of `floats` floats in all, each rounded up to a cache line by the
    /// caller's count ([`Arena::room`]).
    pub fn new(floats: usize) -> Result<Self> {
        let pad = HUGE_PAGE / std::mem::size_of::<f32>();
        let buffer = Tensor::from_vec(zeroed(floats + pad)?, floats + pad, &Device::Cpu)?;
        let (base, at) = {
            let (guard, _) = buffer.storage_and_layout();
            let Storage::Cpu(s) = &*guard else { candle_core::bail!("the weights' buffer is not in CPU memory") };
            let data = s.as_slice::<f32>()?;
            let at = data.as_ptr().align_offset(HUGE_PAGE).min(pad);
            advise_huge(data[at..].as_ptr() as *const u8, floats * std::mem::size_of::<f32>());
            (data.as_ptr() as usize, at)
        };
        Ok(Self { buffer, base, next: std::sync::Mutex::new((at, at)), end: at + floats })
    }

    /// Floats `elements` take in an arena (rounded up to a cache line).
    pub fn room(elements: usize) -> usize {
        elements.next_multiple_of(LINE_FLOATS)
    }

    /// `t` copied into the arena (a view of the same shape), when it is float32 in CPU
    /// memory and fits; otherwise `t` as it is. The copy is made before `t` is dropped,
    /// so a caller that held the last reference to `t` frees it.
    pub fn place(&self, t: Tensor) -> Result<Tensor> {
        if t.dtype() != DType::F32 || !t.device().is_cpu() {
            return Ok(t);
        }
        let n = t.elem_count();
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let (at, touched) = *next;
        if at + n > self.end {
            return Ok(t);
        }
        if at + n > touched {
            let size = std::mem::size_of::<f32>();
            let page_end = (self.base + (at + n) * size).next_multiple_of(HUGE_PAGE);
            let upto = ((page_end - self.base) / size).min(self.end);
            // SAFETY: floats touched..upto lie inside the buffer, and no one else reads or
            // writes them while the lock is held
            unsafe { prefault((self.base as *mut f32).add(touched) as *mut u8, (upto - touched) * std::mem::size_of::<f32>()) };
            next.1 = upto;
        }
        self.buffer.slice_set(&t.flatten_all()?.contiguous()?, 0, at)?;
        next.0 = at + Self::room(n);
        self.buffer.narrow(0, at, n)?.reshape(t.shape())
    }

    /// One matrix of `parts` stacked by rows, as a view: when every part is a view into
    /// this arena and each starts where the one before ends (parts loaded one after the
    /// other whose sizes are whole cache lines). None otherwise (the caller copies).
    pub fn join(&self, parts: &[&Tensor]) -> Result<Option<Tensor>> {
        let Some(first) = parts.first() else { return Ok(None) };
        let cols = first.dims()[1..].to_vec();
        let (mut start, mut rows, mut end) = (None, 0, 0);
        for p in parts {
            let Some((base, at)) = storage_of(p) else { return Ok(None) };
            if base != self.base || !p.is_contiguous() || p.rank() < 2 || p.dims()[1..] != cols[..] {
                return Ok(None);
            }
            if start.is_some() && at != end {
                return Ok(None);
            }
            start.get_or_insert(at);
            end = at + p.elem_count();
            rows += p.dims()[0];
        }
        let start = start.expect("at least one part");
        let mut shape = vec![rows];
        shape.extend_from_slice(&cols);
        Ok(Some(self.buffer.narrow(0, start, end - start)?.reshape(shape)?))
    }
}

/// `n` zero floats, or an error when the memory cannot be had (not an abort, as `vec!`
/// would). Zeroed by the allocator: at this size fresh pages from the kernel, so nothing
/// is written before the advice.
fn zeroed(n: usize) -> Result<Vec<f32>> {
    let layout = std::alloc::Layout::array::<f32>(n).map_err(|_| candle_core::Error::Msg(format!("{n} floats of weights do not fit in memory")))?;
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the layout has a non-zero size
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut f32;
    if ptr.is_null() {
        candle_core::bail!("cannot allocate {} bytes for the weights", layout.size());
    }
    // SAFETY: allocated by the global allocator with the layout of `n` f32s, all zero
    // (a valid f32 each); the vector frees it with that same layout
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// Asks the kernel to back the whole huge pages inside `bytes` from `start` with huge
/// pages. Advice only: refused (huge pages off, an old kernel) it changes nothing.
#[cfg(target_os = "linux")]
fn advise_huge(start: *const u8, bytes: usize) {
    let (first, end) = ((start as usize).next_multiple_of(HUGE_PAGE), (start as usize + bytes) / HUGE_PAGE * HUGE_PAGE);
    if first < end {
        // SAFETY: madvise reads no memory; the range lies inside a live allocation, and
        // MADV_HUGEPAGE changes how it is backed, never its contents
        unsafe {
            libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge(_start: *const u8, _bytes: usize) {}

/// Touches every 4 KiB of `bytes` from `start` (each byte read and written back), the huge
/// pages split over the team: the kernel clears a fresh page when it is first written,
/// and when the loader's copies wrote them on one thread, clearing fresh 2 MiB pages was
/// most of a first load's time on this project's (virtual) machines, and varied from one
/// process to the next. Measured, the default model's first load in a fresh process,
/// builds in turns: without this 0.41-1.61 s (20 processes, 9 above 0.5 s), with it
/// 0.42-0.84 s (14 processes, 4 above 0.5 s; median 0.43 s); before the buffer (4 KiB
/// pages) 0.49-0.51 s. Touching the whole buffer when it is made was as fast but made it
/// resident at once, so a load peaked at 1.28x the weights instead of 1.02x.
///
/// # Safety
/// The range must lie inside one allocation that no other thread uses meanwhile.
unsafe fn prefault(start: *mut u8, bytes: usize) {
    let pages = bytes.div_ceil(HUGE_PAGE);
    let base = start as usize;
    crate::kernels::team::Team::global().run(pages, &|i| {
        let end = (base + bytes).min(base + (i + 1) * HUGE_PAGE);
        let mut at = base + i * HUGE_PAGE;
        while at < end {
            // SAFETY: inside the range, which the caller holds alone; the byte is written
            // back unchanged
            unsafe { std::ptr::write_volatile(at as *mut u8, std::ptr::read_volatile(at as *const u8)) };
            at += 4096;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placed_weights_equal_their_source_on_cache_lines() {
        let shapes = [(5usize, 7usize), (3, 16), (1, 1), (4, 33)];
        let arena = Arena::new(shapes.iter().map(|(r, c)| Arena::room(r * c)).sum()).unwrap();
        let mut placed = Vec::new();
        for (i, &(r, c)) in shapes.iter().enumerate() {
            let data: Vec<f32> = (0..r * c).map(|j| (i * 1000 + j) as f32 * 0.5 - 3.0).collect();
            let t = Tensor::from_vec(data.clone(), (r, c), &Device::Cpu).unwrap();
            let p = arena.place(t).unwrap();
            assert_eq!(p.dims(), [r, c]);
            let (guard, layout) = p.storage_and_layout();
            let Storage::Cpu(s) = &*guard else { panic!("cpu") };
            let start = layout.contiguous_offsets().unwrap().0;
            assert_eq!(s.as_slice::<f32>().unwrap()[start..].as_ptr() as usize % 64, 0, "matrix {i} starts on a cache line");
            drop(guard);
            placed.push((p, data));
        }
        // later placements never overwrite earlier ones
        for (p, data) in &placed {
            assert_eq!(&p.flatten_all().unwrap().to_vec1::<f32>().unwrap(), data);
        }
        // full: a weight that does not fit stays where it is
        let big = Tensor::zeros((64, 64), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(storage_of(&arena.place(big.clone()).unwrap()), storage_of(&big));
        // not float32: as it is
        let half = Tensor::zeros((2, 2), DType::F16, &Device::Cpu).unwrap();
        let kept = arena.place(half.clone()).unwrap();
        assert_eq!(kept.dtype(), DType::F16);
        assert_eq!(storage_of(&kept), None);
    }

    #[test]
    fn an_arena_too_large_is_an_error_not_an_abort() {
        assert!(Arena::new(usize::MAX / 8).is_err());
        assert!(Arena::new(1 << 60).is_err());
    }

    #[test]
    fn adjacent_parts_join_as_a_view_others_do_not() {
        let part = |rows: usize, cols: usize, seed: usize| Tensor::from_vec((0..rows * cols).map(|j| (seed * 100 + j) as f32).collect::<Vec<_>>(), (rows, cols), &Device::Cpu).unwrap();
        let arena = Arena::new(4 * Arena::room(64 * 16)).unwrap();
        let (q, k, v) = (arena.place(part(4, 16, 1)).unwrap(), arena.place(part(2, 16, 2)).unwrap(), arena.place(part(2, 16, 3)).unwrap());
        let joined = arena.join(&[&q, &k, &v]).unwrap().expect("adjacent parts");
        assert_eq!(storage_of(&joined).map(|s| s.0), storage_of(&q).map(|s| s.0));
        assert_eq!(joined.dims(), [8, 16]);
        let copied = Tensor::cat(&[&q, &k, &v], 0).unwrap();
        assert_eq!(joined.to_vec2::<f32>().unwrap(), copied.to_vec2::<f32>().unwrap());
        // out of order, with a gap, of other widths, or not in the arena: no view
        assert!(arena.join(&[&k, &q]).unwrap().is_none());
        assert!(arena.join(&[&q, &v]).unwrap().is_none());
        let wide = arena.place(part(1, 32, 4)).unwrap();
        assert!(arena.join(&[&v, &wide]).unwrap().is_none());
        assert!(arena.join(&[&q, &part(2, 16, 5)]).unwrap().is_none());
    }
}
