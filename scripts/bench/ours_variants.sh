# Sourced by the training benchmarks (after gpu_memory.sh), and by serve.sh for split_variant.
# run_ours_variants adds a row of ours per ;-separated flag set of OURS_VARIANTS (e.g.
# "--no-gradient-accumulation-fusion;--cross-entropy-loss-fusion"), each lever measured on its
# own in the same run: it runs "$@" followed by the set's flags into $SCRATCH/variant<i>.log,
# with the set as its label (variant<i>.label) and its peak GPU memory (variant<i>.mem), which
# training_table.py reads.
# Words of a set of the form NAME=value are set in the run's environment instead (e.g.
# "MEGATRON_RS_OPTIMIZER_KERNELS=0" for the optimizer step on ATen's kernels,
# "MEGATRON_RS_FUSED_ADD_NORM=0" for the residual adds and norms on libtorch's separate kernels).
run_ours_variants() {
    local variants i
    IFS=';' read -r -a variants <<<"${OURS_VARIANTS:-}"
    for i in "${!variants[@]}"; do
        split_variant "${variants[$i]}"
        echo "== ours with ${variants[$i]}" >&2
        echo "${variants[$i]}" >"$SCRATCH/variant$i.label"
        exec 3>"$SCRATCH/variant$i.mem"
        with_memory_peak env "${VARIANT_ENV[@]}" "$@" "${VARIANT_FLAGS[@]}" >"$SCRATCH/variant$i.log"
        exec 3>&-
        cat "$SCRATCH/variant$i.log" >&2
    done
}

# Splits one flag set into VARIANT_ENV (its NAME=value words) and VARIANT_FLAGS (the rest).
split_variant() {
    local word
    local -a words
    read -r -a words <<<"$1"
    VARIANT_ENV=()
    VARIANT_FLAGS=()
    for word in "${words[@]}"; do
        if [[ "$word" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then
            VARIANT_ENV+=("$word")
        else
            VARIANT_FLAGS+=("$word")
        fi
    done
}

# The log interval of a run of $1 iterations: ours reports the mean of its last full interval, so
# the interval is 10 when there are at least two of them and half the run otherwise, keeping the
# first iteration (allocator growth, autotuning, graph capture) out of what is reported.
log_interval() {
    if (( $1 < 2 )); then
        echo "ITERS=$1: a training benchmark needs at least 2 iterations" >&2
        return 1
    fi
    if (( $1 >= 20 )); then echo 10; else echo $(( $1 / 2 )); fi
}
