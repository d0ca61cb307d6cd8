// SIMT emulation: compiles the CUDA C kernels of this folder as C++ on the host (SimRuntime).
//
// What it provides, and how:
// - threadIdx / blockIdx / blockDim / gridDim, warpSize.
// - One block at a time per OS thread. Every CUDA thread of the block is a fiber with its own
//   stack (on x86-64 a register-only context switch, elsewhere ucontext), and the block's fibers
//   are scheduled cooperatively on the OS thread that runs
//   the block. A fiber runs until it reaches a barrier or exits, so threads really interleave at
//   __syncthreads and at warp operations, and only there (like a GPU where each phase between
//   barriers may run in any order).
// - __syncthreads: a barrier among the block's live threads (an exited thread counts as arrived,
//   as on Volta and later). A barrier that can never complete (some threads exited or wait at a
//   different barrier forever) is detected and reported as a launch error, not a hang.
// - Warp operations (__shfl*_sync, __ballot_sync, __any_sync, __all_sync, __syncwarp): a barrier
//   among the live lanes of the warp with a double-buffered exchange slot per lane, so one
//   barrier per operation suffices. All live lanes of a warp must take part (full-warp masks),
//   which is how every kernel here uses them.
// - __shared__ is block-private storage: a `static thread_local` variable, since one OS thread
//   runs one block at a time. Dynamic shared memory is `SIM_DYNAMIC_SHARED` in common.cuh.
// - Atomics on the GCC builtins (blocks may run on different OS threads), the math intrinsics the
//   kernels use (exact host versions of the fast intrinsics), bit casts.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>

#include <type_traits>
#include <utility>
#include <vector>

struct uint3 {
    unsigned int x, y, z;
};

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
        : x(x_), y(y_), z(z_) {}
};

namespace simt {

// Launch error codes, mirrored by `raw::sim` on the Rust side.
constexpr int OK = 0;
constexpr int BAD_CONFIG = 1;
constexpr int DEADLOCK = 2;
constexpr int NO_MEMORY = 3;

constexpr unsigned int WARP = 32;
constexpr size_t STACK_BYTES = 64 * 1024;
constexpr unsigned int MAX_THREADS = 1024;
constexpr unsigned int MAX_DYNAMIC_SHARED = 227 * 1024;

enum class State : int { Runnable, BlockBarrier, WarpBarrier, Done };

#if defined(__x86_64__)
// A context switch without the signal-mask system calls of swapcontext (which dominate the
// emulation's time otherwise): saves the callee-saved registers, MXCSR and the x87 control word
// on the current stack, stores the stack pointer to *from, and resumes the context whose stack
// pointer is `to`. Weak: every kernel file's translation unit carries a copy, the linker keeps one.
extern "C" void simt_switch(void** from, void* to);
asm(R"(
    .text
    .weak simt_switch
    .type simt_switch, @function
simt_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size simt_switch, .-simt_switch
)");
struct Context {
    void* sp = nullptr;
};
#else
struct Context {
    ucontext_t uc;
};
#endif

struct Fiber {
    Context context;
    uint3 thread_idx;
    unsigned int linear;
    State state;
};

struct Warp {
    unsigned int arrived;
    unsigned int live;
    unsigned int generation;
    unsigned long long slots[2][WARP];
};

struct Block {
    dim3 grid_dim;
    dim3 block_dim;
    uint3 block_idx;
    unsigned int live;
    unsigned int arrived;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    void (*entry)(void*);
    void* closure;
    Context scheduler;
};

// Per OS thread: the block it runs, the fiber running now, reusable stacks, dynamic shared memory.
struct Thread {
    Block* block = nullptr;
    Fiber* fiber = nullptr;
    std::vector<std::vector<unsigned char>> stacks;
    std::vector<unsigned char> dynamic_shared;
};

inline thread_local Thread current;

#if defined(__x86_64__)
inline void switch_to(Context& from, Context& to) { simt_switch(&from.sp, to.sp); }
#else
inline void switch_to(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

inline void yield() { switch_to(current.fiber->context, current.block->scheduler); }

inline void release_block(Block* b) {
    b->arrived = 0;
    for (Fiber& f : b->fibers) {
        if (f.state == State::BlockBarrier) f.state = State::Runnable;
    }
}

inline void release_warp(Block* b, unsigned int warp) {
    Warp& w = b->warps[warp];
    w.arrived = 0;
    w.generation += 1;
    unsigned int first = warp * WARP;
    unsigned int last = first + WARP < b->fibers.size() ? first + WARP : (unsigned int)b->fibers.size();
    for (unsigned int i = first; i < last; ++i) {
        if (b->fibers[i].state == State::WarpBarrier) b->fibers[i].state = State::Runnable;
    }
}

inline void syncthreads() {
    Block* b = current.block;
    b->arrived += 1;
    if (b->arrived == b->live) {
        release_block(b);
        return;
    }
    current.fiber->state = State::BlockBarrier;
    yield();
}

inline void syncwarp() {
    Block* b = current.block;
    unsigned int warp = current.fiber->linear / WARP;
    Warp& w = b->warps[warp];
    w.arrived += 1;
    if (w.arrived == w.live) {
        release_warp(b, warp);
        return;
    }
    current.fiber->state = State::WarpBarrier;
    yield();
}

inline void fiber_main() {
    Block* b = current.block;
    b->entry(b->closure);
    // The thread exits: it no longer holds back the block's or its warp's barriers.
    Fiber* f = current.fiber;
    f->state = State::Done;
    b->live -= 1;
    if (b->arrived > 0 && b->arrived == b->live) release_block(b);
    unsigned int warp = f->linear / WARP;
    Warp& w = b->warps[warp];
    w.live -= 1;
    if (w.arrived > 0 && w.arrived == w.live) release_warp(b, warp);
#if defined(__x86_64__)
    // Back to the scheduler for good: this fiber is never resumed.
    switch_to(f->context, b->scheduler);
#endif
    // (ucontext: returning resumes `uc_link`, the scheduler.)
}

// Prepares `f` to start in fiber_main on `stack`.
inline bool start_fiber(Fiber& f, std::vector<unsigned char>& stack, Block& b) {
#if defined(__x86_64__)
    (void)b;
    // The frame simt_switch pops: MXCSR and x87 control word, six registers, then the return
    // address fiber_main; `top` is 16-aligned, so fiber_main starts with rsp = 8 mod 16 as after
    // a call.
    uintptr_t top = ((uintptr_t)stack.data() + stack.size()) & ~(uintptr_t)15;
    void** frame = (void**)(top - 72);
    unsigned int control[2];
    asm volatile("stmxcsr %0" : "=m"(control[0]));
    asm volatile("fnstcw %0" : "=m"(control[1]));
    memcpy(&frame[0], control, 8);
    for (int i = 1; i <= 6; ++i) frame[i] = nullptr;
    frame[7] = (void*)&fiber_main;
    frame[8] = nullptr;
    f.context.sp = frame;
    return true;
#else
    if (getcontext(&f.context.uc) != 0) return false;
    f.context.uc.uc_stack.ss_sp = stack.data();
    f.context.uc.uc_stack.ss_size = stack.size();
    f.context.uc.uc_link = &b.scheduler.uc;
    makecontext(&f.context.uc, fiber_main, 0);
    return true;
#endif
}

// Runs one block: every thread as a fiber, round robin until all are done.
inline int run_block(Block& b) {
    unsigned int threads = b.block_dim.x * b.block_dim.y * b.block_dim.z;
    if (current.stacks.size() < threads) current.stacks.resize(threads);
    b.fibers.resize(threads);
    b.warps.assign((threads + WARP - 1) / WARP, Warp{});
    for (unsigned int w = 0; w < b.warps.size(); ++w) {
        unsigned int rest = threads - w * WARP;
        b.warps[w].live = rest < WARP ? rest : WARP;
    }
    b.live = threads;
    b.arrived = 0;
    current.block = &b;
    for (unsigned int i = 0; i < threads; ++i) {
        Fiber& f = b.fibers[i];
        std::vector<unsigned char>& stack = current.stacks[i];
        if (stack.size() < STACK_BYTES) stack.resize(STACK_BYTES);
        f.linear = i;
        f.thread_idx.x = i % b.block_dim.x;
        f.thread_idx.y = (i / b.block_dim.x) % b.block_dim.y;
        f.thread_idx.z = i / (b.block_dim.x * b.block_dim.y);
        f.state = State::Runnable;
        if (!start_fiber(f, stack, b)) return NO_MEMORY;
    }
    unsigned int done = 0;
    while (done < threads) {
        bool progress = false;
        done = 0;
        for (unsigned int i = 0; i < threads; ++i) {
            Fiber& f = b.fibers[i];
            if (f.state == State::Runnable) {
                current.fiber = &f;
                switch_to(b.scheduler, f.context);
                progress = true;
            }
            if (f.state == State::Done) done += 1;
        }
        if (!progress && done < threads) {
            current.block = nullptr;
            current.fiber = nullptr;
            return DEADLOCK;
        }
    }
    current.block = nullptr;
    current.fiber = nullptr;
    return OK;
}

// Runs every block of a grid, one after another, calling `entry(closure)` on each thread.
inline int run_grid(dim3 grid, dim3 block, unsigned int shared_bytes, void (*entry)(void*), void* closure) {
    unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
    if (threads == 0 || threads > MAX_THREADS || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
        block.z > 64 || grid.y > 65535 || grid.z > 65535 || shared_bytes > MAX_DYNAMIC_SHARED) {
        return BAD_CONFIG;
    }
    if (current.dynamic_shared.size() < shared_bytes) current.dynamic_shared.resize(shared_bytes);
    Block b;
    b.grid_dim = grid;
    b.block_dim = block;
    b.entry = entry;
    b.closure = closure;
    for (unsigned int z = 0; z < grid.z; ++z) {
        for (unsigned int y = 0; y < grid.y; ++y) {
            for (unsigned int x = 0; x < grid.x; ++x) {
                b.block_idx = uint3{x, y, z};
                int status = run_block(b);
                if (status != OK) return status;
            }
        }
    }
    return OK;
}

inline void* dynamic_shared() { return current.dynamic_shared.data(); }

// Unpacks CUDA-style kernel parameters (`args[i]` points at parameter i) and calls the kernel.
template <typename... Params>
struct Call {
    void (*kernel)(Params...);
    void* const* args;

    template <size_t... I>
    void invoke(std::index_sequence<I...>) {
        kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<Params>>*>(args[I])...);
    }

    static void entry(void* self) {
        static_cast<Call*>(self)->invoke(std::index_sequence_for<Params...>{});
    }
};

template <typename... Params>
int launch(void (*kernel)(Params...), dim3 grid, dim3 block, unsigned int shared_bytes, void* const* args) {
    Call<Params...> call{kernel, args};
    return run_grid(grid, block, shared_bytes, &Call<Params...>::entry, &call);
}

template <typename T>
inline T exchange(T value, unsigned int source, bool valid) {
    static_assert(sizeof(T) <= sizeof(unsigned long long), "warp exchange of a value wider than 8 bytes");
    Block* b = current.block;
    unsigned int lane = current.fiber->linear % WARP;
    Warp& w = b->warps[current.fiber->linear / WARP];
    unsigned int parity = w.generation & 1u;
    unsigned long long bits = 0;
    memcpy(&bits, &value, sizeof(T));
    w.slots[parity][lane] = bits;
    syncwarp();
    if (!valid) return value;
    T out;
    bits = w.slots[parity][source];
    memcpy(&out, &bits, sizeof(T));
    return out;
}

inline unsigned int lane_id() { return current.fiber->linear % WARP; }

inline unsigned int warp_lanes() {
    Block* b = current.block;
    unsigned int first = (current.fiber->linear / WARP) * WARP;
    unsigned int rest = (unsigned int)b->fibers.size() - first;
    return rest < WARP ? rest : WARP;
}

inline unsigned int vote(bool predicate) {
    unsigned int lane = lane_id();
    unsigned int bit = predicate ? (1u << lane) : 0u;
    Block* b = current.block;
    Warp& w = b->warps[current.fiber->linear / WARP];
    unsigned int parity = w.generation & 1u;
    w.slots[parity][lane] = bit;
    syncwarp();
    unsigned int ballot = 0;
    unsigned int lanes = warp_lanes();
    unsigned int first = (current.fiber->linear / WARP) * WARP;
    for (unsigned int i = 0; i < lanes; ++i) {
        if (b->fibers[first + i].state != State::Done) ballot |= (unsigned int)w.slots[parity][i];
    }
    return ballot;
}

}  // namespace simt

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static thread_local

#define threadIdx (::simt::current.fiber->thread_idx)
#define blockIdx (::simt::current.block->block_idx)
#define blockDim (::simt::current.block->block_dim)
#define gridDim (::simt::current.block->grid_dim)
constexpr int warpSize = 32;

inline void __syncthreads() { simt::syncthreads(); }
inline void __syncwarp(unsigned int mask = 0xffffffffu) {
    (void)mask;
    simt::syncwarp();
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

template <typename T>
inline T __shfl_sync(unsigned int mask, T value, int source, int width = warpSize) {
    (void)mask;
    unsigned int lane = simt::lane_id();
    unsigned int base = lane - lane % (unsigned int)width;
    unsigned int src = base + ((unsigned int)source % (unsigned int)width);
    return simt::exchange(value, src, src < simt::warp_lanes());
}

template <typename T>
inline T __shfl_down_sync(unsigned int mask, T value, unsigned int delta, int width = warpSize) {
    (void)mask;
    unsigned int lane = simt::lane_id();
    unsigned int in_segment = lane % (unsigned int)width;
    unsigned int src = lane + delta;
    bool valid = in_segment + delta < (unsigned int)width && src < simt::warp_lanes();
    return simt::exchange(value, src, valid);
}

template <typename T>
inline T __shfl_up_sync(unsigned int mask, T value, unsigned int delta, int width = warpSize) {
    (void)mask;
    unsigned int lane = simt::lane_id();
    unsigned int in_segment = lane % (unsigned int)width;
    bool valid = in_segment >= delta;
    return simt::exchange(value, valid ? lane - delta : lane, valid);
}

template <typename T>
inline T __shfl_xor_sync(unsigned int mask, T value, int lane_mask, int width = warpSize) {
    (void)mask;
    unsigned int lane = simt::lane_id();
    unsigned int src = lane ^ (unsigned int)lane_mask;
    bool valid = src / (unsigned int)width == lane / (unsigned int)width && src < simt::warp_lanes();
    return simt::exchange(value, src, valid);
}

inline unsigned int __ballot_sync(unsigned int mask, int predicate) { return simt::vote(predicate != 0) & mask; }
inline int __any_sync(unsigned int mask, int predicate) { return (simt::vote(predicate != 0) & mask) != 0; }
inline int __all_sync(unsigned int mask, int predicate) {
    unsigned int ballot = simt::vote(predicate != 0);
    unsigned int lanes = simt::warp_lanes();
    unsigned int full = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
    return (ballot & mask & full) == (mask & full);
}

inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
inline float __uint_as_float(unsigned int x) { float f; memcpy(&f, &x, 4); return f; }
inline unsigned int __float_as_uint(float x) { unsigned int i; memcpy(&i, &x, 4); return i; }
inline int __popc(unsigned int x) { return __builtin_popcount(x); }

// The fast intrinsics are exact on the host; a GPU result may differ in the last bits.
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

template <typename T>
inline T __ldg(const T* p) { return *p; }

inline int atomicAdd(int* a, int v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicAdd(unsigned int* a, unsigned int v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);
}
inline float atomicAdd(float* a, float v) {
    unsigned int* bits = reinterpret_cast<unsigned int*>(a);
    unsigned int old = __atomic_load_n(bits, __ATOMIC_SEQ_CST);
    for (;;) {
        unsigned int next = __float_as_uint(__uint_as_float(old) + v);
        if (__atomic_compare_exchange_n(bits, &old, next, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            return __uint_as_float(old);
        }
    }
}
inline int atomicMax(int* a, int v) {
    int old = __atomic_load_n(a, __ATOMIC_SEQ_CST);
    while (old < v && !__atomic_compare_exchange_n(a, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
inline unsigned int atomicMax(unsigned int* a, unsigned int v) {
    unsigned int old = __atomic_load_n(a, __ATOMIC_SEQ_CST);
    while (old < v && !__atomic_compare_exchange_n(a, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
inline int atomicMin(int* a, int v) {
    int old = __atomic_load_n(a, __ATOMIC_SEQ_CST);
    while (old > v && !__atomic_compare_exchange_n(a, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
inline unsigned int atomicMin(unsigned int* a, unsigned int v) {
    unsigned int old = __atomic_load_n(a, __ATOMIC_SEQ_CST);
    while (old > v && !__atomic_compare_exchange_n(a, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
template <typename T>
inline T atomicCAS(T* a, T compare, T value) {
    __atomic_compare_exchange_n(a, &compare, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}
template <typename T>
inline T atomicExch(T* a, T value) { return __atomic_exchange_n(a, value, __ATOMIC_SEQ_CST); }
inline float atomicExch(float* a, float value) {
    unsigned int old = __atomic_exchange_n(reinterpret_cast<unsigned int*>(a), __float_as_uint(value), __ATOMIC_SEQ_CST);
    return __uint_as_float(old);
}
