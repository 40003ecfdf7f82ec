// B12 decode GEMM for few rows of x (M <= 16), in CUDA C++: an experiment for issue 21 (benchmarks/gpu_b12_cuda.py
// builds, checks and times it). y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), W held as B12 planes whose
// sign/mantissa bytes and codes are laid out per MMA fragment (gpu_b12_cuda.fragments), so that each lane loads
// the bytes of its own A-fragment elements contiguously and decodes them straight into the registers
// mma.sync takes: no shared-memory round trip of the decoded tile and no barrier, unlike the Triton kernel.
//
// One warp owns 16 rows of W (a row tile) and walks all of K in order, 64 columns (four k16 steps) a chunk,
// feeding one fp32 accumulator mma.sync.m16n8k16 steps in K order: the sums the Triton invariant GEMM makes
// (its 16-row tiles run the same instruction; its wide tiles' wgmma gave the same bits on the H100), so the
// rows come out bitwise equal to invariant_gemm on the decoded matrix — what the benchmark checks first.
// Each lane streams its own 48 bytes a chunk (32 of sign/mantissa, 16 of codes) through a private ring of
// cp.async stages in shared memory; no lane reads another's, so no barrier is needed.
//
// Fragment layout (m16n8k16, A row-major): lane l = 4 * g + q holds rows g and g + 8, columns 2q, 2q + 1 and
// 2q + 8, 2q + 9 of each k16 step. For row tile t, chunk c, lane l: sign/mantissa word 2s + j (k16 step s,
// column half j) holds bytes b = 2 * h + e: row 16t + g + 8h, column 64c + 16s + 8j + 2q + e; code byte 4s + b
// holds that weight's code for j = 0 in its low nibble and for j = 1 in its high one.
//
// The second form (`rows8`) puts W in the MMA's B operand instead (x rows in A): a warp owns 8 rows of W, so a
// weight has twice the warps, each decoding four weights a k16 step (lane 4g + q: row g, columns 2q, 2q + 1,
// 2q + 8, 2q + 9). For row tile t (8 rows), 128-column chunk c, lane l: sign/mantissa word s (k16 step) holds
// bytes b = 2j + e: column 128c + 16s + 8j + 2q + e; code word p holds step 2p's codes in its bytes' low nibbles
// and step 2p + 1's in their high ones. The MMA sums a product the same with its operands swapped (the H100 run
// found both forms bitwise the bf16 kernel).
//
// Both forms as first written run each chunk in order — ring read, decode, x's fragments, then the chained MMAs —
// and with one warp a block and a few warps an SM nothing hides that chain (the H100: slower than the Triton
// kernel). The 8-row form's pipelined variant keeps two register sets of operands and issues chunk c + 1's ring
// read, x fragments and decode among chunk c's MMAs in one basic block.

#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int kChunk = 64;        // columns a chunk: four k16 steps
constexpr int kLaneBytes = 48;    // a lane's bytes a chunk: 32 sign/mantissa, 16 codes
constexpr int kBlock = 256;       // columns of a code block (alt exponents, escape segments)
constexpr int kGroup = 256;       // rows whose escape segments are numbered together
constexpr int kSegmentRows = 16;  // rows an escape segment holds: one row tile

// What a launch reads and writes: x [m, k] (row stride stride_xm), the planes (sign/mantissa and codes in the
// form's fragment order), bias [n] or null, out [m, n] (row stride stride_om). Read-only data is read through the
// non-coherent cache (__ldg) or cp.async.
struct Operands {
  const __nv_bfloat16* x;
  const uint8_t* sm_frag;
  const uint8_t* code_frag;
  const uint8_t* base;
  const uint8_t* alt;
  const int32_t* exc_off;
  const int32_t* exc;
  const __nv_bfloat16* bias;
  __nv_bfloat16* out;
  int m, n, k;
  long stride_xm, stride_om;
};

// Four weights from their sign/mantissa bytes and code bytes, byte lane i each (base and alt exponents as byte
// lanes too): bf16 pairs of lanes 0, 1 and of lanes 2, 3. Code 15 takes the alt exponent.
__device__ __forceinline__ void decode4(uint32_t sm, uint32_t cod, uint32_t base4, uint32_t alt4, uint32_t& pair01,
                                        uint32_t& pair23) {
  asm("{\n"
      " .reg .b32 flg, msk, ex, hib, lob;\n"
      " add.u32 flg, %2, 0x71717171;\n"
      " prmt.b32 msk, flg, 0, 0xBA98;\n"
      " add.u32 ex, %2, %4;\n"
      " lop3.b32 ex, ex, %5, msk, 0xD8;\n"
      " shr.b32 hib, ex, 1;\n"
      " lop3.b32 hib, %3, hib, 0x80808080, 0xE4;\n"
      " shl.b32 lob, ex, 7;\n"
      " lop3.b32 lob, lob, %3, 0x80808080, 0xE4;\n"
      " prmt.b32 %0, lob, hib, 0x5140;\n"
      " prmt.b32 %1, lob, hib, 0x7362;\n"
      "}\n"
      : "=r"(pair01), "=r"(pair23)
      : "r"(cod), "r"(sm), "r"(base4), "r"(alt4));
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void copy16(uint32_t smem, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(global));
}

__device__ __forceinline__ uint32_t byte_lanes(uint32_t low_rows, uint32_t high_rows) {
  return low_rows * 0x0101u | high_rows * 0x01010000u;  // lanes 0, 1: row g; lanes 2, 3: row g + 8
}

// A hard escape (entry: bits << 16 | row % 256 << 8 | column % 256, of this tile's segment in the current block,
// whose first column is `offset` columns from the chunk's) written into the owning lane's decoded register, if
// it lies in this chunk. Constant indices throughout, so `a` stays in registers.
__device__ __forceinline__ void patch(uint32_t (&a)[4][4], int entry, int offset, int lane) {
  const int r = ((entry >> 8) & 0xFF) % kSegmentRows, kk = offset + (entry & 0xFF);
  if (kk < 0 || kk >= kChunk || (r & 7) * 4 + ((kk & 7) >> 1) != lane) return;
  const int which = (kk >> 4) * 4 + ((kk >> 3) & 1) * 2 + (r >> 3), half = kk & 1;  // step, half, row
  const uint32_t bits = static_cast<uint32_t>(entry) >> 16;
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (4 * s + i == which) a[s][i] = half ? (a[s][i] & 0x0000FFFFu) | (bits << 16) : (a[s][i] & 0xFFFF0000u) | bits;
}

// A lane's chunk c into its ring slot: 32 bytes of sign/mantissa, 16 of codes
template <int STAGES>
__device__ __forceinline__ void issue(uint32_t mine, const uint8_t* sm_src, const uint8_t* code_src, int c) {
  const uint32_t slot = mine + (c % STAGES) * 32 * kLaneBytes;  // a shared-memory address
  copy16(slot, sm_src + static_cast<long>(c) * 32 * 32);
  copy16(slot + 16, sm_src + static_cast<long>(c) * 32 * 32 + 16);
  copy16(slot + 32, code_src + static_cast<long>(c) * 32 * 16);
}

// A lane's 48 bytes of chunk c as words, once its copy landed; the copy of chunk c + STAGES - 1 issued first
struct Chunk {
  uint32_t sm[8], code[4];
};

template <int STAGES>
__device__ __forceinline__ Chunk next_chunk(uint32_t mine_shared, const uint8_t* mine, const uint8_t* sm_src,
                                            const uint8_t* code_src, int c, int chunks) {
  if (c + STAGES - 1 < chunks) issue<STAGES>(mine_shared, sm_src, code_src, c + STAGES - 1);
  asm volatile("cp.async.commit_group;\n" ::);
  asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 1));
  const uint8_t* slot = mine + (c % STAGES) * 32 * kLaneBytes;
  const uint4 lo = *reinterpret_cast<const uint4*>(slot), hi = *reinterpret_cast<const uint4*>(slot + 16),
              codes = *reinterpret_cast<const uint4*>(slot + 32);
  return {{lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w}, {codes.x, codes.y, codes.z, codes.w}};
}

// The hard escapes of the 16-row segment holding row0, in code block `block`: [first, end) in exc
__device__ __forceinline__ int2 escape_range(const int32_t* exc_off, int row0, int blocks, int block) {
  const int segment = ((row0 / kGroup) * blocks + block) * (kGroup / kSegmentRows) + (row0 % kGroup) / kSegmentRows;
  return make_int2(__ldg(exc_off + segment), __ldg(exc_off + segment + 1));
}

// NT: n8 tiles of x rows (1: M <= 8, 2: M <= 16). STAGES: chunks in flight a lane.
template <int NT, int STAGES>
__global__ void __launch_bounds__(32) b12_gemv_kernel(const Operands p) {
  extern __shared__ __align__(16) uint8_t ring[];  // [STAGES][32 lanes][48 B]
  const int lane = threadIdx.x, g = lane >> 2, q = lane & 3;
  const int tile = blockIdx.x, row0 = tile * 16;
  const int chunks = p.k / kChunk, blocks = (p.k + kBlock - 1) / kBlock;
  const uint8_t* sm_src = p.sm_frag + (static_cast<long>(tile) * chunks * 32 + lane) * 32;
  const uint8_t* code_src = p.code_frag + (static_cast<long>(tile) * chunks * 32 + lane) * 16;
  const uint8_t* mine = ring + lane * kLaneBytes;
  const uint32_t mine_shared = static_cast<uint32_t>(__cvta_generic_to_shared(mine));

  for (int c = 0; c < STAGES - 1; ++c) {
    if (c < chunks) issue<STAGES>(mine_shared, sm_src, code_src, c);
    asm volatile("cp.async.commit_group;\n" ::);
  }

  // x's B fragments: row 8t + g of x, bf16 pairs at columns 2q, 2q + 1 (+ 8) of each k16 step; rows past M read
  // row 0 (a valid address, cached) and count as zeros
  const uint32_t* x_rows[NT];
  bool x_ok[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    x_ok[t] = 8 * t + g < p.m;
    x_rows[t] = reinterpret_cast<const uint32_t*>(p.x + (x_ok[t] ? 8 * t + g : 0) * p.stride_xm) + q;
  }
  const uint32_t base4 = byte_lanes(__ldg(p.base + row0 + g), __ldg(p.base + row0 + g + 8));
  uint32_t alt4 = 0;
  int2 escapes = make_int2(0, 0);  // this tile's hard escapes in the current block
  float acc[NT][4] = {};
  for (int c = 0; c < chunks; ++c) {
    const Chunk chunk = next_chunk<STAGES>(mine_shared, mine, sm_src, code_src, c, chunks);
    const int col0 = c * kChunk, block = col0 / kBlock;
    if (col0 % kBlock == 0) {  // a new code block: its alt exponents and escape segment
      const uint8_t* alts = p.alt + static_cast<long>(block) * p.n + row0 + g;
      alt4 = byte_lanes(__ldg(alts), __ldg(alts + 8));
      escapes = escape_range(p.exc_off, row0, blocks, block);
    }
    uint32_t a[4][4];  // per k16 step, the A fragment's four registers
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      decode4(chunk.sm[2 * s], chunk.code[s] & 0x0F0F0F0Fu, base4, alt4, a[s][0], a[s][1]);
      decode4(chunk.sm[2 * s + 1], (chunk.code[s] >> 4) & 0x0F0F0F0Fu, base4, alt4, a[s][2], a[s][3]);
    }
    for (int e = escapes.x; e < escapes.y; ++e) patch(a, __ldg(p.exc + e), block * kBlock - col0, lane);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
      for (int s = 0; s < 4; ++s)
        mma16816(acc[t], a[s], x_ok[t] ? __ldg(x_rows[t] + 8 * s) : 0u, x_ok[t] ? __ldg(x_rows[t] + 8 * s + 4) : 0u);
      x_rows[t] += kChunk / 2;  // the next chunk's columns
    }
  }
  asm volatile("cp.async.wait_all;\n" ::);

  const float b_lo = p.bias ? __bfloat162float(p.bias[row0 + g]) : 0.f;
  const float b_hi = p.bias ? __bfloat162float(p.bias[row0 + g + 8]) : 0.f;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int xr = 8 * t + 2 * q + (i & 1), wr = row0 + g + 8 * (i >> 1);
      if (xr < p.m) p.out[xr * p.stride_om + wr] = __float2bfloat16_rn(acc[t][i] + (i >> 1 ? b_hi : b_lo));
    }
  }
}

// The rows8 form: W's 8-row tile as the B operand, x's rows (M <= 16) as A; one MMA a k16 step for every M.
constexpr int kWide = 2 * kChunk;  // its chunk's columns: eight k16 steps, 32 + 16 bytes a lane

// A rows8 warp: its tile, lane, ring and x rows, and what it reads a chunk at a time
template <int STAGES, bool HI>
struct Warp8 {
  const Operands p;
  int g, q, row0, chunks, blocks;
  uint32_t base4, mine_shared;
  const uint8_t *mine, *sm_src, *code_src;
  bool lo_ok, hi_ok;
  const uint32_t *x_lo, *x_hi;

  __device__ __forceinline__ Warp8(const Operands& p_, uint8_t* ring) : p(p_) {
    const int lane = threadIdx.x, tile = blockIdx.x;
    g = lane >> 2, q = lane & 3, row0 = tile * 8;
    chunks = p.k / kWide, blocks = (p.k + kBlock - 1) / kBlock;
    sm_src = p.sm_frag + (static_cast<long>(tile) * chunks * 32 + lane) * 32;
    code_src = p.code_frag + (static_cast<long>(tile) * chunks * 32 + lane) * 16;
    mine = ring + lane * kLaneBytes;
    mine_shared = static_cast<uint32_t>(__cvta_generic_to_shared(mine));
    for (int c = 0; c < STAGES - 1; ++c) {
      if (c < chunks) issue<STAGES>(mine_shared, sm_src, code_src, c);
      asm volatile("cp.async.commit_group;\n" ::);
    }
    // x's A fragments: rows g and g + 8 (zero past M; row 0's address), columns 2q, 2q + 1 (+ 8) of each step
    lo_ok = g < p.m, hi_ok = HI && g + 8 < p.m;
    x_lo = reinterpret_cast<const uint32_t*>(p.x + (lo_ok ? g : 0) * p.stride_xm) + q;
    x_hi = reinterpret_cast<const uint32_t*>(p.x + (hi_ok ? g + 8 : 0) * p.stride_xm) + q;
    base4 = __ldg(p.base + row0 + g) * 0x01010101u;
  }

  // chunk c's bytes (its copy landed; chunk c + STAGES - 1's issued)
  __device__ __forceinline__ Chunk bytes(int c) const {
    return next_chunk<STAGES>(mine_shared, mine, sm_src, code_src, c, chunks);
  }

  // chunk c's x fragments, eight k16 steps
  __device__ __forceinline__ void load_x(uint32_t (&a)[8][4], int c) const {
    const uint32_t *lo = x_lo + c * (kWide / 2), *hi = x_hi + c * (kWide / 2);
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      a[s][0] = lo_ok ? __ldg(lo + 8 * s) : 0u;
      a[s][1] = HI && hi_ok ? __ldg(hi + 8 * s) : 0u;
      a[s][2] = lo_ok ? __ldg(lo + 8 * s + 4) : 0u;
      a[s][3] = HI && hi_ok ? __ldg(hi + 8 * s + 4) : 0u;
    }
  }

  // the alt exponents (byte lanes) of chunk c's code block
  __device__ __forceinline__ uint32_t alt4(int c) const {
    return __ldg(p.alt + static_cast<long>(c * kWide / kBlock) * p.n + row0 + g) * 0x01010101u;
  }

  // W's B fragment of k16 step s (two registers) from a chunk's bytes
  __device__ __forceinline__ void decode_step(uint32_t (&b)[2], const Chunk& chunk, int s, uint32_t alt) const {
    const uint32_t cod = s & 1 ? (chunk.code[s >> 1] >> 4) & 0x0F0F0F0Fu : chunk.code[s >> 1] & 0x0F0F0F0Fu;
    decode4(chunk.sm[s], cod, base4, alt, b[0], b[1]);
  }

  // chunk c's hard escapes of this tile's 8 rows, written into its decoded fragments
  __device__ __forceinline__ void patch(uint32_t (&b)[8][2], int c) const {
    const int col0 = c * kWide, block = col0 / kBlock;
    const int2 escapes = escape_range(p.exc_off, row0, blocks, block);
    for (int e = escapes.x; e < escapes.y; ++e) {
      const int entry = __ldg(p.exc + e);
      const int r = ((entry >> 8) & 0xFF) % kSegmentRows - row0 % kSegmentRows;
      const int kk = block * kBlock - col0 + (entry & 0xFF);
      if (r != g || kk < 0 || kk >= kWide || ((kk & 7) >> 1) != q) continue;
      const int which = (kk >> 4) * 2 + ((kk >> 3) & 1), half = kk & 1;
      const uint32_t bits = static_cast<uint32_t>(entry) >> 16;
#pragma unroll
      for (int s = 0; s < 8; ++s)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          if (2 * s + i == which)
            b[s][i] = half ? (b[s][i] & 0x0000FFFFu) | (bits << 16) : (b[s][i] & 0xFFFF0000u) | bits;
    }
  }

  // chunk c in full: x fragments and W's decoded, patched fragments
  __device__ __forceinline__ void operands(uint32_t (&a)[8][4], uint32_t (&b)[8][2], int c) const {
    const Chunk chunk = bytes(c);
    const uint32_t alt = alt4(c);
#pragma unroll
    for (int s = 0; s < 8; ++s) decode_step(b[s], chunk, s, alt);
    patch(b, c);
    load_x(a, c);
  }

  // chunk c's MMAs (a, b) in K order, with chunk c + 1's operands (na, nb) read and decoded among them in one basic
  // block, so the decode fills the chained MMAs' latency; past the last chunk it decodes that chunk again, unused
  __device__ __forceinline__ void mma_and_next(float (&acc)[4], const uint32_t (&a)[8][4], const uint32_t (&b)[8][2],
                                               uint32_t (&na)[8][4], uint32_t (&nb)[8][2], int c) const {
    const int nc = min(c + 1, chunks - 1);
    const Chunk chunk = bytes(c + 1);
    const uint32_t alt = alt4(nc);
    load_x(na, nc);
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      mma16816(acc, a[s], b[s][0], b[s][1]);
      decode_step(nb[s], chunk, s, alt);
    }
    patch(nb, nc);
  }

  __device__ __forceinline__ void store(const float (&acc)[4]) const {
    // C: x rows g (c0, c1) and g + 8 (c2, c3), W rows row0 + 2q and + 1
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int xr = g + 8 * (i >> 1), wr = row0 + 2 * q + (i & 1);
      const float b_ = p.bias ? __bfloat162float(p.bias[wr]) : 0.f;
      if (xr < p.m) p.out[xr * p.stride_om + wr] = __float2bfloat16_rn(acc[i] + b_);
    }
  }
};

// HI: x has rows past 8 (else A's rows g + 8 are zeros, not loaded). PIPE: software-pipelined in two register sets
// that swap roles each chunk — chunk c + 1's ring read, x fragments and decode are issued among chunk c's MMAs, so
// a warp's chained MMAs no longer wait behind its own decode and loads (the sums, in K order, are the same).
template <int STAGES, bool HI, bool PIPE>
__global__ void __launch_bounds__(32, 1) b12_gemv_rows8_kernel(const Operands p) {
  extern __shared__ __align__(16) uint8_t ring[];
  const Warp8<STAGES, HI> w(p, ring);
  float acc[4] = {};
  uint32_t a[8][4], b[8][2];
  if constexpr (PIPE) {
    uint32_t a2[8][4], b2[8][2];
    w.operands(a, b, 0);
    int c = 0;
    for (; c + 1 < w.chunks; c += 2) {
      w.mma_and_next(acc, a, b, a2, b2, c);
      w.mma_and_next(acc, a2, b2, a, b, c + 1);
    }
    if (c < w.chunks) w.mma_and_next(acc, a, b, a2, b2, c);  // an odd count's last chunk
  } else {
    for (int c = 0; c < w.chunks; ++c) {
      w.operands(a, b, c);
#pragma unroll
      for (int s = 0; s < 8; ++s) mma16816(acc, a[s], b[s][0], b[s][1]);
    }
  }
  asm volatile("cp.async.wait_all;\n" ::);
  w.store(acc);
}

template <bool HI, bool PIPE>
void (*rows8_kernel(int stages))(Operands) {
  return stages == 4 ? b12_gemv_rows8_kernel<4, HI, PIPE>
         : stages == 8 ? b12_gemv_rows8_kernel<8, HI, PIPE>
                       : b12_gemv_rows8_kernel<16, HI, PIPE>;
}

}  // namespace

// x [m, k] bf16 (m <= 16, even stride), planes of an [n, k] B12 matrix with the sign/mantissa and code planes in
// the fragment order of `rows` (16: W as A, n % 16 == 0, k % 64 == 0; 8: W as B, n % 8 == 0, k % 128 == 0); bias
// may be null. `stages`: 4, 8 or 16. `pipelined` (the 8-row form only): chunk c + 1 decoded among chunk c's MMAs.
cudaError_t b12_gemv_launch(const void* x, const void* sm_frag, const void* code_frag, const void* base,
                            const void* alt, const void* exc_off, const void* exc, const void* bias, void* out, int m,
                            int n, int k, long stride_xm, long stride_om, int stages, int rows, bool pipelined,
                            cudaStream_t stream) {
  const Operands p{static_cast<const __nv_bfloat16*>(x), static_cast<const uint8_t*>(sm_frag),
                   static_cast<const uint8_t*>(code_frag), static_cast<const uint8_t*>(base),
                   static_cast<const uint8_t*>(alt), static_cast<const int32_t*>(exc_off),
                   static_cast<const int32_t*>(exc), static_cast<const __nv_bfloat16*>(bias),
                   static_cast<__nv_bfloat16*>(out), m, n, k, stride_xm, stride_om};
  if (m < 1 || m > 16 || stride_xm % 2 || (stages != 4 && stages != 8 && stages != 16)) return cudaErrorInvalidValue;
  const int smem = stages * 32 * kLaneBytes;  // at most 24 KB: within the default dynamic limit
  if (rows == 8) {
    if (n % 8 || k % kWide) return cudaErrorInvalidValue;
    const bool hi = m > 8;
    auto kernel = hi ? (pipelined ? rows8_kernel<true, true>(stages) : rows8_kernel<true, false>(stages))
                     : (pipelined ? rows8_kernel<false, true>(stages) : rows8_kernel<false, false>(stages));
    kernel<<<n / 8, 32, smem, stream>>>(p);
  } else {
    if (rows != 16 || pipelined || n % 16 || k % kChunk) return cudaErrorInvalidValue;
    const bool wide = m > 8;
    auto kernel = stages == 4   ? (wide ? b12_gemv_kernel<2, 4> : b12_gemv_kernel<1, 4>)
                  : stages == 8 ? (wide ? b12_gemv_kernel<2, 8> : b12_gemv_kernel<1, 8>)
                                : (wide ? b12_gemv_kernel<2, 16> : b12_gemv_kernel<1, 16>);
    kernel<<<n / 16, 32, smem, stream>>>(p);
  }
  return cudaGetLastError();
}
