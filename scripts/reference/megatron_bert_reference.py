"""A random HuggingFace MegatronBertForPreTraining and its outputs, for the BERT parity test.

usage: megatron_bert_reference.py OUT_DIR

Writes OUT_DIR/model.safetensors (float32 weights, HF names) and OUT_DIR/io.safetensors: a
padded two-sequence batch with token types, MLM labels (-100 = not predicted) and sentence-order
labels, and the model's MLM and sentence-order logits and both losses, computed in float64 from
the float32 weights.
"""
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import MegatronBertConfig, MegatronBertForPreTraining

# A vocabulary that needs no padding, so both softmaxes run over the same tokens.
VOCAB, HIDDEN, LAYERS, HEADS, FFN, MAX_POS = 128, 64, 2, 4, 128, 32
BATCH, SEQ = 2, 12


def main(out: Path) -> None:
    torch.manual_seed(1234)
    config = MegatronBertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=MAX_POS,
        type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-5,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = MegatronBertForPreTraining(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Non-trivial values everywhere: biases and norms too.
            p.normal_(0.0, 0.1)
            if name.endswith(("ln.weight", "LayerNorm.weight")):
                p.add_(1.0)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
             if v.dtype == torch.float32}
    save_file(state, str(out / "model.safetensors"))

    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    token_type_ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    token_type_ids[:, 5:] = 1
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[1, SEQ - 4:] = 0
    token_type_ids[1, SEQ - 4:] = 0
    labels = torch.full((BATCH, SEQ), -100, dtype=torch.long)
    for row, positions in enumerate([[1, 3, 7, 10], [2, 6]]):
        labels[row, positions] = torch.randint(0, VOCAB, (len(positions),))
    next_sentence_label = torch.tensor([1, 0])

    model = model.double()
    with torch.no_grad():
        output = model(input_ids=input_ids, token_type_ids=token_type_ids,
                       attention_mask=attention_mask)
        logits = output.prediction_logits
        sop = output.seq_relationship_logits
        loss = torch.nn.CrossEntropyLoss()
        lm_loss = loss(logits.view(-1, VOCAB), labels.view(-1))
        sop_loss = loss(sop, next_sentence_label)
    save_file({
        "input_ids": input_ids, "token_type_ids": token_type_ids,
        "attention_mask": attention_mask, "labels": labels,
        "next_sentence_label": next_sentence_label,
        "prediction_logits": logits.contiguous(), "seq_relationship_logits": sop.contiguous(),
        "lm_loss": lm_loss.reshape(1), "sop_loss": sop_loss.reshape(1),
    }, str(out / "io.safetensors"))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
