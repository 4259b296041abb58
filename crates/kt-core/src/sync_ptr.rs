//! Sharing a raw pointer with the tasks of a parallel phase.
//!
//! The pool runs one closure on many threads; each task writes its own disjoint range of a
//! buffer (a panel of packed weights, a row of scratch, the columns of an output block). A
//! `&mut` slice cannot be split along such data-dependent lines, so the phase shares the
//! buffer's address instead. [`SyncPtr`] is that address, `Send + Sync`; every dereference is
//! `unsafe` and must name the range its task owns.
//!
//! Contract for every user: during one phase, no two tasks touch the same element unless
//! both only read it, and the buffer outlives the phase.

/// A raw pointer tasks share to write disjoint ranges (see the module docs).
#[derive(Debug)]
pub struct SyncPtr<T>(*mut T);

impl<T> Clone for SyncPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for SyncPtr<T> {}

// SAFETY: the pointer is only dereferenced under the module's contract (disjoint ranges per
// task, buffer alive for the phase), so handing it to another thread is sound.
unsafe impl<T> Send for SyncPtr<T> {}
// SAFETY: as above; shared references only copy the address.
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// Share `ptr` (null is allowed: "no buffer").
    pub fn new(ptr: *mut T) -> SyncPtr<T> {
        SyncPtr(ptr)
    }

    /// A null pointer.
    pub fn null() -> SyncPtr<T> {
        SyncPtr(std::ptr::null_mut())
    }

    /// The address (a method, so closures capture the `Sync` wrapper, not the raw field).
    #[inline(always)]
    pub fn get(self) -> *mut T {
        self.0
    }

    /// Whether no buffer is behind it.
    pub fn is_null(self) -> bool {
        self.0.is_null()
    }
}
