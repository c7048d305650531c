// Just enough of the Metal Shading Language for clang++ -fsyntax-only to check the sources
// MLX generates for our kernels (tests/kernels/test_metal_source.py). Not a Metal compiler:
// it catches C++-level mistakes (undeclared names, type and address-space errors, template
// instantiation failures) before a Mac ever sees the source.

// Address spaces are real clang address spaces, so a device pointer does not convert to a
// thread (generic) pointer, as in Metal. `threadgroup` arrays are declared inside kernels;
// C++ forbids address-space-qualified automatic variables, so they become static here.
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup static __attribute__((address_space(3)))
#define thread

typedef unsigned int uint;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned short uint16_t;
typedef short int16_t;
typedef unsigned char uint8_t;
typedef _Float16 half;
typedef half float16_t;  // MLX's name for half in generated signatures
// Metal's bfloat (MSL 3.1) is a built-in scalar: it converts to and from float and copies
// between address spaces like half. clang 14 has no arithmetic bf16 type on this target, so
// ARM's __fp16 (also a distinct scalar, promoted to float in arithmetic) stands in for it.
typedef __fp16 bfloat;
typedef bfloat bfloat16_t;

template <typename T> struct vec2 { T x, y; };
template <typename T> struct vec3 { T x, y, z; };
template <typename T> struct vec4 { T x, y, z, w; };
typedef vec2<uint> uint2;
typedef vec3<uint> uint3;
typedef vec4<uint> uint4;
typedef vec2<float> float2;
typedef vec3<float> float3;
typedef vec4<float> float4;
typedef vec4<half> half4;

#define INFINITY __builtin_inff()
#define METAL_FUNC inline

namespace metal {
float exp(float);
float log(float);
float max(float, float);
float min(float, float);
float abs(float);
float sqrt(float);
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
void threadgroup_barrier(mem_flags);
float simd_sum(float);
float simd_max(float);
}  // namespace metal
using namespace metal;
