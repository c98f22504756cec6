"""Independent reference for eval_tasks' numbers (tests/eval_tasks.rs): the checkpoint as a
HuggingFace GPT2LMHeadModel (scripts/bench/gpt_to_hf.py), or, given a HuggingFace directory
(config.json), transformers' own model of it; the data built from the spec's description
(megatron-model.md §7.2-7.3) with HF `tokenizers`, scored one sequence at a time.

usage: eval_tasks_reference.py CHECKPOINT TOKENIZER_JSON TASK DATA SEQ_LENGTH STRIDE STRICT
prints one JSON object."""
import json
import math
import os
import re
import sys

import torch
from tokenizers import Tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from gpt_to_hf import load  # noqa: E402

def token_logprobs(model, ids):
    """log p(ids[i+1] | ids[:i+1]) and whether it is the argmax, for every i."""
    logits = model(torch.tensor([ids[:-1]], device=model.device)).logits[0].float().cpu()
    logp = torch.log_softmax(logits, -1)
    targets = torch.tensor(ids[1:])
    picked = logp.gather(-1, targets[:, None])[:, 0].double()
    return picked, logits.argmax(-1) == targets


def detokenize(s):
    # Written from the spec's list of rules, in its order.
    s = s.replace("s '", "s'")
    for a, b in [(" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" : ", ": "), (" ; ", "; "),
                 (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", ")]:
        s = s.replace(a, b)
    for open_, close in ["()", "[]", "{}", '""', "''"]:
        o, c = re.escape(open_), re.escape(close)
        s = re.sub(o + r"\s*([^" + c + r"]*?)\s*" + c, lambda m: open_ + m.group(1) + close, s)
    for a, b in [("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" \u00b0 ", "\u00b0"),
                 (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s")]:
        s = s.replace(a, b)
    return s


def windows(n, seq_length, stride):
    """Megatron's window count (spec §7.3)."""
    return max(math.ceil(max(n - 1 - stride, 0) / stride) + 1, 1)


def main():
    checkpoint, tokenizer_json, task, data, seq_length, stride, strict = sys.argv[1:8]
    seq_length, stride, strict = int(seq_length), int(stride), strict == "1"
    tokenizer = Tokenizer.from_file(tokenizer_json)
    if os.path.exists(os.path.join(checkpoint, "config.json")):
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    else:
        model = load(checkpoint).eval()
    torch.set_grad_enabled(False)

    def encode(text):
        return tokenizer.encode(text).ids

    if task == "WIKITEXT103":
        raw = open(data, "rb").read().decode("utf-8")
        n_orig = len(raw.strip().split(" "))
        tokens = encode(detokenize(raw))
        n = len(tokens)
        count = windows(n, seq_length, stride)
        total = 0.0
        scored = 0
        for k in range(count):
            window = tokens[k * stride: k * stride + seq_length + 1]
            if len(window) < 2:
                continue
            logp, _ = token_logprobs(model, window)
            first = 0 if k == 0 else max(seq_length - stride, 0)
            total -= logp[first:].sum().item()
            scored += len(logp[first:])
        assert scored == n - 1, (scored, n)
        avg = total / (n - 1)
        ratio = (n - 1) / (n_orig - 1)
        print(json.dumps({"loss_sum": total, "avg_loss": avg, "ppl": math.exp(min(20, avg)),
                          "adjusted_ppl": math.exp(min(20, avg * ratio)), "token_ratio": ratio,
                          "num_tokenized_tokens": n, "num_original_tokens": n_orig, "num_windows": count}))
    else:
        texts = [json.loads(line)["text"] for line in open(data) if line.strip()]
        eod = tokenizer.token_to_id("<|endoftext|>")

        def score(pairs):
            correct, logprob = 0, 0.0
            for context, target in pairs:
                logp, right = token_logprobs(model, context + target)
                n = len(target)
                correct += int(bool(right[-n:].all()))
                logprob += logp[-n:].sum().item()
            return {"correct": correct, "total": len(pairs), "target_logprob_sum": logprob}

        def megatron(text):
            if not strict:
                ids = encode(text)
                return ids[:-1], ids[-1:]
            word = text.split()[-1]
            return encode(text[:text.rfind(word)].strip()), encode(" " + word)

        def lm_eval(text):
            words = text.split(" ")
            context, continuation = " ".join(words[:-1]), " " + words[-1]
            if context == "":
                return [eod], encode(continuation)
            spaces = len(context) - len(context.rstrip())
            if spaces:
                continuation, context = context[-spaces:] + continuation, context[:-spaces]
            whole, ctx = encode(context + continuation), encode(context)
            return ctx, whole[len(ctx):]

        print(json.dumps({"megatron": score([megatron(t) for t in texts]),
                          "lm_eval": score([lm_eval(t) for t in texts])}))


if __name__ == "__main__":
    main()
