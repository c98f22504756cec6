//! How many samples each member of a weighted blend is built for.

/// `ceil(ceil(target·w)·(1+surplus))` per member, as Megatron's
/// `_get_size_per_split_per_dataset`; with `surplus = 0` these are the blend's targets.
pub fn samples_per_dataset(normalized_weights: &[f64], target: u64, surplus: f64) -> Vec<u64> {
    normalized_weights
        .iter()
        .map(|w| ((target as f64 * w).ceil() * (1.0 + surplus)).ceil() as u64)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_round_up_and_surplus_adds_half_a_percent() {
        assert_eq!(samples_per_dataset(&[0.3, 0.7], 1000, 0.0), [300, 700]);
        assert_eq!(samples_per_dataset(&[0.3, 0.7], 1001, 0.0), [301, 701]);
        assert_eq!(samples_per_dataset(&[0.3, 0.7], 1000, 0.005), [302, 704]);
    }
}
