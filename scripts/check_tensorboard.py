#!/usr/bin/env python3
"""Loads the TensorBoard event files of a directory with TensorBoard's own reader and prints
what it found as JSON: {"file_version": ..., "scalars": {tag: [[step, value], ...]},
"texts": {tag: [[step, text], ...]}}, where file_version is the number TensorBoard parsed from
the "brain.Event:<n>" header (null if none) and texts are the text plugin's summaries.

Used by the tests to prove that real TensorBoard reads the files megatron-rs writes.
Usage: check_tensorboard.py DIR
"""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: check_tensorboard.py DIR")
    # A size guidance of 0 keeps every scalar instead of TensorBoard's default reservoir sample.
    accumulator = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    scalars = {
        tag: [[event.step, event.value] for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }
    texts = {
        tag: [[event.step, event.tensor_proto.string_val[0].decode()] for event in accumulator.Tensors(tag)]
        for tag in accumulator.Tags()["tensors"]
        if accumulator.SummaryMetadata(tag).plugin_data.plugin_name == "text"
    }
    print(json.dumps({"file_version": accumulator.file_version, "scalars": scalars, "texts": texts}))


if __name__ == "__main__":
    main()
