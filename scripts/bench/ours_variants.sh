# Sourced by the training benchmarks (after gpu_memory.sh). run_ours_variants adds a row of ours
# per ;-separated flag set of OURS_VARIANTS (e.g. "--no-gradient-accumulation-fusion;
# --cross-entropy-loss-fusion"), each lever measured on its own in the same run: it runs "$@"
# followed by the set's flags into $SCRATCH/variant<i>.log, with the set as its label
# (variant<i>.label) and its peak GPU memory (variant<i>.mem), which training_table.py reads.
run_ours_variants() {
    local variants variant i
    IFS=';' read -r -a variants <<<"${OURS_VARIANTS:-}"
    for i in "${!variants[@]}"; do
        read -r -a variant <<<"${variants[$i]}"
        echo "== ours with ${variants[$i]}" >&2
        echo "${variants[$i]}" >"$SCRATCH/variant$i.label"
        exec 3>"$SCRATCH/variant$i.mem"
        with_memory_peak "$@" "${variant[@]}" >"$SCRATCH/variant$i.log"
        exec 3>&-
        cat "$SCRATCH/variant$i.log" >&2
    done
}
