//! numpy's legacy `RandomState` stream (MT19937), reproduced draw for draw so that shuffles
//! seeded like Megatron's come out in exactly the same order.

mod mt19937;
mod random_state;

pub use mt19937::Mt19937;
pub use random_state::RandomState;
