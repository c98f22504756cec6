//! Expert parallelism: the routed tokens of a micro-batch travel to the ranks of the
//! expert-parallel group that hold their experts, are processed there, and their outputs come
//! back, by Megatron's two dispatchers (`--moe-token-dispatcher-type`). Both give every token
//! the outputs of the same experts; they differ in what travels.

use std::sync::Arc;

use anyhow::{Context, Result};
use tch::{Kind, Tensor};

use super::dispatch::{Permutation, TokensPerExpert};
use super::expert_stack::GroupOrder;
use super::experts::RoutedExperts;
use super::router::Routing;
use megatron_parallel::{
    all_to_all_region, gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region, Communicator,
};

/// `alltoall`: the tokens are grouped by global expert here, each rank's share is sent to it
/// (the counts per expert first, so every rank sizes what it receives; a rank may receive
/// none), regrouped by local expert there, and the outputs return by the reverse path.
pub fn all_to_all(
    tokens: &Tensor,
    routing: &Routing,
    experts: &RoutedExperts,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    let permutation = Permutation::new(tokens, routing, GroupOrder::Ascending)?;
    let ranks = group.size();
    let local = experts.local_experts.len();
    // What this rank sends each rank, per expert of that rank: `[ranks, local]`.
    let sent_counts = permutation.tokens_per_expert.host()?;
    let send_splits: Vec<i64> = sent_counts.chunks(local).map(|c| c.iter().sum()).collect();
    let counts = Tensor::from_slice(sent_counts)
        .view([ranks as i64, local as i64])
        .to_device(tokens.device());
    let received = group
        .all_to_all(&counts, &vec![1; ranks], &vec![1; ranks])
        .context("all-to-all of the Mixture-of-Experts token counts")?;
    // What each rank sends here, per local expert: `received[r][l]`.
    let received = Vec::<i64>::try_from(&received.reshape([-1]))?;
    let recv_splits: Vec<i64> = received.chunks(local).map(|c| c.iter().sum()).collect();
    let arrived = all_to_all_region(&permutation.tokens, group, &send_splits, &recv_splits)
        .context("all-to-all of the Mixture-of-Experts tokens")?;
    let arrived_probs = all_to_all_region(&permutation.probs, group, &send_splits, &recv_splits)
        .context("all-to-all of the Mixture-of-Experts probabilities")?;
    // The arrivals lie rank by rank, each rank's expert by expert; the experts want them
    // expert by expert, each expert's rank by rank.
    let (order, per_expert) = expert_major_order(&received, ranks, local);
    let order = Tensor::from_slice(&order).to_device(tokens.device());
    let outputs = experts.forward(
        &arrived.index_select(0, &order),
        &arrived_probs.index_select(0, &order),
        &TokensPerExpert::on_host(per_expert, tokens.device()),
    )?;
    let back_in_arrival_order = outputs.index_select(0, &order.argsort(0, false));
    let returned = all_to_all_region(&back_in_arrival_order, group, &recv_splits, &send_splits)
        .context("all-to-all of the Mixture-of-Experts outputs")?;
    Ok(permutation.unpermute(&returned))
}

/// For arrivals of `counts[r·local + l]` rows from rank r for local expert l, laid out rank
/// by rank: the row order that groups them expert by expert (rank by rank within an expert),
/// and each local expert's total.
fn expert_major_order(counts: &[i64], ranks: usize, local: usize) -> (Vec<i64>, Vec<i64>) {
    let mut starts = Vec::with_capacity(counts.len());
    let mut offset = 0;
    for &count in counts {
        starts.push(offset);
        offset += count;
    }
    let mut order = Vec::with_capacity(offset as usize);
    let mut per_expert = vec![0; local];
    for (expert, total) in per_expert.iter_mut().enumerate() {
        for rank in 0..ranks {
            let chunk = rank * local + expert;
            order.extend(starts[chunk]..starts[chunk] + counts[chunk]);
            *total += counts[chunk];
        }
    }
    (order, per_expert)
}

/// `allgather`: every rank gathers the group's tokens and routing, runs its own experts over
/// the tokens routed to them, and the partial outputs are summed and scattered back, each
/// rank keeping its own tokens'.
pub fn all_gather(
    tokens: &Tensor,
    routing: &Routing,
    experts: &RoutedExperts,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    // The gradients of gathered inputs are partial on every rank (each ran only its experts):
    // summed back over the group.
    let all_tokens = gather_from_sequence_parallel_region(tokens, group, true)?;
    let all_probs = gather_from_sequence_parallel_region(&routing.probs, group, true)?;
    let all_map = group.all_gather(&routing.map.to_kind(Kind::Uint8), 0)?;
    let local = experts.local_experts.len() as i64;
    let permutation = Permutation::of_map(
        &all_tokens,
        &all_probs.narrow(1, experts.first, local),
        &all_map.narrow(1, experts.first, local).to_kind(Kind::Bool),
    )?;
    let outputs = experts.forward(
        &permutation.tokens,
        &permutation.probs,
        &permutation.tokens_per_expert,
    )?;
    reduce_scatter_to_sequence_parallel_region(&permutation.unpermute(&outputs), group)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_are_regrouped_expert_by_expert() {
        // Two ranks, two local experts: rank 0 sent 2 (expert 0) + 1 (expert 1) rows, rank 1
        // sent 0 + 3.
        let (order, per_expert) = expert_major_order(&[2, 1, 0, 3], 2, 2);
        assert_eq!(order, [0, 1, 2, 3, 4, 5]);
        assert_eq!(per_expert, [2, 4]);
        let (order, per_expert) = expert_major_order(&[1, 2, 3, 0], 2, 2);
        assert_eq!(order, [0, 3, 4, 5, 1, 2]);
        assert_eq!(per_expert, [4, 2]);
    }
}
