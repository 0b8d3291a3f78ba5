// Fused host AdamW: one pass per element over the master weights (fp32, or bf16: AdamMaster),
// the moments m and v (fp32, bf16 or block-wise 8-bit codes: AdamState) and an fp16, bf16 or
// fp32 gradient, writing the new compute-dtype parameters. Used by the XLA FFI target
// "jaxascend_adamw" and by jaxascend._native.adamw_update (numpy, in place), and callable
// from other native code (the streamed optimizer step) through RunFusedAdamW.
//
// The arithmetic follows optax.adamw (scale_by_adam with eps_root=0, add_decayed_weights,
// scale_by_learning_rate, apply_updates), every operation rounded separately (no FMA
// contraction) so that the scalar, AVX2 and AVX-512 variants agree bit for bit:
//   g  = float(grad) * grad_scale
//   m  = (1-b1)*g + b1*m
//   v  = (1-b2)*(g*g) + b2*v
//   u  = (m*(1/bc1)) / (sqrt(v*(1/bc2)) + eps) + weight_decay*master
//   master = master - lr*u;   params = round_to_nearest_even(master)
// The bias corrections multiply by a float32 reciprocal because that is what optax computes
// under XLA: its algebraic simplifier rewrites x / broadcast(scalar) as x * broadcast(1/scalar).
//
// Compressed moments (optimizer.state_dtype; the formats are documented, with their numpy
// reference, in jaxascend/optim/state_codes.py): the kernel widens m and v in registers, runs
// the arithmetic above, and narrows them again before they leave:
//   kBF16: m and v narrowed to bfloat16;
//   kInt8: per block of `block` elements one fp32 scale each for m and v (a power of two); m as
//          sign + E4M3 of |m|/scale, v as E4M4 of sqrt(v)/scale (v = w*w on the way in). A block
//          is updated into an L1 scratch first, then its new scales chosen and its codes written.
// AdamRounding kNearest rounds both to nearest, ties to even; kStochastic rounds v (both
// formats) and int8's m stochastically, bf16 m to nearest, with a counter-based hash of
// (rounding_seed, rounding_index + i): h = lowbias32(uint32(index) * 0x9E3779B1 + seed), v takes
// h >> 16, m h & 0xffff. Results do not depend on the variant, the thread split or where a run
// resumed.
// The scalar and AVX2 variants agree bit for bit in every format; kInt8 has no AVX-512 variant
// of its own (an avx512 request runs the AVX2 one).
//
// The master (AdamMaster; the numpy reference is jaxascend/optim/master_codes.py) is float32 as
// above, or bfloat16 (2 bytes a weight; params_out must then be bfloat16 and receives exactly the
// new master's bits, and may be the master's own buffer). With x the master as float32 and u the
// update above (weight decay on x), y = x - lr*u is the float32 master's arithmetic, and:
//   kBF16Stochastic:  x = the master widened; master = bf16((bits(y) + r) >> 16), r the top 16
//                     bits of lowbias32(uint32(index) * 0x9E3779B1 + (rounding_seed ^ 0x6A09E667)),
//                     a hash of its own so that the moments' bits (h >> 16, h & 0xffff) stay what
//                     they were. Unbiased: E[master] = y.
//   kBF16Compensated: a 16-bit companion comp holds the float32 master's low half, so the pair is
//                     the float32 master: x = float(bits: (master << 16) + int16(comp)); with
//                     u = bits(y) - (bits(y) & 0x1ffff == 0x8000) (a tie that rounds down, to
//                     even, held one float32 ulp toward zero: +0x8000 would need a 17th bit),
//                     master = (u + 0x8000) >> 16, which is y to nearest, ties to even, as the
//                     float32 master's compute weights, and comp = u & 0xffff.
//                     Every step is the float32 master's step, bit for bit, but for that ulp (one
//                     weight in 2**17 a step); 4 bytes a weight,
//                     like Kahan summation with a bfloat16 companion (optimi, anyprecision
//                     AdamW), which rounds its companion to 8 bits and so stalls once lr*|u| is
//                     under half the companion's ulp: at lr 1e-6 on weights near 1 it stops at
//                     |comp| = 2**-11 and the master never moves.
// Either way a NaN stays a quiet NaN (FloatToBFloat16's), an infinity infinite. Both compose with
// every state format and moment rounding; the moments' arithmetic and bits are the float32
// master's. Rounded to nearest alone, a bfloat16 master stops moving once lr*u is under half its
// ulp (2**-9 to 2**-8 of the weight): lr 1e-6 on weights near 1 never lands.
#pragma once

#include <cstdint>
#include <string>

namespace jaxascend {

// Element type of the gradient and of the output compute parameters.
enum class AdamElem { kF32, kF16, kBF16 };

// How m and v are stored (see the top of the file).
enum class AdamState { kF32, kBF16, kInt8 };

// How m and v are narrowed (kBF16 and kInt8; float32 state is not); see the top of the file.
enum class AdamRounding { kNearest, kStochastic };

// How the master weights are stored and rounded (see the top of the file).
enum class AdamMaster { kF32, kBF16Compensated, kBF16Stochastic };

// Salt of the bfloat16 master's stochastic rounding hash (rounding_seed ^ kAdamMasterSalt).
constexpr uint32_t kAdamMasterSalt = 0x6a09e667u;

// kInt8 blocks: a power of two in [kAdamMinBlock, kAdamMaxBlock] elements.
constexpr int64_t kAdamMinBlock = 256;
constexpr int64_t kAdamMaxBlock = 2048;

// Instruction-set variant of the kernel; kAuto takes JAXASCEND_ADAM_ISA if set, else the best
// the CPU supports.
enum class AdamIsa { kAuto, kScalar, kAvx2, kAvx512 };

// Runtime hyperparameters, in the order of the f32[kAdamScalarCount] scalars buffer.
// one_minus_b1/b2 are passed rather than derived so that 1-b1 is rounded the way the caller
// (optax: Python double arithmetic, then float32) rounded it.
struct AdamScalars {
  float lr;
  float b1;
  float b2;
  float eps;
  float weight_decay;
  float grad_scale;        // combined loss-scale unscale and clipping factor
  float bias_correction1;  // 1 - b1**count, count counting this update (>= 1)
  float bias_correction2;  // 1 - b2**count
  float one_minus_b1;
  float one_minus_b2;
};
constexpr int kAdamScalarCount = 10;

// One call's buffers. Inputs and outputs may alias (in-place update) or be disjoint; they must
// not partially overlap.
struct AdamBuffers {
  const float* master_in;
  const void* m_in;  // n elements of state_type: float, bf16 bits, or uint8 codes
  const void* v_in;
  const void* grad;  // n elements of grad_type
  float* master_out;
  void* m_out;
  void* v_out;
  void* params_out;  // n elements of param_type
  int64_t n;
  AdamElem grad_type;
  AdamElem param_type;
  AdamState state_type = AdamState::kF32;
  // kInt8: ceil(n / block) scales of m and of v, read and rewritten in place.
  float* m_scale = nullptr;
  float* v_scale = nullptr;
  int64_t block = 0;
  // kStochastic: the random bits of element i hash (rounding_seed, rounding_index + i).
  AdamRounding rounding = AdamRounding::kNearest;
  uint32_t rounding_seed = 0;
  int64_t rounding_index = 0;
  // A bfloat16 master (not kF32) is read from master16_in and written to master16_out (bits;
  // master_in and master_out are unused); kBF16Compensated reads comp_in and writes comp_out
  // (the low halves, n each). kBF16Stochastic draws its bits from rounding_seed and
  // rounding_index too.
  AdamMaster master_type = AdamMaster::kF32;
  const uint16_t* master16_in = nullptr;
  uint16_t* master16_out = nullptr;
  const uint16_t* comp_in = nullptr;
  uint16_t* comp_out = nullptr;
};

// Largest `threads` accepted by RunFusedAdamW.
constexpr int kAdamMaxThreads = 256;

// Name used in messages and by JAXASCEND_ADAM_ISA: "auto", "scalar", "avx2", "avx512".
const char* AdamIsaName(AdamIsa isa);

// Parses an ISA name; returns false for an unknown name.
bool ParseAdamIsa(const std::string& name, AdamIsa* isa);

// Whether this CPU (and OS) can run the variant. kScalar and kAuto are always supported.
bool AdamIsaSupported(AdamIsa isa);

// Resolves kAuto (environment variable, then the best supported variant) and checks that the
// result is supported. Returns "" or an error message.
std::string ResolveAdamIsa(AdamIsa requested, AdamIsa* resolved);

// Runs the update over b.n elements on `threads` threads (1 = inline on the caller's thread,
// more = the calling thread plus workers of a persistent pool). Returns "" or an error
// message naming the bad argument.
std::string RunFusedAdamW(const AdamBuffers& b, const AdamScalars& s, int threads, AdamIsa isa);

// Name used in messages: "float32", "bfloat16", "int8".
const char* AdamStateName(AdamState state);

// Name used in messages: "float32", "float16", "bfloat16".
const char* AdamElemName(AdamElem elem);

// Reads AdamScalars from a float buffer laid out as documented above.
AdamScalars AdamScalarsFromArray(const float* values);

// The message of an argument whose element count is not master's, e.g.
// "adamw: grad has 3 elements but master has 4".
std::string AdamCountMismatch(const char* name, int64_t count, int64_t n);

}  // namespace jaxascend
