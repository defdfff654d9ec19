//! A counting global allocator for the cost examples (`parse_cost` here, `incoming_cost` in
//! the client crate, which includes this file by path): the system allocator with a count of
//! allocations and of reallocations, read with [`counts`], and [`per_call`], which times a
//! call and counts its allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The system allocator, counting allocations (reallocations counted apart).
pub struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static REALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        REALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// (allocations, reallocations) made so far by the process.
pub fn counts() -> (u64, u64) {
    (
        ALLOCS.load(Ordering::Relaxed),
        REALLOCS.load(Ordering::Relaxed),
    )
}

/// Runs `f` `n` times: (ns per call, allocations per call, reallocations per call).
pub fn per_call(n: u32, mut f: impl FnMut()) -> (f64, f64, f64) {
    let (a0, r0) = counts();
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    let ns = t.elapsed().as_nanos() as f64 / f64::from(n);
    let (a1, r1) = counts();
    let per = |d: u64| d as f64 / f64::from(n);
    (ns, per(a1 - a0), per(r1 - r0))
}
