/* generator.c: the random generator, PyTorch 1.13's CPU generator
 * (CPUGeneratorImpl) bit for bit, so that code ported from PyTorch draws the
 * same numbers for the same seed: a 32-bit Mersenne Twister (mt19937) whose
 * state is seeded from the low 32 bits of the seed as torch's manual_seed
 * does, 32-bit draws (torch's random()) and 64-bit ones made of two 32-bit
 * draws, the first in the high half (torch's random64()), and the normal
 * sample randn keeps for its next call. The state it saves and restores has
 * torch's layout (get_state's 5,056 bytes), so a state moves between the two.
 * random.c turns the draws into tensors as torch's CPU kernels do.
 *
 * One default generator serves every random op that is given none; a
 * generator is plain data, so a caller (the Lua binding) owns others. */
#include <string.h>
#include <sys/random.h>

#include "tensor_internal.h"

enum { MT_M = 397 };
#define MT_MATRIX_A 0x9908b0dfu
#define MT_UPPER 0x80000000u
#define MT_LOWER 0x7fffffffu

static rh_rng_t default_rng;
static int default_ready;

rh_rng_t *rh_rng_default(void) {
  if (!default_ready) {
    rh_rng_seed(&default_rng, RH_RNG_DEFAULT_SEED); /* so that a run that never seeds repeats */
    default_ready = 1;
  }
  return &default_rng;
}

/* Knuth's initialisation from the seed's low 32 bits; the first draw twists */
void rh_rng_seed(rh_rng_t *g, uint64_t seed) {
  memset(g, 0, sizeof *g);
  g->seed = seed;
  g->mt[0] = (uint32_t)seed;
  for (uint32_t j = 1; j < RH_RNG_MT_N; j++) g->mt[j] = 1812433253u * (g->mt[j - 1] ^ (g->mt[j - 1] >> 30)) + j;
  g->left = 1;
  g->next = 0;
}

int rh_rng_seed_random(rh_rng_t *g, uint64_t *seed) {
  uint64_t s;
  if (getrandom(&s, sizeof s, 0) != (ssize_t)sizeof s)
    return rh_tensor_fail("Generator.seed: no random seed from the OS");
  /* 53 bits, so that the seed is exact as a Lua number */
  s &= (1ull << 53) - 1;
  rh_rng_seed(g, s);
  *seed = s;
  return 0;
}

static uint32_t twist(uint32_t u, uint32_t v) {
  return (((u & MT_UPPER) | (v & MT_LOWER)) >> 1) ^ ((v & 1) ? MT_MATRIX_A : 0);
}

/* the next 624 words of state, all at once */
static void next_state(rh_rng_t *g) {
  uint32_t *s = g->mt;
  int k = 0;
  for (; k < RH_RNG_MT_N - MT_M; k++) s[k] = s[k + MT_M] ^ twist(s[k], s[k + 1]);
  for (; k < RH_RNG_MT_N - 1; k++) s[k] = s[k + MT_M - RH_RNG_MT_N] ^ twist(s[k], s[k + 1]);
  s[k] = s[k + MT_M - RH_RNG_MT_N] ^ twist(s[k], s[0]);
  g->left = RH_RNG_MT_N;
  g->next = 0;
}

uint32_t rh_rng_u32(rh_rng_t *g) {
  if (--g->left == 0) next_state(g);
  uint32_t y = g->mt[g->next++];
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= y >> 18;
  return y;
}

uint64_t rh_rng_u64(rh_rng_t *g) {
  uint64_t hi = rh_rng_u32(g);
  return hi << 32 | rh_rng_u32(g);
}

/* The saved state: torch's CPUGeneratorImplState as x86-64 lays it out
 * (little-endian, natural alignment): the legacy TH generator's fields, its
 * state words widened to 64 bits, then the float normal sample. Offsets: */
enum {
  ST_SEED = 0,            /* uint64 the_initial_seed */
  ST_LEFT = 8,            /* int32 left */
  ST_SEEDED = 12,         /* int32 seeded */
  ST_NEXT = 16,           /* uint64 next */
  ST_WORDS = 24,          /* uint64 state[624] */
  ST_NORMAL_Y = 5024,     /* double normal_y: the cached double sample (normal_x, _rho at 5016, 5032: unused) */
  ST_NORMAL_VALID = 5040, /* int32 normal_is_valid */
  ST_FLOAT_NORMAL = 5048, /* float next_float_normal_sample */
  ST_FLOAT_VALID = 5052,  /* bool is_next_float_normal_sample_valid */
};

static void put(uint8_t *out, size_t at, const void *v, size_t n) { memcpy(out + at, v, n); }
static void get(const uint8_t *in, size_t at, void *v, size_t n) { memcpy(v, in + at, n); }

void rh_rng_get_state(const rh_rng_t *g, uint8_t out[RH_RNG_STATE_BYTES]) {
  memset(out, 0, RH_RNG_STATE_BYTES);
  int32_t left = g->left, seeded = 1, nvalid = g->has_normal, fvalid = g->has_normal_f32 ? 1 : 0;
  uint64_t next = g->next;
  put(out, ST_SEED, &g->seed, 8);
  put(out, ST_LEFT, &left, 4);
  put(out, ST_SEEDED, &seeded, 4);
  put(out, ST_NEXT, &next, 8);
  for (int j = 0; j < RH_RNG_MT_N; j++) {
    uint64_t w = g->mt[j];
    put(out, ST_WORDS + 8 * (size_t)j, &w, 8);
  }
  if (g->has_normal) put(out, ST_NORMAL_Y, &g->normal, 8);
  put(out, ST_NORMAL_VALID, &nvalid, 4);
  if (g->has_normal_f32) put(out, ST_FLOAT_NORMAL, &g->normal_f32, 4);
  out[ST_FLOAT_VALID] = (uint8_t)fvalid;
}

/* as torch's set_state: the position must be one mt19937 can be at */
int rh_rng_set_state(rh_rng_t *g, const uint8_t *in, size_t n) {
  if (n != RH_RNG_STATE_BYTES)
    return rh_tensor_fail("set_state: expected %d bytes (a state from get_state), got %zu", RH_RNG_STATE_BYTES, n);
  rh_rng_t s;
  memset(&s, 0, sizeof s);
  int32_t left, seeded, nvalid;
  uint64_t next;
  get(in, ST_SEED, &s.seed, 8);
  get(in, ST_LEFT, &left, 4);
  get(in, ST_SEEDED, &seeded, 4);
  get(in, ST_NEXT, &next, 8);
  if (!seeded || left < 1 || left > RH_RNG_MT_N || (uint32_t)next > RH_RNG_MT_N)
    return rh_tensor_fail("set_state: not a valid generator state (seeded %d, left %d, next %llu)", (int)seeded,
                          (int)left, (unsigned long long)next);
  for (int j = 0; j < RH_RNG_MT_N; j++) {
    uint64_t w;
    get(in, ST_WORDS + 8 * (size_t)j, &w, 8);
    s.mt[j] = (uint32_t)w;
  }
  s.left = left;
  s.next = (uint32_t)next;
  get(in, ST_NORMAL_VALID, &nvalid, 4);
  if (nvalid) {
    s.has_normal = 1;
    get(in, ST_NORMAL_Y, &s.normal, 8);
  }
  if (in[ST_FLOAT_VALID]) {
    s.has_normal_f32 = 1;
    get(in, ST_FLOAT_NORMAL, &s.normal_f32, 4);
  }
  *g = s;
  return 0;
}
