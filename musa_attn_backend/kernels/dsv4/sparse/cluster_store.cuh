// Device functions the clustered scheduled program (sched_kernel.py, `cluster`) calls with T.call_extern: stores
// into the shared memory of the other CTA of a cluster of two, each completing its bytes on that CTA's mbarrier
// (PTX st.async ... mbarrier::complete_tx; CUDA sm_90+). `local` and `bar` are addresses in this CTA's shared
// memory: the peer's buffers and barriers sit at the same addresses in its own.
#pragma once

__device__ __forceinline__ unsigned musa_attn_peer_addr(void* local, unsigned rank) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(s), "r"(rank));
  return r;
}

// 16 bytes: four 32-bit words
__device__ __forceinline__ void musa_attn_st_async_v4(void* local, unsigned rank, unsigned w0, unsigned w1,
                                                       unsigned w2, unsigned w3, void* bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
               :: "r"(musa_attn_peer_addr(local, rank)), "r"(w0), "r"(w1), "r"(w2), "r"(w3),
                  "r"(musa_attn_peer_addr(bar, rank)) : "memory");
}

// 4 bytes: one 32-bit word
__device__ __forceinline__ void musa_attn_st_async_b32(void* local, unsigned rank, unsigned w, void* bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
               :: "r"(musa_attn_peer_addr(local, rank)), "r"(w), "r"(musa_attn_peer_addr(bar, rank)) : "memory");
}
