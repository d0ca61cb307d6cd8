//! The matrix product of every linear layer: weights pre-packed once at load into column panels,
//! a register-tiled micro-kernel vectorised across output columns, and a split of the panels
//! (output columns) between threads.
//!
//! **Evaluation order (the invariant everything else rests on).** Output element `(i, j)` is one
//! fused multiply-add chain over the input features in order, `c = fma(x[i, k], w[k, j], c)` for
//! `k = 0, 1, ..., K-1` starting from `c = 0`, then `+ bias[j]`. Blocking over `k` stores the
//! running value and reloads it (an exact round trip), so it does not cut the chain. Vector lanes
//! run across `j`, never across `k`, so the lane width (AVX2, AVX-512 or scalar fallback) does not
//! change any bit either. Hence a row's output is the same bits whatever the number of rows in the
//! call, the row's place among them, the tile shapes chosen for that row count, and the number of
//! threads (which only decides who computes which panel).
//!
//! **Why not a GEMM crate.** Measured on this model's shapes (one to 128 rows; 256 to 4,096
//! columns; 512 to 2,048 features), one thread: `matrixmultiply` repacks the whole weight matrix on every call
//! (1-5 GFLOP/s at one row, ten times below this kernel) and its thread count is a process-wide
//! environment variable; `gemm` is as fast as this kernel but picks kernels by shape, so a row's bits
//! change with the batch size (checked: they do for `k >= 1024`), and it is an `unsafe` API this
//! crate forbids. Packing once at load is what makes batch-1 decode fast.

use std::sync::{Mutex, PoisonError};

/// Output columns per panel: one AVX-512 register, two AVX2 registers.
pub(crate) const NR: usize = 16;
/// Input features per pass over a panel (keeps a panel slice in L1 while row tiles stream).
const KC: usize = 256;
/// Rows per register tile in the main loop.
const MR: usize = 6;
/// Panels a small row tile reads at once (more independent chains at one or two rows).
const GROUP: usize = 4;
/// Jobs per thread a parallel region is cut into by default (see [`Kernels::job_len`]); a
/// product's column tasks are fewer when it is narrow (a task has at least `GROUP` panels).
pub(crate) const JOBS_PER_THREAD: usize = 8;

/// A `[in, out]` matrix packed as `ceil(out / 16)` panels, each `[in][16]` (the last one padded
/// with zeros).
#[derive(Debug, Clone)]
pub(crate) struct Packed {
    /// `panels * in_dim * NR` floats.
    data: Vec<f32>,
    in_dim: usize,
    out_dim: usize,
    panels: usize,
}

impl Packed {
    /// Packs a checkpoint-layout `[out, in]` row-major matrix.
    pub(crate) fn from_rows(weight: &[f32], out_dim: usize, in_dim: usize) -> Self {
        let panels = out_dim.div_ceil(NR);
        let mut data = vec![0.0; panels * in_dim * NR];
        for (o, row) in weight.chunks_exact(in_dim.max(1)).take(out_dim).enumerate() {
            let (panel, lane) = (o / NR, o % NR);
            let base = panel * in_dim * NR + lane;
            for (k, &v) in row.iter().enumerate() {
                data[base + k * NR] = v;
            }
        }
        Self {
            data,
            in_dim,
            out_dim,
            panels,
        }
    }

    /// The checkpoint-layout `[out, in]` matrix, into `out`.
    pub(crate) fn rows_into(&self, out: &mut Vec<f32>) {
        out.clear();
        out.resize(self.out_dim * self.in_dim, 0.0);
        for (o, row) in out.chunks_exact_mut(self.in_dim.max(1)).enumerate() {
            let (panel, lane) = (o / NR, o % NR);
            let base = panel * self.in_dim * NR + lane;
            for (k, v) in row.iter_mut().enumerate() {
                *v = self.data[base + k * NR];
            }
        }
    }

    fn panel(&self, index: usize) -> &[f32] {
        &self.data[index * self.in_dim * NR..(index + 1) * self.in_dim * NR]
    }
}

/// How a forward pass runs its kernels: how many threads share the work, how finely a parallel
/// region is cut into jobs, and which vector instructions the CPU has (detected once).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kernels {
    pub threads: usize,
    /// A job is at most `1 / (jobs_per_thread * threads)` of a region when `threads > 1` (see
    /// [`Kernels::job_sizes`]).
    pub jobs_per_thread: usize,
    pub arch: pulp::Arch,
}

/// A job is also at most `1 / (TAIL_SHARE * threads)` of the items left, so jobs shrink towards
/// the end of a region.
const TAIL_SHARE: usize = 2;

impl Kernels {
    /// One thread, the CPU's best instruction set.
    pub(crate) fn single() -> Self {
        Self {
            threads: 1,
            jobs_per_thread: JOBS_PER_THREAD,
            arch: pulp::Arch::new(),
        }
    }

    /// The sizes, in the order the threads take them (see [`Kernels::run_jobs`]), of the jobs
    /// `items` items of about equal cost are cut into, each of at least `min` items (but the
    /// last): one job on one thread. With several threads a job is at most
    /// `1 / (jobs_per_thread * threads)` of the items, so a thread that stalls (a busier core, a
    /// preempted vCPU) holds the join up by that much at most, and at most `1 / (2 * threads)`
    /// of the items left (guided scheduling), so the jobs shrink towards the end of the region
    /// and the threads finish within about one small job of each other, at few hand-offs per
    /// region.
    fn job_sizes(&self, items: usize, min: usize) -> Vec<usize> {
        let min = min.max(1);
        if self.threads <= 1 || items <= min {
            return vec![items];
        }
        let cap = items.div_ceil(self.threads * self.jobs_per_thread.max(1));
        let mut sizes = Vec::new();
        let mut left = items;
        while left > 0 {
            let size = cap
                .min(left.div_ceil(TAIL_SHARE * self.threads))
                .max(min)
                .min(left);
            sizes.push(size);
            left -= size;
        }
        sizes
    }

    /// Runs `f` on every job, spread over the threads when there are several: each thread
    /// takes the next job in list order when it is free, so a thread that runs slower (a busier
    /// core, a later wake-up) takes fewer jobs instead of holding up the join, and listing the
    /// costliest jobs first balances the threads best. (Rayon's own split of a list hands each
    /// thread a contiguous half first and lets the other steal halves of what is left, so the
    /// list order would not be the order of work.)
    fn run_jobs<J, F>(&self, jobs: Vec<J>, f: F)
    where
        J: Send,
        F: Fn(J) + Sync,
    {
        if self.threads <= 1 || jobs.len() <= 1 {
            jobs.into_iter().for_each(f);
            return;
        }
        let helpers = self.threads.min(jobs.len()) - 1;
        let queue = Mutex::new(jobs.into_iter());
        let work = || loop {
            // The lock is never held while a job runs, so a job that panics poisons nothing.
            let job = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
            match job {
                Some(job) => f(job),
                None => break,
            }
        };
        rayon::scope(|scope| {
            for _ in 0..helpers {
                scope.spawn(|_| work());
            }
            work();
        });
    }

    /// Calls `f(index, chunk)` for each `chunk_len`-float chunk of `data` (the last may be
    /// shorter), spread over the threads when there are several. `f` must compute each chunk
    /// from its index alone; which thread runs it never matters.
    ///
    /// With the `region-timing` feature, the call is timed as one region (see `regions`).
    #[track_caller]
    pub(crate) fn for_each_chunk<F>(&self, data: &mut [f32], chunk_len: usize, f: F)
    where
        F: Fn(usize, &mut [f32]) + Sync + Send,
    {
        #[cfg(feature = "region-timing")]
        if let Some(probe) = crate::regions::open() {
            self.for_each_chunk_here(data, chunk_len, |index, chunk| {
                probe.task(|| f(index, chunk))
            });
            probe.close();
            return;
        }
        self.for_each_chunk_here(data, chunk_len, f)
    }

    /// [`Kernels::for_each_chunk`] without its timing.
    fn for_each_chunk_here<F>(&self, data: &mut [f32], chunk_len: usize, f: F)
    where
        F: Fn(usize, &mut [f32]) + Sync + Send,
    {
        let chunk_len = chunk_len.max(1);
        if self.threads <= 1 || data.len() <= chunk_len {
            for (index, chunk) in data.chunks_mut(chunk_len).enumerate() {
                f(index, chunk);
            }
            return;
        }
        let mut jobs = Vec::new();
        let mut rest = data;
        let mut first = 0;
        for size in self.job_sizes(rest.len().div_ceil(chunk_len), 1) {
            let (job, tail) = rest.split_at_mut((size * chunk_len).min(rest.len()));
            jobs.push((first, job));
            rest = tail;
            first += size;
        }
        self.run_jobs(jobs, |(first, job)| {
            for (index, chunk) in job.chunks_mut(chunk_len).enumerate() {
                f(first + index, chunk);
            }
        });
    }

    /// Calls `f(index, a_chunk, b_chunk)` for the chunks of `a` (`a_len` floats) and `b`
    /// (`b_len` floats) with the same index, like [`Kernels::for_each_chunk`] (`a` and `b` have
    /// as many chunks).
    ///
    /// With the `region-timing` feature, the call is timed as one region (see `regions`).
    #[track_caller]
    pub(crate) fn for_each_chunk_pair<F>(
        &self,
        a: &mut [f32],
        a_len: usize,
        b: &mut [f32],
        b_len: usize,
        f: F,
    ) where
        F: Fn(usize, &mut [f32], &mut [f32]) + Sync + Send,
    {
        #[cfg(feature = "region-timing")]
        if let Some(probe) = crate::regions::open() {
            let timed = &probe;
            self.for_each_chunk_pair_here(a, a_len, b, b_len, |index, a, b| {
                timed.task(|| f(index, a, b))
            });
            probe.close();
            return;
        }
        self.for_each_chunk_pair_here(a, a_len, b, b_len, f)
    }

    /// [`Kernels::for_each_chunk_pair`] without its timing.
    fn for_each_chunk_pair_here<F>(
        &self,
        a: &mut [f32],
        a_len: usize,
        b: &mut [f32],
        b_len: usize,
        f: F,
    ) where
        F: Fn(usize, &mut [f32], &mut [f32]) + Sync + Send,
    {
        let (a_len, b_len) = (a_len.max(1), b_len.max(1));
        if self.threads <= 1 || a.len() <= a_len {
            for (index, (a, b)) in a.chunks_mut(a_len).zip(b.chunks_mut(b_len)).enumerate() {
                f(index, a, b);
            }
            return;
        }
        let mut jobs = Vec::new();
        let (mut a_rest, mut b_rest) = (a, b);
        let mut first = 0;
        for size in self.job_sizes(a_rest.len().div_ceil(a_len), 1) {
            let (a_job, a_tail) = a_rest.split_at_mut((size * a_len).min(a_rest.len()));
            let (b_job, b_tail) = b_rest.split_at_mut((size * b_len).min(b_rest.len()));
            jobs.push((first, a_job, b_job));
            (a_rest, b_rest) = (a_tail, b_tail);
            first += size;
        }
        self.run_jobs(jobs, |(first, a, b)| {
            for (index, (a, b)) in a.chunks_mut(a_len).zip(b.chunks_mut(b_len)).enumerate() {
                f(first + index, a, b);
            }
        });
    }

    /// Calls `f(task)` for each task, spread over the threads like [`Kernels::for_each_chunk`].
    /// `f` must compute each task from the task alone; which thread runs it never matters.
    ///
    /// With the `region-timing` feature, the call is timed as one region (see `regions`).
    #[track_caller]
    pub(crate) fn for_each_task<T, F>(&self, tasks: &mut [T], f: F)
    where
        T: Send,
        F: Fn(&mut T) + Sync + Send,
    {
        #[cfg(feature = "region-timing")]
        if let Some(probe) = crate::regions::open() {
            self.for_each_task_here(tasks, |task| probe.task(|| f(task)));
            probe.close();
            return;
        }
        self.for_each_task_here(tasks, f)
    }

    /// [`Kernels::for_each_task`] without its timing.
    fn for_each_task_here<T, F>(&self, tasks: &mut [T], f: F)
    where
        T: Send,
        F: Fn(&mut T) + Sync + Send,
    {
        if self.threads <= 1 || tasks.len() <= 1 {
            tasks.iter_mut().for_each(f);
            return;
        }
        let mut jobs = Vec::new();
        let mut rest = tasks;
        for size in self.job_sizes(rest.len(), 1) {
            let (job, tail) = rest.split_at_mut(size);
            jobs.push(job);
            rest = tail;
        }
        self.run_jobs(jobs, |job: &mut [T]| job.iter_mut().for_each(&f));
    }

    /// Like [`Kernels::for_each_task`], for a few tasks of uneven cost: every task is a job of
    /// its own, and the threads take them in list order (see [`Kernels::run_jobs`]), so listing
    /// the costliest first balances the threads best.
    ///
    /// With the `region-timing` feature, the call is timed as one region (see `regions`).
    #[track_caller]
    pub(crate) fn for_each_uneven_task<T, F>(&self, tasks: &mut [T], f: F)
    where
        T: Send,
        F: Fn(&mut T) + Sync + Send,
    {
        #[cfg(feature = "region-timing")]
        if let Some(probe) = crate::regions::open() {
            self.for_each_uneven_task_here(tasks, |task| probe.task(|| f(task)));
            probe.close();
            return;
        }
        self.for_each_uneven_task_here(tasks, f)
    }

    /// [`Kernels::for_each_uneven_task`] without its timing.
    fn for_each_uneven_task_here<T, F>(&self, tasks: &mut [T], f: F)
    where
        T: Send,
        F: Fn(&mut T) + Sync + Send,
    {
        self.run_jobs(tasks.iter_mut().collect(), f);
    }
}

/// What a product does to each output row's columns right after computing them, in the same
/// task: `f(row, first_column, columns)`. It must compute each element from that element and its
/// place alone (an element-wise activation, adding another matrix's element), so that which task
/// computes which columns changes no bit; it saves a pass over the output, and a fork and join.
pub(crate) type Epilogue<'a> = &'a (dyn Fn(usize, usize, &mut [f32]) + Sync);

/// `out[rows, out_dim] = x[rows, in_dim] · W (+ bias)` with `w` packed, then `then` over the
/// output; `tmp` is panel-major scratch (`panels * rows * 16` floats). See the module docs for
/// the evaluation order.
#[track_caller]
#[allow(clippy::too_many_arguments)] // the product's operands, its scratch, its output and epilogue
pub(crate) fn matmul(
    kernels: &Kernels,
    x: &[f32],
    rows: usize,
    w: &Packed,
    bias: Option<&[f32]>,
    tmp: &mut Vec<f32>,
    out: &mut [f32],
    then: Option<Epilogue<'_>>,
) {
    let (k, n) = (w.in_dim, w.out_dim);
    let out = &mut out[..rows * n];
    if rows == 0 || n == 0 {
        return;
    }
    let x = &x[..rows * k];
    let panel_floats = rows * NR;
    let len = w.panels * panel_floats;
    if tmp.len() < len {
        tmp.resize(len, 0.0);
    }
    let tmp = &mut tmp[..len];
    // Panels per task: one task on one thread; with several threads, the jobs of
    // `Kernels::job_sizes`, taken one at a time in order (see `Kernels::run_jobs`), so a thread
    // that runs slower (a busier core, a later wake-up) takes fewer of them instead of holding
    // up the join with a fixed half. A task has at least `GROUP` panels when the rows are fewer
    // than a register tile (the wide tiles read `GROUP` panels at once); with more rows, one
    // panel is a tile's full width. Each task re-reads all of `x`, which is small next to the
    // weights it streams. A task also copies its columns of every row into `out` (and adds their
    // bias), so no part of the product runs on one thread alone.
    let min_panels = if rows < MR { GROUP } else { 1 };
    let mut tasks: Vec<PanelTask<'_>> = Vec::new();
    let mut rest = tmp;
    let mut first = 0;
    for size in kernels.job_sizes(w.panels, min_panels) {
        let (panels, tail) = rest.split_at_mut(size * panel_floats);
        tasks.push(PanelTask {
            first,
            panels,
            columns: Vec::with_capacity(rows),
        });
        rest = tail;
        first += size;
    }
    for row in out.chunks_exact_mut(n) {
        let mut row = row;
        for task in tasks.iter_mut() {
            let width = (task.panels.len() / panel_floats * NR).min(row.len());
            let (columns, tail) = std::mem::take(&mut row).split_at_mut(width);
            task.columns.push(columns);
            row = tail;
        }
    }
    #[cfg(feature = "region-timing")]
    crate::regions::set_shape(rows, k, n);
    kernels.for_each_uneven_task(&mut tasks, |task| {
        kernels.arch.dispatch(ProductPanels {
            x,
            rows,
            w,
            first: task.first,
            out: &mut *task.panels,
        });
        for (i, row) in task.columns.iter_mut().enumerate() {
            for (p, cols) in row.chunks_mut(NR).enumerate() {
                let start = p * panel_floats + i * NR;
                cols.copy_from_slice(&task.panels[start..start + cols.len()]);
            }
            if let Some(bias) = bias {
                for (o, b) in row.iter_mut().zip(&bias[task.first * NR..]) {
                    *o += b;
                }
            }
            if let Some(then) = then {
                then(i, task.first * NR, row);
            }
        }
    });
}

/// One task of [`matmul`]: panels `first..` of the product into `panels` (panel-major), then
/// their columns of every output row.
struct PanelTask<'a> {
    first: usize,
    panels: &'a mut [f32],
    columns: Vec<&'a mut [f32]>,
}

/// [`product_panels`] as a [`pulp::WithSimd`] operation: a named type (not a closure) is what
/// gets the kernel compiled with the CPU's vector and FMA instructions (through a closure, every
/// `mul_add` became a library call, 60 times slower).
struct ProductPanels<'a> {
    x: &'a [f32],
    rows: usize,
    w: &'a Packed,
    first: usize,
    out: &'a mut [f32],
}

impl pulp::WithSimd for ProductPanels<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) {
        product_panels(self.x, self.rows, self.w, self.first, self.out);
    }
}

/// Panels `first..first + out.len() / (rows * 16)` of the product, panel-major into `out`.
#[inline(always)]
fn product_panels(x: &[f32], rows: usize, w: &Packed, first: usize, out: &mut [f32]) {
    let k = w.in_dim;
    let count = out.len() / (rows * NR);
    let mut k0 = 0;
    loop {
        let k1 = (k0 + KC).min(k);
        let fresh = k0 == 0;
        let mut q0 = 0;
        while q0 < count {
            let q1 = (q0 + GROUP).min(count);
            let mut i = 0;
            while i + MR <= rows {
                for q in q0..q1 {
                    let o = &mut out[q * rows * NR + i * NR..];
                    tile::<MR>(&x[i * k..], k, w.panel(first + q), k0, k1, o, fresh);
                }
                i += MR;
            }
            let rest = Span {
                x: &x[i * k..],
                k,
                w,
                first,
                rows,
                k0,
                k1,
                fresh,
            };
            match rows - i {
                0 => {}
                1 => rest.tiles::<1, 4>(q0, q1, &mut out[i * NR..]),
                2 => rest.tiles::<2, 2>(q0, q1, &mut out[i * NR..]),
                3 => rest.tiles::<3, 2>(q0, q1, &mut out[i * NR..]),
                4 => rest.tiles::<4, 1>(q0, q1, &mut out[i * NR..]),
                _ => rest.tiles::<5, 1>(q0, q1, &mut out[i * NR..]),
            }
            q0 = q1;
        }
        if k1 >= k {
            break;
        }
        k0 = k1;
    }
}

/// The last `< MR` rows of a product, over a group of panels.
struct Span<'a> {
    x: &'a [f32],
    k: usize,
    w: &'a Packed,
    first: usize,
    rows: usize,
    k0: usize,
    k1: usize,
    fresh: bool,
}

impl Span<'_> {
    /// Panels `q0..q1` for `R` rows, `P` panels at a time where possible.
    #[inline(always)]
    fn tiles<const R: usize, const P: usize>(&self, q0: usize, q1: usize, out: &mut [f32]) {
        let stride = self.rows * NR;
        let mut q = q0;
        if P > 1 {
            while q + P <= q1 {
                let panels = &self.w.data[(self.first + q) * self.k * NR..];
                wide_tile::<R, P>(self, panels, &mut out[q * stride..]);
                q += P;
            }
        }
        while q < q1 {
            let panel = self.w.panel(self.first + q);
            tile::<R>(
                self.x,
                self.k,
                panel,
                self.k0,
                self.k1,
                &mut out[q * stride..],
                self.fresh,
            );
            q += 1;
        }
    }
}

/// `R` rows by one panel over features `k0..k1`; `out` holds the rows' 16 columns at stride 16.
#[inline(always)]
fn tile<const R: usize>(
    x: &[f32],
    k: usize,
    panel: &[f32],
    k0: usize,
    k1: usize,
    out: &mut [f32],
    fresh: bool,
) {
    let len = k1 - k0;
    let rows: [&[f32]; R] = std::array::from_fn(|r| &x[r * k + k0..r * k + k0 + len]);
    let mut acc = [[0.0f32; NR]; R];
    if !fresh {
        for (r, a) in acc.iter_mut().enumerate() {
            a.copy_from_slice(&out[r * NR..(r + 1) * NR]);
        }
    }
    for (idx, b) in panel[k0 * NR..k1 * NR].chunks_exact(NR).enumerate() {
        for r in 0..R {
            let xv = rows[r][idx];
            for j in 0..NR {
                acc[r][j] = xv.mul_add(b[j], acc[r][j]);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        out[r * NR..(r + 1) * NR].copy_from_slice(a);
    }
}

/// `R` rows by `P` adjacent panels: more independent chains for one or two rows.
#[inline(always)]
fn wide_tile<const R: usize, const P: usize>(span: &Span<'_>, panels: &[f32], out: &mut [f32]) {
    let (k, k0, k1) = (span.k, span.k0, span.k1);
    let len = k1 - k0;
    let stride = span.rows * NR;
    let rows: [&[f32]; R] = std::array::from_fn(|r| &span.x[r * k + k0..r * k + k0 + len]);
    let bs: [&[[f32; NR]]; P] = std::array::from_fn(|q| {
        bytemuck::cast_slice::<f32, [f32; NR]>(&panels[q * k * NR + k0 * NR..q * k * NR + k1 * NR])
    });
    let mut acc = [[[0.0f32; NR]; P]; R];
    if !span.fresh {
        for (r, row) in acc.iter_mut().enumerate() {
            for (q, a) in row.iter_mut().enumerate() {
                a.copy_from_slice(&out[q * stride + r * NR..q * stride + (r + 1) * NR]);
            }
        }
    }
    for (idx, b0) in bs[0].iter().enumerate() {
        for q in 0..P {
            let b = if q == 0 { b0 } else { &bs[q][idx] };
            for r in 0..R {
                let xv = rows[r][idx];
                for j in 0..NR {
                    acc[r][q][j] = xv.mul_add(b[j], acc[r][q][j]);
                }
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (q, a) in row.iter().enumerate() {
            out[q * stride + r * NR..q * stride + (r + 1) * NR].copy_from_slice(a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, rng: &mut rand_chacha::ChaCha8Rng) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// The chain of the module docs, written out plainly.
    fn reference(x: &[f32], weight: &[f32], bias: &[f32], k: usize, n: usize) -> Vec<f32> {
        x.chunks_exact(k)
            .flat_map(|row| {
                (0..n).map(move |o| {
                    let mut c = 0.0f32;
                    for (i, &xv) in row.iter().enumerate() {
                        c = xv.mul_add(weight[o * k + i], c);
                    }
                    c + bias[o]
                })
            })
            .collect()
    }

    /// The jobs a region of `items` items is cut into, in the order the threads take them.
    fn check_jobs(threads: usize, jobs: usize, (items, min): (usize, usize), expected: &[usize]) {
        let kernels = Kernels {
            threads,
            jobs_per_thread: jobs,
            ..Kernels::single()
        };
        let sizes = kernels.job_sizes(items, min);
        assert_eq!(
            sizes, expected,
            "threads={threads} jobs={jobs} items={items} min={min}"
        );
    }

    #[test]
    fn jobs_are_capped_and_shrink_to_the_minimum() {
        // One thread, or no more items than a job's minimum: one job.
        check_jobs(1, 8, (32, 1), &[32]);
        check_jobs(2, 8, (4, 4), &[4]);
        // At most 1 / (jobs * threads) of the items, and at most 1 / (2 * threads) of what is
        // left, at least `min` (but the last).
        check_jobs(
            2,
            8,
            (32, 1),
            &[2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1],
        );
        check_jobs(2, 8, (32, 4), &[4; 8]);
        check_jobs(2, 8, (13, 1), &[1; 13]);
        check_jobs(2, 1, (13, 1), &[4, 3, 2, 1, 1, 1, 1]);
        check_jobs(2, 1, (32, 4), &[8, 6, 5, 4, 4, 4, 1]);
        check_jobs(3, 2, (13, 1), &[3, 2, 2, 1, 1, 1, 1, 1, 1]);
    }

    /// Every job runs exactly once, whatever the threads and the split.
    #[test]
    fn every_job_runs_once() {
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for jobs in [1, JOBS_PER_THREAD] {
                let kernels = Kernels {
                    threads,
                    jobs_per_thread: jobs,
                    ..Kernels::single()
                };
                let mut data: Vec<f32> = vec![0.0; 7 * 5 + 3];
                let mut counts = vec![0u32; 50];
                pool.install(|| {
                    kernels.for_each_chunk(&mut data, 5, |i, chunk| {
                        chunk.iter_mut().for_each(|v| *v += i as f32 + 1.0)
                    });
                    kernels.for_each_task(&mut counts, |c| *c += 1);
                    kernels.for_each_uneven_task(&mut counts[..3], |c| *c += 1);
                });
                let expected: Vec<f32> = (0..data.len()).map(|j| (j / 5) as f32 + 1.0).collect();
                assert_eq!(data, expected, "threads={threads} jobs={jobs}");
                assert_eq!(counts[..3], [2; 3]);
                assert_eq!(counts[3..], [1; 47]);
            }
        }
    }

    /// Every row count (crossing the 6-row tile and the 1-3 row wide tiles), every thread count,
    /// every split into column tasks and every k-blocking give exactly the plain fused chain.
    /// Shapes cross the 16-column panel, the 4-panel groups and the 256-deep k-blocks; 196
    /// columns (13 panels) on 2 or 3 threads make several tasks, the last one shorter.
    #[test]
    fn product_is_the_plain_chain_for_any_rows_and_threads() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for &(k, n) in &[(64, 196), (300, 70), (17, 9), (513, 33)] {
            let weight = random(n * k, &mut rng);
            let bias = random(n, &mut rng);
            let w = Packed::from_rows(&weight, n, k);
            let mut back = Vec::new();
            w.rows_into(&mut back);
            assert_eq!(back, weight);
            let rows = 14;
            let x = random(rows * k, &mut rng);
            let expected = reference(&x, &weight, &bias, k, n);
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                for jobs_per_thread in [1, 2, JOBS_PER_THREAD] {
                    let kernels = Kernels {
                        threads,
                        jobs_per_thread,
                        ..Kernels::single()
                    };
                    for m in [1usize, 2, 3, 4, 5, 6, 7, 13, 14] {
                        let mut out = vec![0.0; m * n];
                        let mut tmp = Vec::new();
                        pool.install(|| {
                            matmul(&kernels, &x, m, &w, Some(&bias), &mut tmp, &mut out, None)
                        });
                        assert!(
                            out.iter()
                                .zip(&expected)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "k={k} n={n} rows={m} threads={threads} jobs={jobs_per_thread}"
                        );
                    }
                }
            }
        }
    }
}
