/* bf16 <-> fp32 for one element, shared by the native library's scalar paths: bf16 is the top
 * half of an fp32, so widening is a shift and narrowing rounds to nearest even. */
#ifndef CONVEYOR_BF16_H
#define CONVEYOR_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16; float f; memcpy(&f, &bits, sizeof f); return f;
}
static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, NaN stays NaN */
    uint32_t bits; memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u); return (uint16_t)(bits >> 16);
}

#endif
