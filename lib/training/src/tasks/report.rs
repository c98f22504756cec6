//! The results of the zero-shot tasks, printed as Megatron's `evaluate_and_print_results`
//! prints them (character for character) and as JSON.

use serde_json::{json, Value};

use megatron_cli::python_format::{format_exp_upper, format_repr};

/// Megatron's result box: the line between two rules of `-`, one longer than it.
fn boxed(line: &str) -> String {
    let rule = "-".repeat(line.chars().count() + 1);
    format!("{rule}\n{line}\n{rule}")
}

/// WikiText: Σ of the masked token losses and the two token counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WikitextReport {
    pub loss_sum: f64,
    pub num_tokenized_tokens: usize,
    pub num_original_tokens: usize,
    pub num_windows: usize,
}

impl WikitextReport {
    pub fn avg_loss(&self) -> f64 {
        self.loss_sum / (self.num_tokenized_tokens as f64 - 1.0)
    }

    pub fn ppl(&self) -> f64 {
        self.avg_loss().min(20.0).exp()
    }

    /// `(N_bpe − 1) / (N_orig − 1)`.
    pub fn token_ratio(&self) -> f64 {
        (self.num_tokenized_tokens as f64 - 1.0) / (self.num_original_tokens as f64 - 1.0)
    }

    /// The perplexity per original (word-level) token: the number the papers report.
    pub fn adjusted_ppl(&self) -> f64 {
        (self.avg_loss() * self.token_ratio()).min(20.0).exp()
    }

    pub fn megatron_text(&self, task: &str) -> String {
        boxed(&format!(
            " validation results on {task} | avg loss: {} | ppl: {} | adjusted ppl: {} | token ratio: {} |",
            format_exp_upper(self.avg_loss(), 4),
            format_exp_upper(self.ppl(), 4),
            format_exp_upper(self.adjusted_ppl(), 4),
            format_repr(self.token_ratio()),
        ))
    }

    pub fn json(&self, task: &str) -> Value {
        json!({
            "task": task,
            "avg_loss": self.avg_loss(),
            "ppl": self.ppl(),
            "adjusted_ppl": self.adjusted_ppl(),
            "token_ratio": self.token_ratio(),
            "loss_sum": self.loss_sum,
            "num_tokenized_tokens": self.num_tokenized_tokens,
            "num_original_tokens": self.num_original_tokens,
            "num_windows": self.num_windows,
        })
    }
}

/// LAMBADA: how many passages had every target token right, and the summed log-probability
/// of the targets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LambadaReport {
    pub correct: u64,
    pub total: u64,
    pub target_logprob_sum: f64,
}

impl LambadaReport {
    pub fn accuracy(&self) -> f64 {
        self.correct as f64 / self.total as f64
    }

    /// lm-evaluation-harness's `perplexity` aggregate: exp of the mean negative target
    /// log-likelihood per passage.
    pub fn perplexity(&self) -> f64 {
        (-self.target_logprob_sum / self.total as f64).exp()
    }

    pub fn megatron_text(&self, task: &str) -> String {
        boxed(&format!(
            " validation results on {task} | number correct: {} | total examples: {} | avg accuracy: {}",
            format_exp_upper(self.correct as f64, 4),
            format_exp_upper(self.total as f64, 4),
            format_exp_upper(self.accuracy(), 4),
        ))
    }

    /// The lm-eval number, labelled so it is never taken for Megatron's.
    pub fn lm_eval_text(&self) -> String {
        boxed(&format!(
            " lm-evaluation-harness lambada_openai formulation (not Megatron's) | acc: {:.4} | perplexity: {:.4} | correct: {} of {} |",
            self.accuracy(),
            self.perplexity(),
            self.correct,
            self.total,
        ))
    }

    pub fn json(&self, formulation: &str) -> Value {
        json!({
            "formulation": formulation,
            "correct": self.correct,
            "total": self.total,
            "accuracy": self.accuracy(),
            "target_logprob_sum": self.target_logprob_sum,
            "perplexity": self.perplexity(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Strings from Megatron's format expressions in python3 on the same numbers.
    #[test]
    fn lines_match_megatrons() {
        let wiki = WikitextReport {
            loss_sum: 1000.0,
            num_tokenized_tokens: 301,
            num_original_tokens: 251,
            num_windows: 3,
        };
        let line = " validation results on WIKITEXT103 | avg loss: 3.3333E+00 | ppl: 2.8032E+01 | \
                    adjusted ppl: 5.4598E+01 | token ratio: 1.2 |";
        let rule = "-".repeat(124);
        assert_eq!(
            wiki.megatron_text("WIKITEXT103"),
            format!("{rule}\n{line}\n{rule}")
        );
        let lambada = LambadaReport {
            correct: 12,
            total: 50,
            target_logprob_sum: -100.0,
        };
        assert_eq!(
            lambada.megatron_text("LAMBADA").lines().nth(1).unwrap(),
            " validation results on LAMBADA | number correct: 1.2000E+01 | total examples: 5.0000E+01 | avg accuracy: 2.4000E-01"
        );
    }
}
