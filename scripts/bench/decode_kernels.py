"""Where the GPU time of one GPT-345M decode step goes, with the ATen kernels megatron-rs's
CUDA-graph decode step launches (layer norm, fused-QKV linear, KV-cache slot writes, SDPA with an
additive mask over a fixed window, GELU MLP, tied LM head), replayed from a CUDA graph.

    python3 scripts/bench/decode_kernels.py [BATCH] [ATTENTION]

ATTENTION: `default` (SDPA picks, cuDNN on H100), `efficient`, `cudnn`, or `math` (explicit
matmul/softmax). Prints the replay time per step and the kernels by total GPU time.
"""
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

LAYERS, HIDDEN, HEADS, HEAD_DIM, VOCAB, CAPACITY, WINDOW, POSITION = 24, 1024, 16, 64, 50304, 384, 256, 200
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
attention = sys.argv[2] if len(sys.argv) > 2 else "default"
device, dtype = "cuda", torch.bfloat16


def weight(*shape):
    return torch.randn(*shape, device=device, dtype=dtype) * 0.02


def norm():
    return torch.ones(HIDDEN, device=device, dtype=dtype), torch.zeros(HIDDEN, device=device, dtype=dtype)


layers = [
    dict(ln1=norm(), ln2=norm(),
         qkv=(weight(3 * HIDDEN, HIDDEN), torch.zeros(3 * HIDDEN, device=device, dtype=dtype)),
         proj=(weight(HIDDEN, HIDDEN), torch.zeros(HIDDEN, device=device, dtype=dtype)),
         fc1=(weight(4 * HIDDEN, HIDDEN), torch.zeros(4 * HIDDEN, device=device, dtype=dtype)),
         fc2=(weight(HIDDEN, 4 * HIDDEN), torch.zeros(HIDDEN, device=device, dtype=dtype)),
         keys=torch.zeros(batch, HEADS, CAPACITY, HEAD_DIM, device=device, dtype=dtype),
         values=torch.zeros(batch, HEADS, CAPACITY, HEAD_DIM, device=device, dtype=dtype))
    for _ in range(LAYERS)
]
word_embeddings, position_embeddings, final_norm = weight(VOCAB, HIDDEN), weight(1024, HIDDEN), norm()
tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
position = torch.tensor([POSITION], device=device)


def attend(query, keys, values, bias):
    if attention == "math":
        scores = torch.matmul(query, keys.transpose(-1, -2)) * HEAD_DIM ** -0.5 + bias
        return torch.matmul(scores.softmax(-1), values)
    if attention == "default":
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=bias)
    backend = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[attention]
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=bias)


def step():
    positions = position.unsqueeze(0).expand(batch, 1)
    hidden = (F.embedding(tokens, word_embeddings) + F.embedding(positions, position_embeddings)).transpose(0, 1).contiguous()
    hidden_slots = torch.arange(WINDOW, device=device).gt(position).unsqueeze(0)
    bias = torch.zeros(1, WINDOW, device=device, dtype=dtype).masked_fill(hidden_slots, float("-inf"))
    for layer in layers:
        qkv = F.linear(F.layer_norm(hidden, (HIDDEN,), *layer["ln1"]), *layer["qkv"]).view(1, batch, HEADS, 3 * HEAD_DIM)
        query, key, value = (t.permute(1, 2, 0, 3) for t in qkv.split([HEAD_DIM] * 3, -1))
        layer["keys"].index_copy_(2, position, key)
        layer["values"].index_copy_(2, position, value)
        context = attend(query, layer["keys"][:, :, :WINDOW], layer["values"][:, :, :WINDOW], bias)
        hidden = hidden + F.linear(context.permute(2, 0, 1, 3).reshape(1, batch, HIDDEN), *layer["proj"])
        normed = F.layer_norm(hidden, (HIDDEN,), *layer["ln2"])
        hidden = hidden + F.linear(F.gelu(F.linear(normed, *layer["fc1"])), *layer["fc2"])
    return F.linear(F.layer_norm(hidden, (HIDDEN,), *final_norm), word_embeddings)


with torch.no_grad():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    print(f"batch {batch}, attention {attention}: {(time.perf_counter() - start) / 200 * 1e3:.3f} ms per step")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
