// A decode step's embedding: each row's word embedding plus its position's
// (ops::decode_embedding).

#include "scalars.cuh"
#include "dependent_launch.cuh"

// Block r writes out[r, :] = words[tokens[r], :] (+ places[positions[r], :] when `places`),
// summed in float32 and rounded once. A token or position outside its table gives a row of
// NaN rather than a read out of bounds.
template <typename T>
__device__ void embed(const T* words, long long vocabulary, const T* places, long long places_rows,
                      const long long* tokens, const long long* positions, int hidden, T* out) {
    let_next_kernel_start();
    const long long row = blockIdx.x;
    const long long token = tokens[row];
    const long long position = places ? positions[row] : 0;
    const bool inside = token >= 0 && token < vocabulary &&
                        (!places || (position >= 0 && position < places_rows));
    const T* word = words + token * hidden;
    const T* place = places + position * hidden;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        float value = __int_as_float(0x7fc00000);
        if (inside) {
            value = load(word + c);
            if (places) value += load(place + c);
        }
        store(out + row * hidden + c, value);
    }
}

#define EMBED(NAME, T)                                                                        \
    extern "C" __global__ void NAME(const T* words, long long vocabulary, const T* places,    \
                                    long long places_rows, const long long* tokens,           \
                                    const long long* positions, int hidden, T* out) {         \
        embed<T>(words, vocabulary, places, places_rows, tokens, positions, hidden, out);     \
    }

EMBED(decode_embed_bf16, bf16)
EMBED(decode_embed_f16, f16)
EMBED(decode_embed_f32, float)
