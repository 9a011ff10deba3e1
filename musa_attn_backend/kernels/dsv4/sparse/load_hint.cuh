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
