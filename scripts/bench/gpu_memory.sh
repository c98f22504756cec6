# Sourced by the training benchmarks. with_memory_peak runs "$@" while nvidia-smi samples GPU 0's
# memory every 100 ms into $SCRATCH, and prints the peak (MiB) on fd 3. SAMPLER holds the running
# sampler's pid, for the caller's exit trap.
SAMPLER=""
with_memory_peak() {
    local log="$SCRATCH/memory.$RANDOM"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 100 >"$log" &
    SAMPLER=$!
    "$@"
    kill "$SAMPLER" 2>/dev/null || true
    wait "$SAMPLER" 2>/dev/null || true
    SAMPLER=""
    sort -n "$log" | tail -1 >&3
}
