// Host-side copies for weight loading: a strided 2-D copy into a row-major array, fast for the
// transposed views a checkpoint's [out, in] weights become in expertd's [in, out] layout; and a
// per-block table look-up that decodes 8-bit codes (FP8 weights with block scales). Plain C entry
// points for ctypes (no XLA FFI); ctypes releases the GIL for the call.
#include <emmintrin.h>  // SSE2: part of the x86-64 baseline, no target attribute needed

#include <cstdint>
#include <cstring>

namespace expertd {
namespace {

constexpr int64_t kBlock = 64;  // rows and columns per cache block

// dst[r, c] = src[r * rs + c * cs] over [r0, r1) x [c0, c1), element by element.
template <typename T>
void CopyScalar(const char* src, int64_t rs, int64_t cs, T* dst, int64_t cols, int64_t r0, int64_t r1, int64_t c0,
                int64_t c1) {
  for (int64_t r = r0; r < r1; ++r) {
    const char* in = src + r * rs + c0 * cs;
    for (int64_t c = c0; c < c1; ++c, in += cs) std::memcpy(dst + r * cols + c, in, sizeof(T));
  }
}

// 8 x 8 16-bit elements: dst rows r..r+8, columns c..c+8 from src "rows" c..c+8 (stride cs bytes),
// each 8 contiguous elements r..r+8.
inline void Transpose8x8x16(const char* src, int64_t cs, uint16_t* dst, int64_t dst_stride) {
  __m128i a[8], b[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * cs));
  for (int i = 0; i < 4; ++i) {
    b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      a[4 * i + 2 * j] = _mm_unpacklo_epi32(b[4 * i + j], b[4 * i + j + 2]);
      a[4 * i + 2 * j + 1] = _mm_unpackhi_epi32(b[4 * i + j], b[4 * i + j + 2]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    b[2 * j] = _mm_unpacklo_epi64(a[j], a[j + 4]);
    b[2 * j + 1] = _mm_unpackhi_epi64(a[j], a[j + 4]);
  }
  for (int i = 0; i < 8; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i * dst_stride), b[i]);
}

// 4 x 4 32-bit elements, as Transpose8x8x16.
inline void Transpose4x4x32(const char* src, int64_t cs, uint32_t* dst, int64_t dst_stride) {
  __m128 a0 = _mm_loadu_ps(reinterpret_cast<const float*>(src));
  __m128 a1 = _mm_loadu_ps(reinterpret_cast<const float*>(src + cs));
  __m128 a2 = _mm_loadu_ps(reinterpret_cast<const float*>(src + 2 * cs));
  __m128 a3 = _mm_loadu_ps(reinterpret_cast<const float*>(src + 3 * cs));
  _MM_TRANSPOSE4_PS(a0, a1, a2, a3);
  float* out = reinterpret_cast<float*>(dst);
  _mm_storeu_ps(out, a0);
  _mm_storeu_ps(out + dst_stride, a1);
  _mm_storeu_ps(out + 2 * dst_stride, a2);
  _mm_storeu_ps(out + 3 * dst_stride, a3);
}

// A transposed view (src contiguous along r): blocks of kBlock x kBlock, each of micro-tiles.
template <typename T, int kTile>
void CopyTransposed(const char* src, int64_t cs, T* dst, int64_t rows, int64_t cols) {
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    const int64_t r1 = r0 + kBlock < rows ? r0 + kBlock : rows;
    const int64_t r_tiles = r0 + (r1 - r0) / kTile * kTile;
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
      const int64_t c1 = c0 + kBlock < cols ? c0 + kBlock : cols;
      const int64_t c_tiles = c0 + (c1 - c0) / kTile * kTile;
      for (int64_t r = r0; r < r_tiles; r += kTile) {
        for (int64_t c = c0; c < c_tiles; c += kTile) {
          const char* in = src + r * static_cast<int64_t>(sizeof(T)) + c * cs;
          if constexpr (kTile == 8) Transpose8x8x16(in, cs, dst + r * cols + c, cols);
          else Transpose4x4x32(in, cs, dst + r * cols + c, cols);
        }
      }
      CopyScalar(src, sizeof(T), cs, dst, cols, r0, r_tiles, c_tiles, c1);  // the block's column tail
      CopyScalar(src, sizeof(T), cs, dst, cols, r_tiles, r1, c0, c1);       // and its row tail
    }
  }
}

template <typename T>
void StridedCopy2D(const char* src, int64_t rs, int64_t cs, T* dst, int64_t rows, int64_t cols) {
  if (cs == static_cast<int64_t>(sizeof(T))) {  // rows contiguous: one memcpy per row
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * cols, src + r * rs, cols * sizeof(T));
    return;
  }
  if (rs == static_cast<int64_t>(sizeof(T))) {
    if constexpr (sizeof(T) == 2) return CopyTransposed<T, 8>(src, cs, dst, rows, cols);
    if constexpr (sizeof(T) == 4) return CopyTransposed<T, 4>(src, cs, dst, rows, cols);
  }
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    const int64_t r1 = r0 + kBlock < rows ? r0 + kBlock : rows;
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
      CopyScalar(src, rs, cs, dst, cols, r0, r1, c0, c0 + kBlock < cols ? c0 + kBlock : cols);
    }
  }
}

// dst[r, c] = tables[((r / bm) * block_cols + c / bn) * 256 + codes[r * code_stride + c]].
template <typename T>
void BlockLookup(const uint8_t* codes, int64_t rows, int64_t cols, int64_t code_stride, const T* tables, int64_t bm,
                 int64_t bn, T* dst) {
  const int64_t block_cols = (cols + bn - 1) / bn;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* in = codes + r * code_stride;
    const T* row_tables = tables + (r / bm) * block_cols * 256;
    T* out = dst + r * cols;
    for (int64_t c0 = 0; c0 < cols; c0 += bn) {
      const T* table = row_tables + (c0 / bn) * 256;
      const int64_t c1 = c0 + bn < cols ? c0 + bn : cols;
      for (int64_t c = c0; c < c1; ++c) out[c] = table[in[c]];
    }
  }
}

}  // namespace
}  // namespace expertd

// dst[r, c] = src[r * src_row_stride + c * src_col_stride] (strides in bytes, any sign) for a
// row-major dst [rows, cols] of elements of elem_bytes (1, 2, 4 or 8). Returns 0, or -1 for
// another element size.
extern "C" int expertd_strided_copy_2d(const void* src, int64_t src_row_stride, int64_t src_col_stride, void* dst,
                                       int64_t rows, int64_t cols, int64_t elem_bytes) {
  const char* s = static_cast<const char*>(src);
  switch (elem_bytes) {
    case 1: expertd::StridedCopy2D(s, src_row_stride, src_col_stride, static_cast<uint8_t*>(dst), rows, cols); return 0;
    case 2: expertd::StridedCopy2D(s, src_row_stride, src_col_stride, static_cast<uint16_t*>(dst), rows, cols); return 0;
    case 4: expertd::StridedCopy2D(s, src_row_stride, src_col_stride, static_cast<uint32_t*>(dst), rows, cols); return 0;
    case 8: expertd::StridedCopy2D(s, src_row_stride, src_col_stride, static_cast<uint64_t*>(dst), rows, cols); return 0;
    default: return -1;
  }
}

// dst [rows, cols] (row-major, elements of elem_bytes: 2 or 4) = the entry of each code of codes
// [rows, cols] (rows code_row_stride bytes apart) in its block's table: tables [ceil(rows / bm),
// ceil(cols / bn), 256] of elem_bytes each, block (i, j) covering rows i*bm.. and columns j*bn...
// Returns 0, or -1 for another element size or a block size below 1.
extern "C" int expertd_block_lookup(const uint8_t* codes, int64_t rows, int64_t cols, int64_t code_row_stride,
                                    const void* tables, int64_t bm, int64_t bn, void* dst, int64_t elem_bytes) {
  if (bm < 1 || bn < 1) return -1;
  switch (elem_bytes) {
    case 2:
      expertd::BlockLookup(codes, rows, cols, code_row_stride, static_cast<const uint16_t*>(tables), bm, bn,
                           static_cast<uint16_t*>(dst));
      return 0;
    case 4:
      expertd::BlockLookup(codes, rows, cols, code_row_stride, static_cast<const uint32_t*>(tables), bm, bn,
                           static_cast<uint32_t*>(dst));
      return 0;
    default: return -1;
  }
}
