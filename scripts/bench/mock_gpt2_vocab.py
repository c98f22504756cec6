#!/usr/bin/env python3
"""Writes DIR/vocab.json and DIR/merges.txt: a GPT-2-sized vocabulary (256 byte symbols, filler
tokens, <|endoftext|> last; 50257 entries) for --mock-data runs, which never tokenize text, so
benchmarks get GPT-2's vocabulary size without shipping GPT-2's files.

    mock_gpt2_vocab.py DIR
"""
import json
import sys


def byte_symbols():
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = [b for b in range(256) if b not in keep]
    return [chr(b) for b in keep] + [chr(256 + i) for i in range(len(extra))]


def main():
    out = sys.argv[1]
    tokens = byte_symbols()
    tokens += [f"<filler{i}>" for i in range(50256 - len(tokens))] + ["<|endoftext|>"]
    with open(f"{out}/vocab.json", "w") as f:
        json.dump({t: i for i, t in enumerate(tokens)}, f)
    with open(f"{out}/merges.txt", "w") as f:
        f.write("#version: 0.2\n")


if __name__ == "__main__":
    main()
