// A device function the scheduled program's producer (rows.py, `load_hint`) calls with T.call_extern: a 16-byte
// read-only load from global memory with an L1 evict-last hint and a 256-byte L2 prefetch (PTX ld.global.nc with
// .L1::evict_last and .L2::256B; CUDA sm_75+). A cache row's 576 data bytes are read by four lanes in 64-byte
// steps, so the prefetch brings the row's next steps into L2 with its first. `dst` is a 16-byte-aligned local array
// element (registers once inlined with constant indices).
#pragma once

__device__ __forceinline__ void musa_attn_ld16_hint(int* dst, const void* src) {
  int4 r;
  asm volatile("ld.global.nc.L1::evict_last.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(src));
  *reinterpret_cast<int4*>(dst) = r;
}

// `bytes` (a multiple of 16) from the 16-byte-aligned global address `src` into L2, asynchronously (PTX
// cp.async.bulk.prefetch.L2; CUDA sm_90+): the producer's request for a later tile's cache row, which holds no
// register and completes on its own.
__device__ __forceinline__ void musa_attn_prefetch_l2(const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(src), "r"(bytes) : "memory");
}

// An L2 cache policy that keeps the lines it covers longer than the default (PTX createpolicy, fraction 1.0;
// CUDA sm_80+): the paired_ws producer's key rows, which many tokens of a prefill read again, beside query and
// output rows that stream through once.
__device__ __forceinline__ unsigned long long musa_attn_evict_last_policy() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// 16 bytes from global `src` into shared `dst` by cp.async (L1 bypassed), under the L2 cache policy `policy`
// and with a 256-byte L2 prefetch; where `pred` is 0 nothing is read and `dst` gets zeros (the copy's source
// size 0). Completes like TileLang's own cp.async (an mbarrier's cp.async arrive, or cp.async.wait_group).
__device__ __forceinline__ void musa_attn_cp_async16_hint(void* dst, const void* src, int pred,
                                                          unsigned long long policy) {
  unsigned dst_addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;"
               :: "r"(dst_addr), "l"(src), "r"(pred ? 16 : 0), "l"(policy) : "memory");
}

// The same copy from row `row` of a row-major table whose rows are `row_bytes` long, at `byte_off` bytes into the
// row, where `lane_base` is this thread's column of row 0 (loop-invariant): one wide multiply-add an address and
// the half's offset an immediate, where an element index would be recomputed in 64 bits for every copy.
__device__ __forceinline__ void musa_attn_cp_async16_row(void* dst, const void* lane_base, int row, unsigned row_bytes,
                                                         int byte_off, int pred, unsigned long long policy) {
  const char* src = static_cast<const char*>(lane_base) + static_cast<size_t>(static_cast<unsigned>(row)) * row_bytes
                    + byte_off;
  musa_attn_cp_async16_hint(dst, src, pred, policy);
}

// The int32 at `base[i]` through the read-only path (`base` this token's first entry, computed once).
__device__ __forceinline__ int musa_attn_ldg_i32(const int* base, int i) { return __ldg(base + i); }
