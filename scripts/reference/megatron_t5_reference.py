"""An independent PyTorch T5 written from the spec (megatron-model.md §1.5), for the T5 parity test.

usage: megatron_t5_reference.py OUT_DIR [greedy]

Megatron core's T5 as the spec describes it, with no code shared with megatron-rs: one embedding
(word + learned absolute positions, decoder positions from 0), pre-LN encoder layers under the
padding mask [b,1,se,se] and the encoder's final LayerNorm, pre-LN decoder layers (self-attention
under padding x causal [b,1,sd,sd] -> cross-attention over the encoder output under [b,1,sd,se] ->
MLP) and the decoder's final LayerNorm, and logits = decoder output @ word_embeddings^T +
lm_head bias. Masks are boolean, True = masked, filled with -10000 before the softmax as
Megatron's fused softmax does. Fused QKV rows are per head [q, k, v]; cross-attention's linear_kv
rows are per head [k, v]. GeLU is exact (erf).

Writes OUT_DIR/model.safetensors (random float32 weights under Megatron-core T5 names) and
OUT_DIR/io.safetensors: a padded batch (encoder and decoder tokens and padding masks, labels,
loss mask), the logits [b, sd, V] and the token-averaged masked loss, computed in float64.

With `greedy`, OUT_DIR/greedy.safetensors instead holds a padded batch of encoder inputs and
their greedy decodings in float64: the decoder starts from BOS, and each step runs the whole
model again on the tokens so far and appends the most likely token (no cache), for STEPS steps
(`free`) and again stopping at an EOS id taken from the first row's third token (`eos`, `stopped`,
rows padded with -1).
"""
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

VOCAB, HIDDEN, HEADS, FFN, MAX_POS = 128, 64, 4, 128, 32
ENCODER_LAYERS, DECODER_LAYERS = 2, 3
BATCH, ENC_SEQ, DEC_SEQ = 2, 12, 8
HEAD_DIM = HIDDEN // HEADS
EPS = 1e-5


def random_weights(generator):
    def normal(*shape):
        return torch.randn(*shape, generator=generator) * 0.1

    def norm(prefix, out):
        out[f"{prefix}.weight"] = 1.0 + normal(HIDDEN)
        out[f"{prefix}.bias"] = normal(HIDDEN)

    def linear(prefix, rows, columns, out):
        out[f"{prefix}.weight"] = normal(rows, columns)
        out[f"{prefix}.bias"] = normal(rows)

    w = {
        "embedding.word_embeddings.weight": normal(VOCAB, HIDDEN),
        "embedding.position_embeddings.weight": normal(MAX_POS, HIDDEN),
    }
    for stack, count in (("encoder", ENCODER_LAYERS), ("decoder", DECODER_LAYERS)):
        for i in range(count):
            p = f"{stack}.layers.{i}"
            norm(f"{p}.input_layernorm", w)
            linear(f"{p}.self_attention.linear_qkv", 3 * HIDDEN, HIDDEN, w)
            linear(f"{p}.self_attention.linear_proj", HIDDEN, HIDDEN, w)
            if stack == "decoder":
                norm(f"{p}.pre_cross_attn_layernorm", w)
                linear(f"{p}.cross_attention.linear_q", HIDDEN, HIDDEN, w)
                linear(f"{p}.cross_attention.linear_kv", 2 * HIDDEN, HIDDEN, w)
                linear(f"{p}.cross_attention.linear_proj", HIDDEN, HIDDEN, w)
            norm(f"{p}.pre_mlp_layernorm", w)
            linear(f"{p}.mlp.linear_fc1", FFN, HIDDEN, w)
            linear(f"{p}.mlp.linear_fc2", HIDDEN, FFN, w)
        norm(f"{stack}.final_layernorm", w)
    w["lm_head.output_layer.bias"] = normal(VOCAB)
    return w


def layer_norm(w, prefix, x):
    return F.layer_norm(x, (HIDDEN,), w[f"{prefix}.weight"], w[f"{prefix}.bias"], EPS)


def linear(w, prefix, x):
    return F.linear(x, w[f"{prefix}.weight"], w[f"{prefix}.bias"])


def attend(query, key, value, masked):
    """query [sq,b,n,d], key/value [sk,b,n,d], masked [b,1,sq,sk] (True = masked)."""
    scores = torch.einsum("qbnd,kbnd->bnqk", query, key) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(masked, -10000.0).softmax(-1)
    context = torch.einsum("bnqk,kbnd->qbnd", probs, value)
    return context.reshape(context.shape[0], context.shape[1], HIDDEN)


def self_attention(w, prefix, x, masked):
    s, b, _ = x.shape
    qkv = linear(w, f"{prefix}.linear_qkv", x).view(s, b, HEADS, 3 * HEAD_DIM)
    q, k, v = qkv.split(HEAD_DIM, dim=-1)
    return linear(w, f"{prefix}.linear_proj", attend(q, k, v, masked))


def cross_attention(w, prefix, x, memory, masked):
    s, b, _ = x.shape
    q = linear(w, f"{prefix}.linear_q", x).view(s, b, HEADS, HEAD_DIM)
    kv = linear(w, f"{prefix}.linear_kv", memory).view(memory.shape[0], b, HEADS, 2 * HEAD_DIM)
    k, v = kv.split(HEAD_DIM, dim=-1)
    return linear(w, f"{prefix}.linear_proj", attend(q, k, v, masked))


def mlp(w, prefix, x):
    return linear(w, f"{prefix}.linear_fc2", F.gelu(linear(w, f"{prefix}.linear_fc1", x)))


def embed(w, tokens):
    positions = torch.arange(tokens.shape[1])
    x = w["embedding.word_embeddings.weight"][tokens] + w["embedding.position_embeddings.weight"][positions]
    return x.transpose(0, 1)


def t5_logits(w, enc_tokens, dec_tokens, enc_keep, dec_keep):
    """Logits [b, sd, V]; *_keep are [b, s] booleans (True = real token)."""
    sd = dec_tokens.shape[1]
    enc_mask = ~(enc_keep[:, None, :, None] & enc_keep[:, None, None, :])
    causal = torch.ones(sd, sd, dtype=torch.bool).tril()
    dec_mask = ~(dec_keep[:, None, :, None] & dec_keep[:, None, None, :] & causal)
    enc_dec_mask = ~(dec_keep[:, None, :, None] & enc_keep[:, None, None, :])

    x = embed(w, enc_tokens)
    for i in range(ENCODER_LAYERS):
        p = f"encoder.layers.{i}"
        x = x + self_attention(w, f"{p}.self_attention", layer_norm(w, f"{p}.input_layernorm", x), enc_mask)
        x = x + mlp(w, f"{p}.mlp", layer_norm(w, f"{p}.pre_mlp_layernorm", x))
    memory = layer_norm(w, "encoder.final_layernorm", x)

    y = embed(w, dec_tokens)
    for i in range(DECODER_LAYERS):
        p = f"decoder.layers.{i}"
        y = y + self_attention(w, f"{p}.self_attention", layer_norm(w, f"{p}.input_layernorm", y), dec_mask)
        y = y + cross_attention(w, f"{p}.cross_attention",
                                layer_norm(w, f"{p}.pre_cross_attn_layernorm", y), memory, enc_dec_mask)
        y = y + mlp(w, f"{p}.mlp", layer_norm(w, f"{p}.pre_mlp_layernorm", y))
    y = layer_norm(w, "decoder.final_layernorm", y)
    logits = y @ w["embedding.word_embeddings.weight"].T + w["lm_head.output_layer.bias"]
    return logits.transpose(0, 1)


def main(out: Path) -> None:
    generator = torch.Generator().manual_seed(1234)
    weights = random_weights(generator)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))

    enc_tokens = torch.randint(0, VOCAB, (BATCH, ENC_SEQ), generator=generator)
    dec_tokens = torch.randint(0, VOCAB, (BATCH, DEC_SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, DEC_SEQ), generator=generator)
    enc_keep = torch.ones(BATCH, ENC_SEQ, dtype=torch.bool)
    dec_keep = torch.ones(BATCH, DEC_SEQ, dtype=torch.bool)
    enc_keep[1, ENC_SEQ - 5:] = False
    dec_keep[1, DEC_SEQ - 3:] = False
    enc_tokens[~enc_keep] = 0
    dec_tokens[~dec_keep] = 0
    labels[~dec_keep] = -1
    loss_mask = dec_keep.double()

    w64 = {k: v.double() for k, v in weights.items()}
    with torch.no_grad():
        logits = t5_logits(w64, enc_tokens, dec_tokens, enc_keep, dec_keep)
        token_losses = F.cross_entropy(logits.reshape(-1, VOCAB), labels.clamp_min(0).reshape(-1),
                                       reduction="none").view(BATCH, DEC_SEQ)
        loss = (token_losses * loss_mask).sum() / loss_mask.sum()
    save_file({
        "enc_tokens": enc_tokens, "dec_tokens": dec_tokens,
        "enc_mask": enc_keep.long(), "dec_mask": dec_keep.long(),
        "labels": labels, "loss_mask": loss_mask.float(),
        "logits": logits.contiguous(), "loss": loss.reshape(1),
    }, str(out / "io.safetensors"))


BOS, STEPS = 1, 10


def greedy(w, enc_tokens, enc_keep, eos):
    """Each row's greedy tokens (without BOS and EOS), recomputing the model at every step."""
    rows = enc_tokens.shape[0]
    dec = torch.full((rows, 1), BOS)
    out, done = [[] for _ in range(rows)], [False] * rows
    for _ in range(STEPS):
        keep = torch.ones(dec.shape, dtype=torch.bool)
        following = t5_logits(w, enc_tokens, dec, enc_keep, keep)[:, -1].argmax(-1)
        for row in range(rows):
            if done[row]:
                continue
            if following[row].item() == eos:
                done[row] = True
            else:
                out[row].append(following[row].item())
        if all(done):
            break
        dec = torch.cat([dec, following[:, None]], 1)
    return out


def padded(rows):
    return torch.tensor([row + [-1] * (STEPS - len(row)) for row in rows], dtype=torch.int64)


def main_greedy(out: Path) -> None:
    generator = torch.Generator().manual_seed(1234)
    # Projections three times larger: with the small ones the tied embeddings make the model
    # copy its input, and greedy decoding repeats one token.
    weights = {
        name: value if "layernorm" in name or "embedding" in name else 3 * value
        for name, value in random_weights(generator).items()
    }
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    enc_tokens = torch.randint(0, VOCAB, (BATCH, ENC_SEQ), generator=generator)
    enc_keep = torch.ones(BATCH, ENC_SEQ, dtype=torch.bool)
    enc_keep[1, ENC_SEQ - 4:] = False
    enc_tokens[~enc_keep] = 0
    w64 = {k: v.double() for k, v in weights.items()}
    with torch.no_grad():
        free = greedy(w64, enc_tokens, enc_keep, eos=None)
        eos = free[0][2]
        stopped = greedy(w64, enc_tokens, enc_keep, eos=eos)
    save_file({
        "enc_tokens": enc_tokens, "enc_mask": enc_keep.long(),
        "free": padded(free), "eos": torch.tensor([eos]), "stopped": padded(stopped),
    }, str(out / "greedy.safetensors"))


if __name__ == "__main__":
    if sys.argv[2:] == ["greedy"]:
        main_greedy(Path(sys.argv[1]))
    else:
        main(Path(sys.argv[1]))
