//! The global allocator: the system's, except that large blocks get transparent huge pages.
//!
//! A store with a million active keys is ~128 MB of key tables, read at random: with 4 KiB
//! pages nearly every decision misses the TLB as well as the cache, and in a VM a TLB miss is
//! a two-level page walk. Blocks of [`HUGE`] bytes or more (only such tables, in practice) are
//! placed on 2 MiB boundaries and advised `MADV_HUGEPAGE`, which the kernel honours in its
//! default `madvise` THP mode (`cargo bench --bench limiter -- store/` shows the difference;
//! runs in docs/benchmarks.md).
//! Smaller blocks go to the system allocator untouched, so nothing else pays for this.

use std::alloc::{GlobalAlloc, Layout, System};

/// The huge page size on x86-64 and the smallest block worth one.
pub const HUGE: usize = 2 << 20;

/// The global allocator `main` installs: [`System`], with blocks of [`HUGE`] bytes or more on
/// huge pages.
pub struct HugePages;

/// The layout a block of `layout`'s size is really allocated with.
fn placed(layout: Layout) -> Layout {
    if layout.size() >= HUGE && layout.align() < HUGE {
        // Cannot fail: HUGE is a power of two and the size was valid at a smaller alignment
        // (sizes near isize::MAX are refused by Layout before they get here).
        Layout::from_size_align(layout.size(), HUGE).unwrap_or(layout)
    } else {
        layout
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn advise(ptr: *mut u8, layout: Layout) {
    if !ptr.is_null() && layout.size() >= HUGE {
        // SAFETY: `ptr` starts a live block of `layout.size()` bytes at a page boundary.
        // Advice only: failure (THP disabled, not Linux-like) leaves ordinary pages.
        unsafe { libc::madvise(ptr.cast(), layout.size(), libc::MADV_HUGEPAGE) };
    }
}

/// Elsewhere the placement stays (harmless) and there is no advice to give.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn advise(_: *mut u8, _: Layout) {}

// SAFETY: every block is allocated and freed by `System` with the same `placed` layout, which
// satisfies the caller's layout (same size, equal or stricter alignment).
unsafe impl GlobalAlloc for HugePages {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let placed = placed(layout);
        let ptr = unsafe { System.alloc(placed) };
        advise(ptr, placed);
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let placed = placed(layout);
        let ptr = unsafe { System.alloc_zeroed(placed) };
        advise(ptr, placed);
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, placed(layout)) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.size() < HUGE && new_size < HUGE {
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // Crossing or above the threshold: the placement changes, so move the block.
        let Ok(new_layout) = Layout::from_size_align(new_size, layout.align()) else {
            return std::ptr::null_mut();
        };
        let new = unsafe { self.alloc(new_layout) };
        if !new.is_null() {
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_blocks_sit_on_huge_page_boundaries_and_small_ones_are_untouched() {
        let a = HugePages;
        let big = Layout::from_size_align(HUGE + 100, 64).unwrap();
        let small = Layout::from_size_align(100, 8).unwrap();
        unsafe {
            let p = a.alloc(big);
            assert_eq!(p as usize % HUGE, 0);
            p.write_bytes(7, big.size());
            // Growing a small block past the threshold moves it there, contents kept.
            let s = a.alloc(small);
            s.write_bytes(9, 100);
            let g = a.realloc(s, small, HUGE);
            assert_eq!(g as usize % HUGE, 0);
            assert!(std::slice::from_raw_parts(g, 100).iter().all(|&b| b == 9));
            let shrunk = a.realloc(g, Layout::from_size_align(HUGE, 8).unwrap(), 50);
            assert!(
                std::slice::from_raw_parts(shrunk, 50)
                    .iter()
                    .all(|&b| b == 9)
            );
            a.dealloc(shrunk, Layout::from_size_align(50, 8).unwrap());
            a.dealloc(p, big);
            let z = a.alloc_zeroed(big);
            assert!(
                std::slice::from_raw_parts(z, big.size())
                    .iter()
                    .all(|&b| b == 0)
            );
            a.dealloc(z, big);
        }
    }
}
