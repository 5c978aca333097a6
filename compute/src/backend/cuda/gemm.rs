//! Matrix products on cuBLAS. Matrices are row-major as everywhere in shoal; cuBLAS is
//! column-major, so a row-major product `C = op(A) op(B)` is issued as the column-major
//! `Cᵀ = op(B)ᵀ op(A)ᵀ`, whose operands are the same memory read with the same leading
//! dimensions.

use super::{CudaBackend, CudaBuffer, cuda_error};
use crate::backend::Result;
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// A row-major operand of a product: buffer, offset, leading dimension (row stride),
/// transposed or not, and the stride between batch members.
#[derive(Clone, Copy)]
pub(super) struct Operand {
    off: usize,
    ld: usize,
    trans: bool,
    stride: usize,
}

impl Operand {
    pub(super) fn plain(ld: usize) -> Self {
        Operand {
            off: 0,
            ld,
            trans: false,
            stride: 0,
        }
    }
    pub(super) fn t(self) -> Self {
        Operand {
            trans: true,
            ..self
        }
    }
    pub(super) fn at(self, off: usize) -> Self {
        Operand { off, ..self }
    }
    pub(super) fn batched(self, stride: usize) -> Self {
        Operand { stride, ..self }
    }
    /// One past the last element read for a `rows x cols` operand (as op(X) has them) in
    /// `batch` members.
    fn extent(&self, rows: usize, cols: usize, batch: usize) -> usize {
        if rows == 0 || cols == 0 || batch == 0 {
            return self.off;
        }
        let (r, c) = if self.trans {
            (cols, rows)
        } else {
            (rows, cols)
        };
        self.off + (batch - 1) * self.stride + (r - 1) * self.ld + c
    }
    fn op(&self) -> cublasOperation_t {
        if self.trans {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    }
}

fn int(v: usize) -> i32 {
    i32::try_from(v).expect("dimension over 2^31")
}

impl CudaBackend {
    /// `C = alpha op(A) op(B) + beta C` for `batch` members, all row-major (see the module
    /// docs for how this maps to cuBLAS).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm(
        &self,
        (m, n, k, batch): (usize, usize, usize, usize),
        a: (&CudaBuffer, Operand),
        b: (&CudaBuffer, Operand),
        c: (&mut CudaBuffer, Operand),
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        let (ab, ao) = a;
        let (bb, bo) = b;
        let (cb, co) = c;
        if m == 0 || n == 0 || batch == 0 {
            return Ok(());
        }
        assert!(ao.extent(m, k, batch) <= ab.len, "gemm A out of bounds");
        assert!(bo.extent(k, n, batch) <= bb.len, "gemm B out of bounds");
        assert!(co.extent(m, n, batch) <= cb.len, "gemm C out of bounds");
        let cfg = GemmConfig {
            transa: bo.op(),
            transb: ao.op(),
            m: int(n),
            n: int(m),
            k: int(k),
            alpha,
            lda: int(bo.ld),
            ldb: int(ao.ld),
            beta,
            ldc: int(co.ld),
        };
        let av = ab.data.slice(ao.off..);
        let bv = bb.data.slice(bo.off..);
        let mut cv = cb.data.slice_mut(co.off..);
        // SAFETY: the extents of all three operands were checked against their buffers.
        unsafe {
            if batch == 1 {
                self.blas.gemm(cfg, &bv, &av, &mut cv)
            } else {
                self.blas.gemm_strided_batched(
                    StridedBatchedConfig {
                        gemm: cfg,
                        batch_size: int(batch),
                        stride_a: bo.stride as i64,
                        stride_b: ao.stride as i64,
                        stride_c: co.stride as i64,
                    },
                    &bv,
                    &av,
                    &mut cv,
                )
            }
        }
        .map_err(cuda_error)
    }

    /// [`Self::gemm`] for `groups` groups of `batch` members, each operand's group `g`
    /// starting `g` times its group stride after group 0: one cuBLAS call over arrays of
    /// pointers, where a call per group would cost a launch each (attention over many short
    /// sequences is thousands of them).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_grouped(
        &self,
        (m, n, k, batch, groups): (usize, usize, usize, usize, usize),
        a: (&CudaBuffer, Operand, usize),
        b: (&CudaBuffer, Operand, usize),
        c: (&mut CudaBuffer, Operand, usize),
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        let (ab, ao, ag) = a;
        let (bb, bo, bg) = b;
        let (cb, co, cg) = c;
        if groups == 1 {
            return self.gemm((m, n, k, batch), (ab, ao), (bb, bo), (cb, co), alpha, beta);
        }
        if m == 0 || n == 0 || k == 0 || batch == 0 || groups == 0 {
            return Ok(());
        }
        let last = |o: Operand, g: usize| o.at(o.off + (groups - 1) * g);
        assert!(
            last(ao, ag).extent(m, k, batch) <= ab.len,
            "gemm A out of bounds"
        );
        assert!(
            last(bo, bg).extent(k, n, batch) <= bb.len,
            "gemm B out of bounds"
        );
        assert!(
            last(co, cg).extent(m, n, batch) <= cb.len,
            "gemm C out of bounds"
        );
        let (a_base, _a_sync) = ab.data.device_ptr(&self.stream);
        let (b_base, _b_sync) = bb.data.device_ptr(&self.stream);
        let (c_base, _c_sync) = cb.data.device_ptr_mut(&self.stream);
        let pointers = |base: u64, o: Operand, g: usize| -> Vec<u64> {
            (0..groups)
                .flat_map(|gi| (0..batch).map(move |bi| o.off + gi * g + bi * o.stride))
                .map(|at| base + (at * size_of::<f32>()) as u64)
                .collect()
        };
        // The three arrays of pointers in one upload: A's, B's, then C's.
        let members = batch * groups;
        let all = [
            pointers(a_base, ao, ag),
            pointers(b_base, bo, bg),
            pointers(c_base, co, cg),
        ]
        .concat();
        let arrays = self.stream.clone_htod(&all).map_err(cuda_error)?;
        let (arrays_ptr, _arrays_sync) = arrays.device_ptr(&self.stream);
        let array = |i: usize| arrays_ptr + (i * members * size_of::<u64>()) as u64;
        let (pa_ptr, pb_ptr, pc_ptr) = (array(0), array(1), array(2));
        // Column-major, as in `gemm`: Cᵀ = op(B)ᵀ op(A)ᵀ.
        // SAFETY: every member's extent lies within its buffer (checked above for the last
        // group, whose members end furthest), and the pointer arrays live on the stream until
        // the product that reads them has run (they are freed in stream order).
        unsafe {
            cudarc::cublas::sys::cublasSgemmBatched(
                *self.blas.handle(),
                bo.op(),
                ao.op(),
                int(n),
                int(m),
                int(k),
                &alpha,
                pb_ptr as *const *const f32,
                int(bo.ld),
                pa_ptr as *const *const f32,
                int(ao.ld),
                &beta,
                pc_ptr as *const *mut f32,
                int(co.ld),
                int(members),
            )
            .result()
        }
        .map_err(cuda_error)
    }
}
